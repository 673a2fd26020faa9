"""One blocking connection to a supervisor or a worker: frames in and out, the hello probe, and
reading until a response. Plain sockets and stdlib json, no event loop.

The layer under both the blocking client (``_syncclient``) and autostart (``_autostart``), so
neither imports the other's connection code: autostart probes and talks to a supervisor
through this, and the client starts one through autostart.
"""

from __future__ import annotations

import _socket  # not socket: its import (enum conversions) costs a warm prompt ~10 %
import os

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._defaults import CLIENT, ClientTiming
from ._depth import MAX_DEPTH, nesting_depth
from ._errors import AgentdError, ErrorCode, not_accepting
from ._trust import prove_peer, prove_socket_dir
from ._wirerules import MAX_FRAME
from ._wirestr import TAG_IN_FRAME, from_wire, to_wire

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ._paths import Layout
    from .timing import Timing



class _Lost(Exception):
    """The connection ended before the response."""


class _Malformed(AgentdError):
    """The daemon sent a frame that is not a JSON object (or nests too deeply to read)."""


def _dict(value: object) -> dict[str, Any]:
    """``value`` if it is a JSON object, else ``{}`` (a hostile peer's fields are not trusted)."""
    return value if isinstance(value, dict) else {}


# between connects to a supervisor whose listen backlog is full (a unix socket cannot be
# waited on for room in it)
CONNECT_RETRY_PAUSE = 0.02
_RECV_SIZE = 1 << 18  # a whole chunk event (256 KiB of output, base64) in a few reads
_PEEK_SIZE = 1024  # where the next frame's line ends, if it is a short one (a raw chunk's)


class _Conn:
    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self._scanned = 0  # bytes of ``buf`` known to hold no newline

    def read_message(self, timeout: float | None) -> dict[str, Any] | None:
        self._timeout(timeout)
        # each byte is scanned for the newline once, and a big frame is not copied per read
        while (nl := self.buf.find(b"\n", self._scanned)) < 0:
            self._scanned = len(self.buf)
            if len(self.buf) > MAX_FRAME:
                raise AgentdError(ErrorCode.FRAME_TOO_LARGE, "daemon sent an oversized line")
            chunk = self.sock.recv(self._line_size())
            if not chunk:
                return None
            self.buf += chunk
        line = bytes(self.buf[:nl])
        del self.buf[: nl + 1]
        self._scanned = 0
        if nesting_depth(line) > MAX_DEPTH:
            raise _Malformed(ErrorCode.INTERNAL, f"daemon sent a frame nested >{MAX_DEPTH} deep")
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            kind = "nests too deeply" if isinstance(exc, RecursionError) else "is not JSON"
            raise _Malformed(ErrorCode.INTERNAL, f"daemon sent a frame that {kind}") from None
        if not isinstance(obj, dict):
            raise _Malformed(ErrorCode.INTERNAL, "daemon sent a non-object frame")
        if TAG_IN_FRAME in line:  # text that is not UTF-8, as the daemon sent it
            obj = from_wire(obj)
            if not isinstance(obj, dict):
                raise _Malformed(ErrorCode.INTERNAL, "daemon sent a non-object frame")
        frame: dict[str, Any] = obj
        raw = frame.get("raw")
        if frame.get("type") == "event" and type(raw) is int and raw:
            # the event's bytes follow its frame, unencoded
            if not 0 < raw <= MAX_FRAME or not isinstance(frame.get("event"), dict):
                raise _Malformed(ErrorCode.INTERNAL, "daemon sent a malformed raw event")
            data = self._receive_payload(raw)
            if data is None:
                return None
            frame["event"]["data"] = data
        return frame

    def _timeout(self, timeout: float | None) -> None:
        """Set the socket's timeout only when it changes (each setting is a system call, and
        a stream reads thousands of frames with the same one)."""
        if self.sock.gettimeout() != timeout:
            self.sock.settimeout(timeout)

    def _line_size(self) -> int:
        """How much to read for the next frame's line: with nothing buffered, a look at what
        is waiting finds where a line ends, so a raw payload after it is left for
        :meth:`_receive_payload` (read once, not through ``buf``); else a big read."""
        if self.buf:
            return _RECV_SIZE
        head = self.sock.recv(_PEEK_SIZE, _socket.MSG_PEEK)
        nl = head.find(b"\n")
        return nl + 1 if nl >= 0 else _RECV_SIZE

    def _receive_payload(self, size: int) -> bytes | None:
        """The ``size`` bytes after a raw event's frame, read straight into the ``bytes`` the
        event's readers take when they are all there (one copy), else into a buffer of their
        own; never through ``buf``. ``None`` if the connection ended first."""
        if self.buf:
            data = bytearray(size)
            have = min(len(self.buf), size)
            data[:have] = self.buf[:have]
            del self.buf[:have]
        else:
            # usually the whole payload is waiting: one read, into the bytes themselves
            first = self.sock.recv(size)
            if not first:
                return None
            if len(first) == size:
                return first
            data = bytearray(size)
            have = len(first)
            data[:have] = first
        with memoryview(data) as view:
            while have < size:
                got = self.sock.recv_into(view[have:])
                if not got:
                    return None
                have += got
        return bytes(data)

    def send(self, obj: dict[str, Any], timeout: float | None = None) -> None:
        self._timeout(timeout)
        # a path, argument or prompt that is not UTF-8 travels as {"$bytes": ...}
        self.sock.sendall(json.dumps(to_wire(obj), separators=(",", ":")).encode() + b"\n")

    def close(self) -> None:
        self.sock.close()


