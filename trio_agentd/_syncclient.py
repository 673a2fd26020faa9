"""The blocking client the CLI uses: plain sockets and stdlib json, no event loop.

The CLI runs on every command, so its warm path (a daemon already running) imports only this,
the path rules and the error type: connecting, reading a hello and one request/response needs no
event loop. Trio programs use :func:`trio_agentd.open_client` instead.
"""

from __future__ import annotations

import _socket  # not socket: its import (enum conversions) costs a warm prompt ~10 %
import os
import time

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._defaults import (
    CANCEL_REACH,
    CANCEL_RETRY_DELAY,
    CLIENT,
    GRANT_MARGIN,
    RESEND_DELAY,
    RESEND_DELAY_MAX,
    ClientTiming,
)
from ._errors import AgentdError, ErrorCode, NoSupervisor
from ._paths import Layout, check_socket_path
from ._syncconn import _await_response as _await_response
from ._syncconn import _Conn as _Conn
from ._syncconn import _lease_holder as _lease_holder
from ._syncconn import _Liveness as _Liveness
from ._syncconn import _Lost as _Lost
from ._syncconn import probe as probe
from ._trust import prove_peer, prove_socket_dir
from ._version import APP_VERSION, PROTOCOL_VERSION
from ._wirerules import CREATING_OPS as CREATING_OPS
from ._wirerules import REROUTE, RETRY_FOR, RETRYABLE, retry_deadline

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .timing import Timing


