"""The supervisor's wire side: one client connection read, each request dispatched to its op.

Theory of operation
-------------------
A connection gets the hello first (after the cap on connections and the peer's uid are
checked), then its frames are read one by one: a frame that is no request is answered
``bad_request`` with its own id if it has one, and reading goes on; a client that pipelines
without reading its answers stops being read from at ``MAX_IN_FLIGHT``. Every request but
``shutdown`` first confirms the ownership record. An op's error is its answer, one line; an
exhaustion (EMFILE, ENOMEM) is logged once per cause and interval, never a traceback. Nothing a
client sends or does escapes :meth:`Dispatcher.serve_client`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Protocol

import trio
from trio_util import AsyncValue

from ._errors import AgentdError, ErrorCode, single_errors
from ._exhaustion import RateLimitedLog, exhaustion_error, is_exhaustion
from ._grant import make_grant
from ._handle import SessionRetired
from ._identity import peer_credentials
from ._paths import Layout
from ._protocol import (
    MAX_IN_FLIGHT,
    OPS,
    FrameTooLarge,
    Hello,
    Request,
    RequestId,
    decode,
    encode,
    error_of,
    fail,
    ok,
    request_id_of,
)
from ._protocol import Event as EventMsg
from ._recovery import Mode, StopReason
from ._registry import Ownership
from ._stream import MessageStream
from ._supervisorsessions import SessionTable
from .timing import LINK_CLOSE_TIMEOUT, Timing, kill_answer_bound

log = logging.getLogger("trio_agentd.supervisor")


class OpsHost(Protocol):
    """What the ops use of the supervisor: its identity, its table, its ownership, its stop."""

    @property
    def generation(self) -> str: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def timing(self) -> Timing: ...
    @property
    def rl(self) -> RateLimitedLog: ...
    @property
    def inflight(self) -> AsyncValue[int]: ...
    @property
    def shutdown_requested(self) -> trio.Event: ...
    @property
    def ownership(self) -> Ownership: ...
    @property
    def table(self) -> SessionTable: ...
    @property
    def service_nursery(self) -> trio.Nursery: ...

    def request_shutdown(self, *, stop_workers: bool, restart: bool = False) -> None: ...

    def hello(self) -> Hello: ...

    def status(self) -> dict[str, Any]: ...


class Dispatcher:
    """Serves client connections for ``sup``: reads requests, runs each op, answers.

    Args:
        max_clients: beyond it a connection gets one ``resource_exhausted`` line.
    """

    def __init__(self, sup: OpsHost, *, max_clients: int) -> None:
        self.sup = sup
        self.table = sup.table
        self.max_clients = max_clients
        self.clients_open = 0  # client connections being served now
        self._hello: bytes | None = None  # the hello frame, encoded once: it never changes

    async def serve_client(self, stream: trio.abc.Stream) -> None:
        """Serve one client connection. Nothing a client sends or does can escape from here."""
        ms = MessageStream(stream)
        try:
            if self.clients_open > self.max_clients:
                self.sup.rl.error(("clients", "cap"), "refused a client connection: %d are"
                                  " open (the most is %d)", self.clients_open - 1,
                                  self.max_clients)
                with trio.move_on_after(LINK_CLOSE_TIMEOUT):
                    await ms.send(fail(None, AgentdError(
                        ErrorCode.RESOURCE_EXHAUSTED,
                        f"the supervisor serves at most {self.max_clients} client"
                        " connections at once — close idle clients and try again",
                        {"limit": "max_clients", "value": self.max_clients})))
                return
            uid = _peer_uid(stream)
            if uid is not None and uid != os.getuid():
                await ms.send(fail(None, AgentdError(
                    ErrorCode.PERMISSION_DENIED,
                    f"uid {uid} may not use the supervisor of uid {os.getuid()}")))
                return
            if self._hello is None:
                self._hello = encode(self.sup.hello())
            await ms.send_raw(self._hello)  # ps probes every supervisor: each hello is cheap
            if ms.peer_closed():
                return  # a probe (ps, doctor): it shut its side at once and takes the hello only
            inflight = AsyncValue(0)
            # one error from the nursery comes out bare: a broken client is no error, and
            # EMFILE is the rate-limited line below, never a traceback per connection
            with single_errors():
                async with trio.open_nursery() as requests:
                    await self.read_requests(ms, requests, inflight)
                    # the client half-closed or broke: let its requests finish, bounded
                    with trio.move_on_after(self.sup.timing.stop_grace):
                        await inflight.wait_value(0)
                    requests.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            if is_exhaustion(exc):
                self.sup.rl.error(("client", type(exc).__name__, getattr(exc, "errno", None)),
                                  "client connection failed: %s", exc)
            else:
                log.exception("client connection failed")
        finally:
            self.clients_open -= 1
            await ms.aclose()

    async def read_requests(
        self, ms: MessageStream, requests: trio.Nursery, inflight: AsyncValue[int]
    ) -> None:
        while True:
            # a client that pipelines without reading its answers stops being read from
            await inflight.wait_value(lambda n: n < MAX_IN_FLIGHT)
            try:
                line = await ms.receive_line()
            except FrameTooLarge as exc:
                with trio.move_on_after(LINK_CLOSE_TIMEOUT), contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError
                ):
                    await ms.send(fail(None, exc))
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if line is None:
                return
            try:
                msg = decode(line)
                if not isinstance(msg, Request):
                    raise AgentdError(
                        ErrorCode.BAD_REQUEST, f"expected a request, got {type(msg).__name__}"
                    )
            except AgentdError as exc:
                try:
                    await ms.send(fail(_guess_id(line), exc))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                continue
            inflight.value += 1  # counted before the task starts: a half-close cannot race it
            requests.start_soon(self._dispatch, ms, msg, inflight)

    async def _dispatch(self, ms: MessageStream, req: Request, inflight: AsyncValue[int]) -> None:
        self.sup.inflight.value += 1
        try:
            await self._dispatch_one(ms, req)
        finally:
            inflight.value -= 1
            self.sup.inflight.value -= 1

    async def _dispatch_one(self, ms: MessageStream, req: Request) -> None:
        try:
            if req.op != "shutdown":
                if self.sup.shutdown_requested.is_set():
                    raise AgentdError(ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down")
                await self.sup.ownership.ensure_current()
            with single_errors():  # an op's nursery: its one error is classified as itself
                result = await self.run_op(ms, req)
            response = ok(req.id, result)
        except AgentdError as exc:
            response = fail(req.id, exc)
        except OSError as exc:
            if not is_exhaustion(exc):
                log.exception("internal error in %s", req.op)
                response = fail(req.id, AgentdError(ErrorCode.INTERNAL, f"internal error: {exc}"))
            else:
                # out of descriptors (or memory) opening a file for this request: its error,
                # one line in the log per cause and interval, no traceback
                err = exhaustion_error(exc)
                self.sup.rl.error(("op", exc.errno), "%s: %s", req.op, err.message)
                response = fail(req.id, err)
        except Exception as exc:
            log.exception("internal error in %s", req.op)
            response = fail(req.id, AgentdError(ErrorCode.INTERNAL, f"internal error: {exc}"))
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await ms.send(response)
        if req.op == "shutdown" and response.ok:
            self.sup.request_shutdown(stop_workers=bool(req.args.get("stop_workers", True)))
        elif req.op == "restart" and response.ok:
            self.sup.request_shutdown(stop_workers=False, restart=True)

    async def run_op(self, ms: MessageStream, req: Request) -> Any:
        """The one list of ops the supervisor serves (``OPS``), each to its own function."""
        args = req.args
        match req.op:
            case "ping":
                return {"pong": True, "generation": self.sup.generation, "pid": os.getpid()}
            case "status":
                return self.sup.status()
            case "sessions":
                return await self.list_sessions()
            case "create_session":
                return await self.create_session(args)
            case "prompt":
                return await self.prompt(ms, req)
            case "route":
                return await self.route(args)
            case "cancel":
                return await self.cancel(req)
            case "kill_session":
                return await self.kill_session(_str_arg(args, "session"))
            case "remove_session":
                return await self.table.remove_session(_str_arg(args, "session"),
                                                       force=args.get("force") is True)
            case "retry_session":
                return await self.retry_session(_str_arg(args, "session"))
            case "shutdown":
                return {"generation": self.sup.generation, "pid": os.getpid(),
                        "stop_workers": bool(args.get("stop_workers", True))}
            case "restart":
                return {"generation": self.sup.generation, "pid": os.getpid(),
                        "sessions": len(self.table.sessions)}
            case _:
                raise AgentdError(
                    ErrorCode.UNKNOWN_OP,
                    f"unknown op {req.op!r} — known: {', '.join(sorted(OPS))}",
                )

    # the ops ----------------------------------------------------------------------------------
    async def list_sessions(self) -> list[dict[str, Any]]:
        await self.table.refresh_from_workers()
        return [h.summary() for h in sorted(self.table.sessions.values(),
                                             key=lambda h: h.session_id)]

    async def create_session(self, args: dict[str, Any]) -> dict[str, Any]:
        while True:
            h = await self.table.get_session(
                _str_arg(args, "session"), _opt_str(args, "agent"),
                _opt_str(args, "cwd"), create=True, env=_opt_env(args),
                cwd_given=args.get("cwd_given") is True,
            )
            with contextlib.suppress(SessionRetired):  # killed meanwhile: anew
                await self.table.wait_ready(h)
                return h.summary()

    async def cancel(self, req: Request) -> Any:
        args = req.args
        h = self.table.known(_str_arg(args, "session"))
        command_id = args.get("command_id")
        response = await h.call(
            "cancel", {} if command_id is None else {"command_id": command_id},
            client_id=req.client_id, on_event=None,
        )
        if not response.ok:
            raise error_of(response)
        return response.result

    async def kill_session(self, sid: str) -> dict[str, Any]:
        victim = self.table.known(sid)
        # durable before it acts (the descriptor says stopping: kill); its turn ends
        # at once with session_killed; then the session is forgotten, even if this
        # answer gives up waiting — or by the next supervisor if this one dies
        kill_running = victim.stopping and victim.stop_reason is StopReason.KILL
        victim.request_stop(graceful=True, reason=StopReason.KILL)
        if not kill_running:
            self.sup.service_nursery.start_soon(self.table.complete_kill, victim)
        with trio.move_on_after(kill_answer_bound(self.sup.timing)):
            await victim.wait_stop_handled()
            if victim.mode.value is Mode.STOPPED:
                await victim.retired.wait()  # forgotten by complete_kill
        stopped = victim.retired.is_set()
        return {"session": sid, "killed": stopped,
                "state": "killed" if stopped else str(victim.mode.value)}

    async def retry_session(self, sid: str) -> dict[str, Any]:
        again = self.table.known(sid)
        failed = bool(again.cause)  # failed, or its last turn could not start its agent
        again.retry()
        with trio.move_on_after(self.sup.timing.worker_connect_timeout):
            await again.wait_retried()
        return {**again.summary(), "retried": failed}

    async def route(self, args: dict[str, Any]) -> dict[str, Any]:
        """The data plane's entry: make the session ready (creating or recovering it) and grant
        the client a direct route to its worker.

        ``resend``: the client asks again for a command it already sent (its route failed). If
        the session was killed meanwhile the command is not carried into a session made anew:
        ``session_killed``, as its client would have heard from the worker.
        """
        session = _opt_str(args, "session") or "default"
        resend = args.get("resend") is True
        while True:
            if resend and session in self.table.killed:
                raise _killed_while_sent(session)
            h = await self.table.get_session(
                _opt_str(args, "session") or "default", _opt_str(args, "agent"),
                # ``existing`` (a follower): never a new session
                _opt_str(args, "cwd"), create=args.get("existing") is not True,
                env=_opt_env(args), cwd_given=args.get("cwd_given") is True,
            )
            h.touch()
            try:
                await self.table.wait_ready(h)  # a stopping session: after its stop, as if then
                break
            except SessionRetired:
                if resend:
                    raise _killed_while_sent(session) from None
                continue  # it was killed: the prompt creates the session anew
        if h.token is None or h.pid is None:
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE,
                              f"session {h.session_id} has no worker to route to")
        expires = time.time() + self.sup.timing.grant_ttl
        return {
            "session": h.session_id,
            "agent": h.agent,
            "worker_socket": self.sup.layout.worker_socket(h.session_id),
            "worker_pid": h.pid,
            "generation": self.sup.generation,
            "grant": make_grant(h.token, h.session_id, self.sup.generation, expires),
            "expires": expires,
        }


    async def prompt(self, ms: MessageStream, req: Request) -> Any:
        args = req.args
        text = args.get("text")
        if not isinstance(text, str):
            raise AgentdError(ErrorCode.BAD_REQUEST, "prompt needs a string 'text'")

        raw = args.get("raw") is True

        async def relay(event: dict[str, Any]) -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                data = event.get("data")
                if raw and isinstance(data, bytes):
                    # the worker sent it raw (it was asked to): pass it on the same way
                    await ms.send_event_raw(
                        req.id, {k: v for k, v in event.items() if k != "data"}, data)
                else:
                    await ms.send(EventMsg(id=req.id, event=event))

        while True:
            h = await self.table.get_session(
                _opt_str(args, "session") or "default", _opt_str(args, "agent"),
                _opt_str(args, "cwd"), create=True, env=_opt_env(args),
                cwd_given=args.get("cwd_given") is True,
            )
            h.touch()
            self.table.rearm_if_exhausted(h)
            try:
                response = await h.call(
                    "prompt",
                    # the worker decides what to stream: everything if asked, else only an
                    # answer too big to come whole
                    {"text": text, "command_id": req.id,
                     "stream": args.get("stream", True) is not False, "raw": raw},
                    client_id=req.client_id,
                    on_event=relay,
                )
                break
            except SessionRetired:
                continue  # killed while it waited to be sent: the session made anew
            except AgentdError as exc:
                raise self.table.exhausted_instead(h, exc) from None
        if not response.ok:
            raise error_of(response)
        result = response.result
        if isinstance(result, dict) and isinstance(result.get("turn"), int):
            h.turns = max(h.turns, result["turn"])
        return result


def _killed_while_sent(session: str) -> AgentdError:
    return AgentdError(
        ErrorCode.SESSION_KILLED,
        f"session {session} was killed while this prompt ran or waited; it was not run again"
        " — send it again to start the session anew",
        {"session": session},
    )



def _str_arg(args: dict[str, Any], name: str) -> str:
    value = args.get(name)
    if not isinstance(value, str) or not value:
        raise AgentdError(ErrorCode.BAD_REQUEST, f"argument {name!r} must be a non-empty string")
    if "\0" in value:  # a NUL reaches no path or argv: refuse it here, not as a traceback
        raise AgentdError(ErrorCode.BAD_REQUEST, f"argument {name!r} must not contain NUL")
    return value


def _opt_str(args: dict[str, Any], name: str) -> str | None:
    value = args.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise AgentdError(ErrorCode.BAD_REQUEST, f"argument {name!r} must be a string")
    if "\0" in value:
        raise AgentdError(ErrorCode.BAD_REQUEST, f"argument {name!r} must not contain NUL")
    return value


def _opt_env(args: dict[str, Any]) -> dict[str, str] | None:
    value = args.get("env")
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise AgentdError(
            ErrorCode.BAD_REQUEST, "argument 'env' must be an object of string values"
        )
    return value


def _guess_id(line: bytes) -> RequestId | None:
    """The id to answer a refused frame with: its own if it has a valid one, else ``None``.

    Never raises: no recursion on deep nesting, and never an id the encoder would refuse.
    """
    return request_id_of(line)


def _peer_uid(stream: trio.abc.Stream) -> int | None:
    creds = peer_credentials(stream)
    return None if creds is None else creds[1]
