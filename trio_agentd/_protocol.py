"""The JSON-lines protocol: message types, a size-bounded line splitter, the codec.

Pure: no trio, no sockets. The same messages travel on the public socket (client ↔ supervisor)
and on each worker's private socket (supervisor ↔ worker), which adds the worker hello and the
authentication exchange.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ._depth import MAX_DEPTH as MAX_DEPTH
from ._depth import nesting_depth
from ._errors import AgentdError, ErrorCode
from ._plain import enc_hook
from ._text import CONTROL_CLASS
from ._version import APP_VERSION as APP_VERSION
from ._version import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._wirerules import MAX_FRAME as MAX_FRAME  # bytes per line, newline excluded
from ._wirestr import TAG_IN_FRAME

# requests one connection may have in flight; past that it is not read from (its sender's
# writes then block: backpressure, not memory)
MAX_IN_FLIGHT = 64

CAPABILITIES = ["prompt", "stream", "sessions", "create_session", "kill_session", "shutdown"]

OPS = frozenset(
    {
        "ping",
        "status",
        "create_session",
        "prompt",
        "sessions",
        "kill_session",
        "remove_session",
        "retry_session",
        "route",
        "cancel",
        "restart",
        "shutdown",
    }
)

# ids, op names and client ids are names: no control or bidi-control characters
_NoControl = msgspec.Meta(pattern=f"\\A[^{CONTROL_CLASS}]*\\Z")
Name = Annotated[str, _NoControl]
# integer ids are signed 64-bit (msgspec would take any size; other peers could not)
RequestId = Name | Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class _Msg(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    pass


class Hello(_Msg, tag="hello"):
    protocol: int
    app_version: str
    generation: str
    pid: int
    start_id: str | None
    socket: str
    capabilities: list[str] = msgspec.field(default_factory=list)
    # the home (state dir) this supervisor serves; None from a supervisor older than the field
    home: str | None = None


class Request(_Msg, tag="request", forbid_unknown_fields=True):
    """A command. Unknown fields are refused (``bad_request`` naming the field): a typo such
    as ``arg`` for ``args`` must not silently become an empty argument list. Other messages
    accept unknown fields, so a newer supervisor's hello and responses still reach an older
    client (which can then say ``version_mismatch``)."""

    id: RequestId
    op: Name
    client_id: Name = ""
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorBody(msgspec.Struct, kw_only=True):
    code: str
    message: str
    details: dict[str, Any] = msgspec.field(default_factory=dict)


class Response(_Msg, tag="response"):
    id: RequestId | None
    ok: bool
    result: Any = msgspec.UNSET
    error: ErrorBody | msgspec.UnsetType = msgspec.UNSET


class Event(_Msg, tag="event"):
    """Something a request produced before its response (an output chunk).

    ``raw`` > 0: exactly that many bytes follow the frame's newline, unencoded: the event's
    ``data``, which the frame itself leaves out. Sent only to a peer that asked for it (the
    request's ``raw`` argument); a reader puts the bytes back as ``event["data"]``.
    """

    id: RequestId
    event: dict[str, Any]
    raw: int = 0


# --- the private worker link -------------------------------------------------------------


class WorkerHello(_Msg, tag="worker_hello"):
    session: str
    pid: int
    start_id: str | None
    protocol: int = PROTOCOL_VERSION
    # the worker's own version (None from a worker older than the field)
    app_version: str | None = None


class Auth(_Msg, tag="auth"):
    token: str
    generation: str
    pid: int
    start_id: str | None
    socket: str


class AuthOk(_Msg, tag="auth_ok"):
    session: str
    pid: int


class Attach(_Msg, tag="attach"):
    """Sent by a client to a worker, after the worker's hello: the supervisor's route grant."""

    grant: str


class Notice(_Msg, tag="notice"):
    """Sent by a worker to its supervisor, unasked: a turn started or ended (clients prompt the
    worker directly, so this is how the supervisor knows a session's turns and activity)."""

    kind: str  # "turn_started" | "turn_done"
    turn: int = 0
    # turn_done: why the agent could not be started ("": it could, or the turn said nothing)
    failure: str = ""


class Dropped(_Msg, tag="dropped"):
    """Sent by a worker as it drops a supervisor connection (then it closes)."""

    code: str
    message: str


Message = (
    Hello | Request | Response | Event | WorkerHello | Auth | AuthOk | Dropped | Attach | Notice
)

_encoder = msgspec.json.Encoder(enc_hook=enc_hook)  # error codes are plain StrEnums
_decoder: msgspec.json.Decoder[Message] = msgspec.json.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One frame: the message as compact JSON plus a newline.

    A string that is not valid UTF-8 (a surrogate-escaped path, argument or prompt) goes as
    ``{"$bytes": ...}`` in the free-form fields (``args``, ``result``, ``event``, error
    ``details``; :mod:`._wirestr`), and shown with ``\\xNN`` escapes in a typed text field
    (an error's message).
    """
    try:
        return _encoder.encode(msg) + b"\n"
    except UnicodeEncodeError:
        pass
    from ._wirestr import shown, to_wire

    def fix(obj: Any, free: bool) -> Any:
        if isinstance(obj, dict):
            return {k: (to_wire(v) if free or k in _FREE_FIELDS else fix(v, False))
                    for k, v in obj.items()}
        if isinstance(obj, list):
            return [fix(v, free) for v in obj]
        return shown(obj) if isinstance(obj, str) else obj

    return _encoder.encode(fix(msgspec.to_builtins(msg, enc_hook=enc_hook), False)) + b"\n"


_FREE_FIELDS = frozenset({"args", "result", "event", "details"})


def _from_wire(msg: Message) -> Message:
    from ._wirestr import from_wire

    if isinstance(msg, Request):
        msg.args = from_wire(msg.args)
    elif isinstance(msg, Response):
        if not isinstance(msg.result, msgspec.UnsetType):
            msg.result = from_wire(msg.result)
        if not isinstance(msg.error, msgspec.UnsetType):
            msg.error.details = from_wire(msg.error.details)
    elif isinstance(msg, Event):
        msg.event = from_wire(msg.event)
    return msg


def encode_raw_event(request_id: RequestId, event: dict[str, Any], data: bytes) -> bytes:
    """The header frame of an event whose ``data`` follows it raw (see :class:`Event`)."""
    return encode(Event(id=request_id, event=event, raw=len(data)))


def decode(line: bytes) -> Message:
    """Decode one frame (without its newline) into a typed message.

    Raises:
        AgentdError: ``bad_request`` naming what is wrong (not JSON, not an object, unknown
            type or field, a field of the wrong type, a name with control characters, a
            number out of range, nesting deeper than ``MAX_DEPTH``). Never anything else.
    """
    if nesting_depth(line) > MAX_DEPTH:
        raise AgentdError(
            ErrorCode.BAD_REQUEST, f"invalid message: nested deeper than {MAX_DEPTH} levels"
        )
    try:
        msg = _decoder.decode(line)
        return _from_wire(msg) if TAG_IN_FRAME in line else msg
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Expected `str` matching regex"):  # the _NoControl pattern
            where = text.rpartition(" - at ")[2]
            text = f"control or bidi-control characters are not allowed - at {where}"
        raise AgentdError(ErrorCode.BAD_REQUEST, f"invalid message: {text}") from None
    except msgspec.DecodeError as exc:
        raise AgentdError(ErrorCode.BAD_REQUEST, f"malformed JSON: {exc}") from None
    except RecursionError:  # the depth limit should make this unreachable; never a traceback
        raise AgentdError(ErrorCode.BAD_REQUEST, "invalid message: nested too deeply") from None


class _IdOnly(msgspec.Struct):
    id: RequestId | None = None


_id_decoder = msgspec.json.Decoder(_IdOnly)


def request_id_of(line: bytes) -> RequestId | None:
    """The id of a frame :func:`decode` refused, when it has a valid one (to answer it)."""
    if nesting_depth(line) > MAX_DEPTH:
        return None
    try:
        return _id_decoder.decode(line).id
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return None


def ok(request_id: RequestId | None, result: Any) -> Response:
    return Response(id=request_id, ok=True, result=result)


def fail(request_id: RequestId | None, error: AgentdError) -> Response:
    return Response(
        id=request_id,
        ok=False,
        error=ErrorBody(code=error.code, message=error.message, details=error.details),
    )


def error_of(response: Response) -> AgentdError:
    """The error a failed response carries, as an exception to raise on the client side."""
    body = response.error
    if isinstance(body, msgspec.UnsetType):
        return AgentdError(ErrorCode.INTERNAL, "failed response without an error body")
    return AgentdError(body.code, body.message, body.details)


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj, enc_hook=enc_hook)


class FrameTooLarge(AgentdError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            ErrorCode.FRAME_TOO_LARGE,
            f"a line exceeded the {limit}-byte frame limit; connection closed",
            {"limit": limit},
        )


class LineBuffer:
    """Split a byte stream into lines of at most ``limit`` bytes (newline excluded).

    ``feed`` returns the complete lines so far; a line that grows past the limit raises
    :class:`FrameTooLarge` as soon as that is known, without buffering the rest of it.
    """

    __slots__ = ("_buf", "_limit", "_scanned")

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._limit = limit
        self._scanned = 0

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        lines: list[bytes] = []
        start = 0
        while True:
            nl = self._buf.find(b"\n", max(start, self._scanned))
            if nl < 0:
                break
            if nl - start > self._limit:
                raise FrameTooLarge(self._limit)
            lines.append(bytes(self._buf[start:nl]))
            start = nl + 1
            self._scanned = start
        if start:
            del self._buf[:start]
        self._scanned = len(self._buf)
        if len(self._buf) > self._limit:
            raise FrameTooLarge(self._limit)
        return lines

    @property
    def pending(self) -> int:
        """Bytes of an unfinished line."""
        return len(self._buf)