def creator_args(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` plus this process's cwd and environment, which a new session starts with (its
    agent gets the environment minus the daemon's own ``TRIO_AGENTD_*`` variables)."""
    out = {"env": dict(os.environ), **args}
    if out.get("cwd") is None:
        try:
            out["cwd"] = os.getcwd()
        except OSError:  # a deleted cwd: the session's own dir is used
            out.pop("cwd", None)
    return out


class Output:
    """A turn's output from its chunk events: exactly one copy of every byte, in order, per
    stream (the reply, and the agent's stderr).

    Each chunk carries its offset in its stream (``at``), so the output sent again after a
    resend (from the start) is skipped where it was already seen; the final result fills in
    what no chunk carried (a client that did not stream, a small answer).
    """

    __slots__ = ("sinks", "sizes")

    def __init__(
        self, sink: Callable[[bytes], object], err_sink: Callable[[bytes], object] | None = None
    ) -> None:
        self.sinks = {"stdout": sink, "stderr": err_sink or _discard}
        self.sizes = {"stdout": 0, "stderr": 0}

    @property
    def size(self) -> int:
        """Bytes of the reply (stdout) seen so far."""
        return self.sizes["stdout"]

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") != "chunk":
            return
        stream = event.get("stream", "stdout")
        if stream not in self.sizes:
            return  # a stream this version does not know
        data = event.get("data")
        if isinstance(data, str):
            import base64

            data = base64.b64decode(data)
        if not isinstance(data, bytes):
            return
        size = self.sizes[stream]
        at = event.get("at")
        at = at if isinstance(at, int) and not isinstance(at, bool) else size
        if at > size:
            raise AgentdError(ErrorCode.INTERNAL, f"{stream} chunk at {at} after only {size}"
                              " bytes: a chunk was lost")
        end = at + len(data)
        if end > size:
            self.sinks[stream](data[size - at :])
            self.sizes[stream] = end

    def finish(self, result: Any) -> None:
        if not isinstance(result, dict):
            return
        for stream, field in (("stdout", "reply"), ("stderr", "stderr")):
            text = result.get(field)
            if isinstance(text, str):
                data = text.encode(errors="surrogateescape")
                if len(data) > self.sizes[stream]:
                    self.sinks[stream](data[self.sizes[stream] :])
                    self.sizes[stream] = len(data)


def _discard(_data: bytes) -> None:
    pass


def version_mismatch(layout: Layout, hello: dict[str, Any]) -> AgentdError:
    return AgentdError(
        ErrorCode.VERSION_MISMATCH,
        f"the supervisor on {layout.socket} runs trio-agentd {hello.get('app_version')}"
        f" (protocol {hello.get('protocol')}), this client is {APP_VERSION} (protocol"
        f" {PROTOCOL_VERSION}) — run `trio-agentd restart` to replace it with {APP_VERSION}",
    )


class SyncClient:
    """One connection to the supervisor, autostarting it if needed."""

    def __init__(
        self, layout: Layout, *, timing: Timing | ClientTiming = CLIENT, autostart: bool = True
    ) -> None:
        self.layout = layout
        self.timing = timing
        self.autostart = autostart
        # where a progress line goes while a slow supervisor is waited for (the CLI: stderr)
        self.progress: Callable[[str], object] | None = None
        # where each connection step goes, one line each (the CLI's -v: stderr)
        self.trace: Callable[[str], object] | None = None
        self.client_id = os.urandom(8).hex()
        self._ids = 0
        self._conn: _Conn | None = None
        self.hello: dict[str, Any] = {}
        self.resent = False
        self._route_ids = 0  # route requests have ids of their own ("route-N")
        self._cached_route: dict[str, Any] | None = None

    def connect_for_prompt(self, session: str, agent: str | None, *, cwd_given: bool) -> None:
        """Get ready to prompt ``session``: with a usable cached route to its worker (see
        :func:`_read_route`) the supervisor is not contacted at all, and the prompt goes
        straight to the worker; otherwise :meth:`connect` as usual."""
        self._cached_route = _read_route(self.layout, session, agent, cwd_given=cwd_given)
        if self._cached_route is None:
            if self.trace is not None:
                self.trace(f"route: no usable cached route for session {session}: asking"
                           " the supervisor")
            self.connect()

    def connect(self) -> dict[str, Any]:
        check_socket_path(self.layout.socket)
        if self.trace is not None:
            self.trace(f"socket {self.layout.socket}")
        got = probe(self.layout, self.timing, patience=self.timing.patience,
                    progress=self.progress, trace=self.trace)
        if got is None and self.autostart:
            got = self._autostart()
        elif got is not None and self.trace is not None:
            self.trace(f"autostart: not needed, supervisor pid {got[1].get('pid')} found"
                       " running")
        if got is None:
            raise NoSupervisor(f"no supervisor is running on {self.layout.socket}")
        hello = got[1]
        if self.autostart and (
            hello.get("app_version") != APP_VERSION or hello.get("protocol") != PROTOCOL_VERSION
        ):
            # an upgrade: a supervisor of an older installation is handed over to one of ours
            from ._autostart import hand_over, is_older

            if is_older(hello):
                got[0].close()
                got = hand_over(self.layout, self.timing, progress=self.progress)
        self._conn, self.hello = got
        if self.hello.get("protocol") != PROTOCOL_VERSION:
            self.close()
            raise version_mismatch(self.layout, self.hello)
        try:
            self.layout.check_served_home(self.hello.get("home"))
        except AgentdError:
            self.close()
            raise
        return self.hello

    def _autostart(self) -> tuple[_Conn, dict[str, Any]] | None:
        from ._autostart import autostart_and_wait

        autostart_and_wait(self.layout, self.timing, trace=self.trace)
        return probe(self.layout, self.timing, trace=self.trace)

    def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        retry_for: float | None = None,
    ) -> Any:
        """Send one command and return its result.

        If the connection is lost (the supervisor was killed or restarted), reconnect —
        autostarting a supervisor if needed — with capped backoff for up to ``retry_for``
        seconds (default 60; 0 for ops that must not be resent) and resend the command with
        the *same* id: the worker's journal answers a resend of a command that already ran.
        Events are relayed from every attempt (a chunk's offset tells a resent one from a new
        one: see :class:`Output`); ``resent`` tells the caller there was a resend.

        Raises:
            AgentdError: the command failed (its wire code), or the supervisor stayed
                unreachable.
        """
        self._ids += 1
        rid = self._ids
        args = args or {}
        if op in CREATING_OPS:
            args = creator_args(args)
        self.resent = False
        if op == "prompt":
            return self._prompt_direct(rid, args, on_event)
        return self._request_supervisor(rid, op, args, on_event, retry_for)

    def _request_supervisor(
        self,
        rid: int | str,
        op: str,
        args: dict[str, Any],
        on_event: Callable[[dict[str, Any]], None] | None,
        retry_for: float | None,
    ) -> Any:
        frame = {"type": "request", "id": rid, "client_id": self.client_id, "op": op,
                 "args": args}
        budget = RETRY_FOR if retry_for is None else retry_for
        deadline: float | None = None  # opened by the first loss (see retry_deadline)
        delay = RESEND_DELAY
        while True:
            try:
                if self._conn is None:
                    self.connect()
                assert self._conn is not None
                if self.trace is not None:
                    self.trace(f"{op}: sent to the supervisor (pid {self.hello.get('pid')})")
                self._conn.send(frame)
                watch = _Liveness(
                    self.timing,
                    {"type": "request", "id": f"ping-{rid}", "client_id": self.client_id,
                     "op": "ping", "args": {}},
                    "", self.hello.get("pid"), socket=self.layout.socket,
                )
                result = _await_response(self._conn, rid, on_event, watch)
                if self.trace is not None:
                    self.trace(f"{op}: answered")
                return result
            except (OSError, _Lost) as exc:
                self.close()
                now = time.monotonic()
                deadline = retry_deadline(deadline, now, budget)
                if now + delay > deadline:
                    raise AgentdError(
                        ErrorCode.DAEMON_UNAVAILABLE,
                        f"lost the supervisor on {self.layout.socket} ({exc}) and could not"
                        f" reach one again within {budget:g}s",
                    ) from None
            except AgentdError as exc:
                if exc.code not in RETRYABLE or exc.details.get("wedged"):
                    raise
                now = time.monotonic()
                deadline = retry_deadline(deadline, now, budget)
                if now + delay > deadline:
                    raise
                self.close()
            time.sleep(delay)
            delay = min(delay * 2, RESEND_DELAY_MAX)
            self.resent = True

    # the data plane ------------------------------------------------------------------------
    def _prompt_direct(
        self, rid: int, args: dict[str, Any], on_event: Callable[[dict[str, Any]], None] | None
    ) -> Any:
        """A prompt over the session's direct route (see ``trio_agentd._client``): the
        supervisor grants the route, the worker runs the prompt; when the route fails the
        supervisor is asked again and the same ``(client_id, id)`` is resent. A worker that
        answers nothing, not even a ping, fails the prompt with ``worker_unresponsive`` (see
        :class:`_Liveness`)."""
        session = str(args.get("session") or "default")
        # output bytes come raw after each chunk's frame, not base64 in it
        worker_args = {"text": args.get("text"), "stream": args.get("stream", True) is not False,
                       "raw": True}
        frame = {"type": "request", "id": rid, "client_id": self.client_id, "op": "prompt",
                 "args": worker_args}
        route_args: dict[str, Any] = {
            k: args[k] for k in ("agent", "cwd", "cwd_given", "env") if k in args}
        route_args["session"] = session
        deadline: float | None = None  # opened by the first loss (see retry_deadline)
        delay = RESEND_DELAY
        # a warm prompt goes straight to the worker on the route this session was last
        # granted (see _read_route); any failure falls back to the supervisor, as a stale
        # route always has
        cached, self._cached_route = self._cached_route, None
        if cached is not None and cached.get("session") != session:
            cached = None
        while True:
            from_cache = cached is not None
            if cached is not None:
                route, cached = cached, None
                if self.trace is not None:
                    self.trace(f"route: cached grant for session {session} (supervisor not"
                               " contacted)")
            else:
                self._route_ids += 1
                route = self._request_supervisor(
                    f"route-{self._route_ids}", "route",
                    {**route_args, "resend": True} if self.resent else route_args, None, None,
                )
                _write_route(self.layout, session, route, self.hello)
                if self.trace is not None:
                    self.trace(f"route: granted by the supervisor for session {session}")
            conn: _Conn | None = None
            sent = False
            interrupted = False
            liveness = _Liveness(
                self.timing,
                {"type": "request", "id": f"ping-{rid}", "client_id": self.client_id,
                 "op": "ping", "args": {}},
                session, route.get("worker_pid"),
            )
            try:
                conn = _attach(route, self.timing)
                sent = True
                if self.trace is not None:
                    self.trace(f"route: direct to worker pid {route.get('worker_pid')} at"
                               f" {route.get('worker_socket')} (dir and peer proven ours,"
                               " grant accepted); prompt sent")
                conn.send(frame)
                try:
                    result = _await_response(conn, rid, on_event, liveness)
                    if self.trace is not None:
                        self.trace("prompt: answered")
                    return result
                except KeyboardInterrupt:
                    interrupted = True  # (handled below, outside the resend's handlers)
            except (OSError, _Lost) as exc:
                error: Exception = exc
            except AgentdError as exc:
                if exc.code not in REROUTE:
                    raise
                error = exc
            finally:
                if conn is not None:
                    conn.close()
            if interrupted:
                return self._cancel_interrupted(route, rid, frame, on_event, liveness)
            if self.trace is not None:
                self.trace(f"route: failed ({error}); asking the supervisor again")
            now = time.monotonic()
            deadline = retry_deadline(deadline, now, RETRY_FOR)
            if now + delay > deadline:
                raise AgentdError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"session {session}: its worker could not be reached again within"
                    f" {RETRY_FOR:g}s ({error})",
                ) from None
            if from_cache and not sent:
                continue  # the cached route failed before the prompt went out: a first send
            time.sleep(delay)
            delay = min(delay * 2, RESEND_DELAY_MAX)
            self.resent = True

    def _cancel_interrupted(
        self, route: dict[str, Any], rid: int | str, frame: dict[str, Any],
        on_event: Callable[[dict[str, Any]], None] | None, liveness: _Liveness,
    ) -> Any:
        """After Ctrl-C: cancel the command, wait for the worker to confirm, and return its
        answer; a second Ctrl-C leaves at once.

        The interrupt may have landed inside a frame (a chunk's bytes half read, or read and
        not yet shown), so the interrupted connection is out of step and is not read again:
        the cancel goes on a new one, answered once the turn has ended, and then the command
        is sent again with its id. The journal answers that: ``command_cancelled``, or its
        result if it had just finished (output already shown is skipped by its offset). The
        prompt is never resent on its own here: that would join the running turn and wait
        for it. A worker that cannot be reached for the cancel (within ``CANCEL_REACH``) is
        an error that says the turn may still run.

        Raises:
            AgentdError: ``command_cancelled`` (confirmed), the command's own failure, or
                ``worker_unavailable`` (the cancel could not be delivered).
        """
        deadline = time.monotonic() + CANCEL_REACH
        while True:
            conn: _Conn | None = None
            try:
                conn = _attach(route, self.timing)
                conn.send({"type": "request", "id": f"cancel-{rid}", "client_id":
                           self.client_id, "op": "cancel", "args": {"command_id": rid}})
                _await_response(conn, f"cancel-{rid}", None, liveness)
                conn.send(frame)
                return _await_response(conn, rid, on_event, liveness)
            except (OSError, _Lost, AgentdError) as exc:
                if isinstance(exc, AgentdError) and exc.code not in REROUTE:
                    raise  # the worker's answer (command_cancelled, ...)
                if time.monotonic() + CANCEL_RETRY_DELAY > deadline:
                    session = route.get("session", "?")
                    raise AgentdError(
                        ErrorCode.WORKER_UNAVAILABLE,
                        f"interrupted, but the cancel could not reach the worker of session"
                        f" {session} within {CANCEL_REACH:g}s ({exc}): its turn may still"
                        f" run — trio-agentd cancel {session} stops it",
                    ) from None
            finally:
                if conn is not None:
                    conn.close()
            time.sleep(CANCEL_RETRY_DELAY)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


ROUTE_CACHE_VERSION = 1
_ROUTE_MARGIN = GRANT_MARGIN  # seconds: a grant this close to its expiry is not used from the cache


def route_cache_path(layout: Layout, session: str) -> str:
    """Where the last route granted for ``session`` on this socket is kept: next to the
    socket, in its private (0700, proven) dir; never named ``*.sock``, so never mistaken for
    a supervisor's socket."""
    return f"{layout.socket}.route-{session}"


def _read_route(
    layout: Layout, session: str, agent: object, *, cwd_given: bool
) -> dict[str, Any] | None:
    """The route last granted for ``session``, if it may be used as it is: the file is ours
    (a regular file of our uid, no group/other bits, not a symlink) in the proven socket dir,
    well-formed, of this version, granted by the supervisor that still runs (same pid and
    start id: after a restart or a crash it is bypassed) and serves our home, not about to
    expire, for the session's agent. ``None`` otherwise: the supervisor is asked, as without
    a cache. ``--cwd`` always goes to the supervisor (it checks it against the session's)."""
    if cwd_given:
        return None
    try:
        prove_socket_dir(layout.socket_dir)
    except AgentdError:
        return None  # the supervisor path says why (or autostarts one)
    cached = _read_private_json(route_cache_path(layout, session))
    if cached is None or cached.get("v") != ROUTE_CACHE_VERSION:
        return None
    route, sup = cached.get("route"), cached.get("supervisor")
    if not isinstance(route, dict) or not isinstance(sup, dict):
        return None
    expires, pid, start_id = route.get("expires"), sup.get("pid"), sup.get("start_id")
    if (route.get("session") != session or not isinstance(route.get("grant"), str)
            or not isinstance(route.get("worker_socket"), str)
            or not isinstance(route.get("worker_pid"), int)
            or not isinstance(expires, (int, float)) or expires - time.time() < _ROUTE_MARGIN
            or (agent is not None and agent != route.get("agent"))
            or sup.get("app_version") != APP_VERSION or sup.get("protocol") != PROTOCOL_VERSION
            or not isinstance(pid, int) or not isinstance(start_id, str)):
        return None
    try:
        layout.check_served_home(sup.get("home"))
    except AgentdError:
        return None  # the supervisor path refuses it, naming both homes
    # the socket's lease names the supervisor that holds the socket now (a restart execs a
    # new generation in the same process), and its start id says it still runs
    lease = _read_private_json(layout.lease_path, private=False)
    if lease is None or (lease.get("pid"), lease.get("generation")) != (pid, sup.get("generation")):
        return None
    from ._identity import Liveness, liveness

    if liveness(pid, start_id) is not Liveness.ALIVE:
        return None  # that supervisor is gone (crashed, even if not yet reaped)
    return route


def _read_private_json(path: str, *, private: bool = True) -> dict[str, Any] | None:
    """The JSON object in ``path`` if it is a regular file of ours that nobody else may write
    (``private``: nor read), not a symlink; else ``None``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # none yet (or a symlink: refused)
    try:
        st = os.fstat(fd)
        from ._trust import file_problem

        if file_problem(st, os.getuid()) is not None or (private and st.st_mode & 0o077):
            return None  # not provably ours (alone): ignored
        raw = os.read(fd, 1 << 16)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _write_route(
    layout: Layout, session: str, route: object, hello: dict[str, Any]
) -> None:
    """Keep a route the supervisor granted for the next prompt (:func:`_read_route`). A cache:
    written atomically (0600, a private temp name, then renamed over any old or foreign file),
    not fsynced; a failure to write only costs the next prompt a route request."""
    if not isinstance(route, dict) or not isinstance(hello.get("pid"), int):
        return
    data = json.dumps({
        "v": ROUTE_CACHE_VERSION, "route": route,
        "supervisor": {k: hello.get(k) for k in
                       ("pid", "start_id", "generation", "app_version", "protocol", "home")},
    }).encode()
    path = route_cache_path(layout, session)
    tmp = os.path.join(layout.socket_dir,
                       f".{os.path.basename(path)}.{os.urandom(4).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:  # noqa: SIM105 - contextlib is not imported on the warm path
            os.unlink(tmp)
        except OSError:
            pass  # never made, or already renamed: nothing to clean up


def _attach(route: dict[str, Any], timing: Timing | ClientTiming) -> _Conn:
    """Connect to the worker a route names, prove it ours, present the grant.

    Raises:
        AgentdError: ``worker_unavailable``, ``grant_refused`` or ``permission_denied``.
    """
    path = str(route.get("worker_socket"))
    try:
        prove_socket_dir(os.path.dirname(path))
    except AgentdError as exc:
        if exc.code != ErrorCode.DAEMON_UNAVAILABLE:
            raise
        raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, exc.message) from None
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(timing.connect_timeout)
    try:
        s.connect(path)
        prove_peer(s, path)
    except OSError as exc:
        s.close()
        raise AgentdError(
            ErrorCode.WORKER_UNAVAILABLE, f"cannot reach the worker at {path}: {exc}"
        ) from None
    except BaseException:
        s.close()
        raise
    conn = _Conn(s)
    try:
        hello = conn.read_message(timing.hello_timeout)
        if hello is None or hello.get("type") != "worker_hello" or hello.get(
            "pid"
        ) != route.get("worker_pid"):
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, f"{path} is not the routed worker")
        conn.send({"type": "attach", "grant": str(route.get("grant"))})
        reply = conn.read_message(timing.hello_timeout)
        if reply is not None and reply.get("type") == "dropped":
            raise AgentdError(str(reply.get("code")), str(reply.get("message")))
        if reply is None or reply.get("type") != "auth_ok":
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, f"the worker at {path} did not"
                              " admit us")
    except OSError:
        conn.close()
        raise AgentdError(ErrorCode.WORKER_UNAVAILABLE,
                          f"the worker at {path} did not answer") from None
    except BaseException:
        conn.close()
        raise
    return conn