def _lease_holder(layout: Layout) -> int | None:
    """The pid the socket's lease names, if that process is alive."""
    from . import _fs

    try:
        holder = json.loads(_fs.read_bytes(layout.lease_path) or b"{}")
    except (OSError, ValueError):
        return None
    pid = holder.get("pid") if isinstance(holder, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except OSError:
        return None
    return pid


def probe(
    layout: Layout,
    timing: Timing | ClientTiming = CLIENT,
    *,
    patience: float = 0.0,
    progress: Callable[[str], object] | None = None,
    trace: Callable[[str], object] | None = None,
) -> tuple[_Conn, dict[str, Any]] | None:
    """Prove the socket, connect and read the hello; ``None`` if nobody listens.

    Nothing is sent before the socket's dir and the listening peer are proven ours.
    ``trace`` (``-v``) is told each step, one line each.

    Raises:
        AgentdError: ``permission_denied`` if the socket dir or its peer is not ours.
        AgentdError: ``daemon_unavailable`` if something accepts but sends no hello in time.
    """
    try:
        prove_socket_dir(layout.socket_dir)
    except AgentdError as exc:
        if exc.code == ErrorCode.DAEMON_UNAVAILABLE:
            if trace is not None:
                trace(f"socket dir {layout.socket_dir} does not exist: nobody listens")
            return None  # no socket dir: nobody listens
        raise
    if trace is not None:
        trace(f"socket dir {layout.socket_dir}: proven ours (owner uid {os.getuid()},"
              " mode 0700, not a symlink)")
    s, waited = _connect_patiently(layout, timing, patience, progress, trace)
    if s is None:
        return None
    try:
        prove_peer(s, layout.socket)
    except BaseException:
        s.close()
        raise
    if trace is not None:
        trace(f"connected to {layout.socket}; its peer proven ours (SO_PEERCRED uid"
              f" {os.getuid()})")
    conn = _Conn(s)
    wait = timing.hello_timeout  # (patience is one budget: connecting, then the hello)
    try:
        while True:
            try:
                hello = conn.read_message(wait)
                break
            except TimeoutError:
                # a live supervisor that is only slow (busy, swapped out) gets patience, with
                # a progress line; a dead or missing one does not
                waited += wait
                holder = _lease_holder(layout)
                if waited >= patience or holder is None:
                    raise
                if progress is not None:
                    progress(f"supervisor pid {holder} not answering for {round(waited, 1):g} s…")
                wait = min(timing.patience_tick, patience - waited)
    except TimeoutError:
        conn.close()
        raise AgentdError(
            ErrorCode.DAEMON_UNAVAILABLE,
            f"the supervisor on {layout.socket} accepted but sent no hello within"
            f' {round(waited, 1):g}s — run "trio-agentd doctor --fix"',
            {"wedged": True},
        ) from None
    except (OSError, _Malformed):
        conn.close()
        return None
    if hello is None:
        conn.close()
        return None
    if hello.get("type") != "hello":
        conn.close()
        err = _dict(hello.get("error"))
        raise AgentdError(
            str(err.get("code", ErrorCode.INTERNAL)), str(err.get("message", "no hello"))
        )
    if trace is not None:
        trace(f"hello: supervisor pid {hello.get('pid')}, trio-agentd"
              f" {hello.get('app_version')} (protocol {hello.get('protocol')})")
    return conn, hello


def _connect_patiently(
    layout: Layout,
    timing: Timing | ClientTiming,
    patience: float,
    progress: Callable[[str], object] | None,
    trace: Callable[[str], object] | None,
) -> tuple[_socket.socket | None, float]:
    """A connected socket (``None``: nobody listens) and the seconds spent connecting.

    A full listen backlog (the connect times out, or fails at once with EAGAIN as a unix
    socket's does) is a live supervisor that is only busy — many clients at once on a loaded
    machine — while its lease holder lives: it gets ``patience``, as for its hello, with a
    progress line every ``patience_tick``; advice to repair comes only past patience, or at
    once when nothing holds the lease.

    Raises:
        AgentdError: ``daemon_unavailable`` (``wedged``) past patience, or nobody's lease.
    """
    import time

    start = time.monotonic()
    next_line = 0.0  # when the next progress line is due (seconds since start)
    while True:
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        s.settimeout(timing.connect_timeout)
        try:
            s.connect(layout.socket)
            return s, time.monotonic() - start
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            s.close()
            if trace is not None:
                trace(f"nobody listens on {layout.socket} ({exc.strerror})")
            return None, 0.0
        except (TimeoutError, BlockingIOError):
            s.close()
        except OSError:
            s.close()
            raise
        waited = time.monotonic() - start
        holder = _lease_holder(layout)
        if waited >= patience or holder is None:
            raise not_accepting(layout.socket, waited) from None
        if progress is not None and waited >= next_line:
            next_line = waited + timing.patience_tick
            progress(f"supervisor pid {holder} not accepting connections for {waited:.1f} s…")
        time.sleep(min(CONNECT_RETRY_PAUSE, patience - waited))


class _Liveness:
    """How a direct route tells a hung worker from a silent turn: after ``link_ping_interval``
    with nothing arriving, ping it; if nothing at all arrives within ``link_ping_timeout`` of
    the ping, it is unresponsive (stopped, or its event loop blocked) — a worker whose loop
    runs answers at once, however long its turn is silent. Time spent in ``on_event`` (the
    caller's own pace) never counts as silence: only time waiting in ``recv``.

    The same watch guards a request to the supervisor (``supervisor=True``): a command it
    works on for long is fine (it answers pings meanwhile), a supervisor stopped or blocked
    after the hello is not waited on forever — after ``patience`` without even a ping's
    answer the request fails, naming ``doctor --fix``."""

    __slots__ = ("pid", "ping", "session", "socket", "timing")

    def __init__(
        self, timing: Timing | ClientTiming, ping: dict[str, Any], session: str, pid: object,
        *, socket: str | None = None,
    ) -> None:
        self.timing = timing
        self.ping = ping
        self.session = session
        self.pid = pid
        self.socket = socket  # set: this watches the supervisor on that socket

    def read(self, conn: _Conn) -> dict[str, Any] | None:
        """The next message, pinging a silent worker.

        Raises:
            AgentdError: ``worker_unresponsive``: the ping was not answered in time.
        """
        try:
            return conn.read_message(self.timing.link_ping_interval)
        except TimeoutError:
            pass
        timeout = self.timing.link_ping_timeout if self.socket is None else self.timing.patience
        try:
            conn.send(self.ping, timeout)
            return conn.read_message(timeout)
        except TimeoutError:
            if self.socket is not None:
                raise AgentdError(
                    ErrorCode.DAEMON_UNAVAILABLE,
                    f"the supervisor (pid {self.pid}) on {self.socket} answers nothing, not even"
                    f" a ping within {timeout:g}s (stopped, or its event loop is blocked) — run"
                    ' "trio-agentd doctor --fix"',
                    {"wedged": True, "pid": self.pid},
                ) from None
            raise AgentdError(
                ErrorCode.WORKER_UNRESPONSIVE,
                f"session {self.session}: its worker (pid {self.pid}) answers nothing, not even"
                f" a ping within {timeout:g}s (stopped, or its event loop is blocked) — send"
                " the prompt again later (the same id gets its result if it ran)",
                {"session": self.session, "pid": self.pid},
            ) from None


def _await_response(
    conn: _Conn,
    rid: int | str,
    on_event: Callable[[dict[str, Any]], None] | None,
    liveness: _Liveness | None = None,
) -> Any:
    """Read until the response to ``rid`` (events go to ``on_event``); its result.

    Raises:
        _Lost: the connection ended first.
        AgentdError: the command failed, or ``worker_unresponsive`` (with ``liveness``: the
            peer answered nothing, not even a ping).
    """
    while True:
        msg = conn.read_message(None) if liveness is None else liveness.read(conn)
        if msg is None:
            raise _Lost("the connection closed before the response")
        if msg.get("id") != rid:
            if msg.get("type") == "response" and msg.get("id") is None and not msg.get("ok"):
                err = _dict(msg.get("error"))
                raise AgentdError(str(err.get("code")), str(err.get("message")))
            continue
        if msg.get("type") == "event":
            if on_event is not None:
                on_event(_dict(msg.get("event")))
            continue
        if msg.get("type") == "response":
            if msg.get("ok"):
                return msg.get("result")
            err = _dict(msg.get("error"))
            raise AgentdError(
                str(err.get("code", ErrorCode.INTERNAL)),
                str(err.get("message", "request failed")),
                _dict(err.get("details")),
            )
