"""The worker process: one session, its agent, its journal, its private socket.

Theory of operation
-------------------
A worker outlives supervisors. It listens on a private Unix socket; a supervisor connects,
receives a ``worker_hello``, and authenticates with the worker's token plus its *claim*
(generation, pid, start id, public socket). The worker checks the claim against the ownership
registry (:class:`._fence.Fence`) and, on a real socket, that the peer's SO_PEERCRED pid is the
claimed pid. The newest authenticated connection becomes *current* and every older one is
revoked. Before every command and every ``refence_interval`` the worker re-checks the claim and
drops a connection whose supervisor lost it (``supervisor_generation_stale``); the session goes
on and the next valid supervisor reconnects.

Commands are journalled: ``accepted`` is fsynced before a command runs, ``completed`` after, so a
retry with the same ``(client_id, id)`` gets the stored result and never runs twice. A command
runs in the worker's own nursery, not in the connection's, so a dropped connection does not
abandon an accepted command: the retry on the next connection waits for it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from . import _journal
from ._errors import AgentdError, ErrorCode
from ._fence import Claim, Fence
from ._followers import Followers
from ._grant import check_grant
from ._identity import (
    GroupIdentity,
    group_members,
    own_start_id,
    read_start_id,
)
from ._output import (
    chunk_event,
)
from ._protocol import (
    APP_VERSION,
    MAX_IN_FLIGHT,
    Attach,
    Auth,
    AuthOk,
    Dropped,
    Event,
    Request,
    WorkerHello,
    decode,
    fail,
    ok,
    request_id_of,
)
from ._session import Transcript
from ._stream import MessageStream
from ._workerconn import Conn
from ._workerjournal import Journal
from ._workerturns import Running, StartedHere, TurnRunner, interrupted_error, kept_output
from .agents import (
    Agent,
)
from .agents._exec import stop_orphan_group
from .timing import DEFAULT_TIMING, Timing

log = logging.getLogger("trio_agentd.worker")


class WorkerCore(TurnRunner):
    """Everything a worker does, over any stream; the process shell only adds the socket.

    Args:
        peer_pid: returns the peer pid of a connection (SO_PEERCRED) or ``None`` if unknown.
    """

    def __init__(
        self,
        *,
        session_id: str,
        agent: Agent,
        token: str,
        supervisor_socket: str,
        read_record: Callable[[str], bytes | None],
        read_start_id: Callable[[int], str | None] = read_start_id,
        journal: Journal | None,
        transcript: Transcript | None,
        cwd: Path,
        timing: Timing = DEFAULT_TIMING,
        peer_pid: Callable[[trio.abc.Stream], int | None] = lambda _s: None,
        watch_claims: Callable[[str], None] | None = None,
        wait_change: Callable[[], Awaitable[None]] | None = None,
        pid: int | None = None,
        start_id: str | None = None,
        wall_clock: Callable[[], float] = time.time,
        boot_id: str | None = None,
    ) -> None:
        self.session_id = session_id
        self.agent = agent
        self._token = token
        self.supervisor_socket = supervisor_socket
        self._read_record = read_record
        self._read_start_id = read_start_id
        self.journal = journal
        self.transcript = transcript
        self.cwd = cwd
        self.timing = timing
        self._peer_pid = peer_pid
        # how the re-fence loop waits: every refence_interval (default), or until the
        # registry changes (a real worker: dnotify, with a slow fallback poll)
        self._watch_claims = watch_claims
        self._wait_change = wait_change
        self.pid = os.getpid() if pid is None else pid
        self.start_id = own_start_id() if start_id is None else start_id
        # in every acceptance: after a restart in the same boot the page cache is intact, so
        # a command without its ``started`` marker certainly never ran
        self.boot_id = _boot_id() if boot_id is None else boot_id
        self.conns: list[Conn] = []
        self.current: Conn | None = None
        self._turn_running: Running | None = None  # the turn whose agent runs now
        # its turns never wait on anything (declared): the connection's reader runs them
        self._immediate = getattr(agent, "immediate", False) is True
        # the claim of the supervisor this worker serves: set by its authentication, kept when
        # its connection closes (a supervisor killed -9 leaves routed clients served) until a
        # newer supervisor authenticates or the claim fails the fence
        self.serving: Fence | None = None
        self._recovered = trio.Event()  # the journal's pending commands are dealt with
        self._wall_clock = wall_clock
        self.stop_requested = trio.Event()
        self._killed = False  # stopped by `trio-agentd kill`: turns end at once
        # why the last turn could not start its agent ("" once a turn ran): told to the
        # supervisor with each turn_done, which shows the session failed with it
        self.agent_failure = ""
        self._answering = 0  # prompts not yet answered (a stop lets them be answered)
        self._answered = trio.Event()
        self._turn = trio.Semaphore(1)
        self._running: dict[_journal.Key, Running] = {}
        self._nursery: trio.Nursery | None = None
        self.turns_run = 0
        self._memory_turns = 0
        self._memory_done: dict[_journal.Key, Any] = {}
        self._memory_cancelled: set[_journal.Key] = set()  # without a journal
        self.followers = Followers()  # `logs -f`: turns as they stream

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the re-fence loop and host commands until a ``stop``; never returns otherwise."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._refence_loop)
            await self._stop_orphan_groups()
            self._recover_pending()
            self._recovered.set()  # commands wait for this: none may run as new before it
            if self.journal is not None:
                nursery.start_soon(self.journal.run_flusher)
            task_status.started()
            await self.stop_requested.wait()
            # graceful: let an accepted command finish (a kill has cut it short), bounded;
            # then let every prompt be answered (queued ones are turned away at once)
            with trio.move_on_after(self.timing.stop_grace):
                await self._turn.acquire()
                while self._answering:
                    await self._answered.wait()
            nursery.cancel_scope.cancel()

    def busy(self) -> bool:
        """A turn is running, or a prompt waits for its turn."""
        return bool(self._running) or self._turn.value == 0 or (
            self._turn.statistics().tasks_waiting > 0
        )

    def _stop(self, args: dict[str, Any]) -> dict[str, Any]:
        """The supervisor's ``stop``: ``if_idle`` (an eviction) is declined while busy; a
        ``kill`` ends the running turn at once (its client gets ``session_killed``) and
        turns away the prompts queued behind it the same way."""
        if args.get("if_idle") and self.busy():
            return {"stopping": False, "busy": True}
        if args.get("reason") == "kill" and not self.stop_requested.is_set():
            self._killed = True
            for running in self._running.values():
                running.killed = True
                running.cancel_scope.cancel()
        self.stop_requested.set()
        return {"stopping": True}

    async def announce_stopped(self, why: str) -> None:
        """Tell every supervisor connection this worker stopped cleanly on its own (an
        operator's signal), so its exit is a stop, not a crash toward the restart limit."""
        for conn in list(self.conns):
            if conn.direct or conn.dropped:
                continue
            conn.dropped = True
            with trio.move_on_after(self.timing.drop_notice_timeout):
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await conn.ms.send(Dropped(code=ErrorCode.WORKER_STOPPED, message=why))

    async def _stop_orphan_groups(self) -> None:
        """Stop what is left of the process groups of commands a killed worker never finished
        (identity-checked: a leader gone or reused is left alone), before anything is
        recovered or replayed; log each one and journal it dealt with, so it is done once."""
        if self.journal is None:
            return
        for k, group in self.journal.state.orphan_groups():
            members = group_members(group)
            outcome = await stop_orphan_group(group)
            if outcome == "gone":
                log.info("command %s: its process group %d (leader pid %d) is already gone",
                         k, group.pgid, group.pid)
            else:
                log.warning("command %s: %s its orphaned process group %d (leader pid %d,"
                            " members %s), left running by a worker that died",
                            k, {"stopped": "stopped", "killed": "killed"}.get(outcome,
                                                                            "could not stop"),
                            group.pgid, group.pid, " ".join(map(str, members)) or "-")
            try:
                self.journal.append_durable(
                    _journal.group_stopped(k[0], k[1], group, outcome))
            except AgentdError as exc:  # kept in the journal's backlog; logged
                log.error("recording process group %d of command %s: %s", group.pgid, k,
                          exc.message)

    def _on_group(self, k: _journal.Key, group: GroupIdentity) -> None:
        """A turn's process group exists and waits for this before it runs: journal it (in the
        page cache at once, which a ``kill -9`` of this worker does not lose; a machine crash
        takes the group with it, so it needs no flush of its own)."""
        if self.journal is not None:
            self.journal.append(_journal.group(k[0], k[1], group))

    def _recover_pending(self) -> None:
        if self.transcript is not None:
            pending = len(self.journal.state.pending()) if self.journal is not None else 0
            self.transcript.event("worker_started", pid=self.pid,
                                  **({"recovering": pending} if pending else {}))
        if self.journal is None:
            return
        state = self.journal.state
        if self.transcript is not None:
            # the transcript is a view of the journal, written without its own fsync: bring it
            # up to date with every completed turn the journal made durable
            brought = False
            for k, result in state.completed.items():
                if not isinstance(result, dict) or self.transcript.has(k, result.get("turn")):
                    continue
                if not isinstance(result.get("turn"), int):
                    continue
                text = state.accepted.get(k, {}).get("args", {}).get("text", "")
                brought = True
                try:
                    self.transcript.append(
                        {"kind": "turn", "turn": result["turn"], "prompt": text,
                         **kept_output(result), "client_id": k[0], "id": k[1],
                         "recovered": True}
                    )
                except OSError as exc:  # kept: written before its next line
                    log.error("transcript %s: %s", self.transcript.path, exc)
            # ... and durable, if that took a line: an fsync on every start (the worker
            # accepts no connection before this ends) would make only the ``worker_started``
            # line durable, which no other event line is either; a respawn after a kill -9
            # waited for it
            if brought:
                try:
                    self.transcript.sync()
                except OSError as exc:
                    log.error("transcript %s: %s", self.transcript.path, exc)
        for k, rec in state.pending():
            try:
                self._recover_one(k, rec)
            except AgentdError as exc:  # kept in the journal's backlog; logged
                log.error("recovering command %s: %s", k, exc.message)

    def _recover_one(self, k: _journal.Key, rec: dict[str, Any]) -> None:
        assert self.journal is not None
        state = self.journal.state
        if self.transcript is not None and k in self.transcript.keys:
            # it finished and was transcribed just before a crash: complete it, do not rerun
            last = self.transcript.last or {}
            self.journal.append_durable(_journal.completed(k[0], rec.get("id", k[1]), {
                "session": self.session_id, "turn": last.get("turn"), **kept_output(last)}))
        elif self.agent.replayable and rec.get("op") == "prompt":
            running = Running(listener=None, request_id=rec.get("id"),  # type: ignore[arg-type]
                              key=k)
            running.listener = None
            self._running[k] = running
            assert self._nursery is not None
            self._nursery.start_soon(self._replay, k, rec, running)
        else:
            # without its started marker, and in the same boot (the page cache, where the
            # marker would be, survived), it certainly never ran; otherwise it may have
            started = (
                k in state.started
                or self.boot_id == ""
                or rec.get("boot") != self.boot_id
            )
            self.journal.append_durable(
                _journal.interrupted(k[0], rec.get("id", k[1]), started=started)
            )
            log.warning("command %s was interrupted by a worker restart (%s)", k,
                        "it had started" if started else "it never started")
            if self.transcript is not None:
                text = rec.get("args", {}).get("text")
                self.transcript.event(
                    "interrupted", command=list(k), started=started,
                    prompt=text if isinstance(text, str) else None,
                    error=interrupted_error(k, started=started).message)

    async def _replay(self, k: _journal.Key, rec: dict[str, Any], running: Running) -> None:
        await self._turn.acquire()
        await self._execute(k, str(rec.get("args", {}).get("text", "")), running, 0,
                            replay=True)

    # connections ------------------------------------------------------------------------
    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        """Authenticate one supervisor connection and serve its commands until it drops.

        Cancellation: the connection is closed; commands it started keep running.
        """
        ms = MessageStream(stream)
        try:
            await ms.send(
                WorkerHello(session=self.session_id, pid=self.pid, start_id=self.start_id,
                            app_version=APP_VERSION)
            )
            msg = None
            with trio.move_on_after(self.timing.auth_timeout):
                msg = await ms.receive()
            if isinstance(msg, Attach):
                await self._serve_direct(ms, msg, stream)
                return
            if not isinstance(msg, Auth):
                return
            refusal = self._authenticate(msg, stream)
            if refusal is not None:
                await ms.send(
                    Dropped(code=ErrorCode.SUPERVISOR_GENERATION_STALE, message=refusal)
                )
                return
            fence = Fence(
                Claim(
                    generation=msg.generation, pid=msg.pid, start_id=msg.start_id, socket=msg.socket
                ),
                self._read_record,
                self._read_start_id,
            )
            reason = fence.check()
            if reason is not None:
                await ms.send(
                    Dropped(
                        code=ErrorCode.SUPERVISOR_GENERATION_STALE,
                        message=f"supervisor claim rejected: {reason}",
                    )
                )
                return
            conn = Conn(ms, fence, notice_interval=self.timing.notice_interval)
            if self._watch_claims is not None:
                self._watch_claims(msg.generation)
            # the newest authenticated supervisor wins: revoke every older connection
            for old in list(self.conns):
                await self._drop(old, "superseded by a newer supervisor")
            self.conns.append(conn)
            self.current = conn
            self.serving = fence
            await ms.send(AuthOk(session=self.session_id, pid=self.pid))
            async with trio.open_nursery() as handlers:
                handlers.start_soon(conn.send_notices)
                with conn.scope:
                    await self._read_commands(conn, handlers)
                handlers.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, AgentdError):
            pass
        except Exception:
            log.exception("supervisor connection failed")
        finally:
            for c in list(self.conns):
                if c.ms is ms:
                    c.dropped = True
                    self.conns.remove(c)
                    if self.current is c:
                        self.current = None
            await ms.aclose()

    async def _serve_direct(self, ms: MessageStream, msg: Attach, stream: trio.abc.Stream) -> None:
        """A client's direct route: admitted by its grant, then served like the supervisor's
        connection (prompts, status), each command re-checked against the fence."""
        refusal = self._admit(msg, stream)
        if refusal is not None:
            await ms.send(Dropped(code=ErrorCode.GRANT_REFUSED, message=refusal))
            return
        assert self.serving is not None
        conn = Conn(ms, self.serving, direct=True)
        await ms.send(AuthOk(session=self.session_id, pid=self.pid))
        async with trio.open_nursery() as handlers:
            with conn.scope:
                await self._read_commands(conn, handlers)
            handlers.cancel_scope.cancel()

    def _admit(self, msg: Attach, stream: trio.abc.Stream) -> str | None:
        if self._peer_pid(stream) == -1:
            return "a process of another uid may not use this worker"
        serving = self.serving
        generation = None
        if serving is not None and serving.check() is None:
            generation = serving.claim.generation
        return check_grant(msg.grant, token=self._token, session=self.session_id,
                           generation=generation, now=self._wall_clock())

    async def _wait_refence(self) -> None:
        if self._wait_change is None:
            await trio.sleep(self.timing.refence_interval)
        else:
            await self._wait_change()

    async def _read_commands(self, conn: Conn, handlers: trio.Nursery) -> None:
        while True:
            # a peer that pipelines without reading its answers stops being read from
            if conn.in_flight.value >= MAX_IN_FLIGHT:  # (no yield when there is room)
                await conn.in_flight.wait_value(lambda n: n < MAX_IN_FLIGHT)
            try:
                line = await conn.ms.receive_line()
            except (trio.BrokenResourceError, trio.ClosedResourceError, AgentdError):
                return
            if line is None:
                return
            try:
                req = decode(line)  # raises nothing but AgentdError, whatever the line holds
            except AgentdError as exc:
                await self._respond(conn, fail(request_id_of(line), exc))
                continue
            if isinstance(req, Request):
                conn.in_flight.value += 1
                if req.op == "prompt":
                    started = self.start_prompt(conn, req)  # a new prompt, no task of its own
                    if started is True:
                        continue
                    if isinstance(started, StartedHere):
                        await self.run_here(started, conn, req)
                        continue
                    if started is not False:  # refused: it could not be journalled
                        try:
                            await self._respond(conn, started)
                        finally:
                            conn.in_flight.value -= 1
                        continue
                handlers.start_soon(self._handle_counted, conn, req)
            else:
                await self._respond(conn, fail(None, AgentdError(
                    ErrorCode.BAD_REQUEST, f"expected a request, got {type(req).__name__}")))

    def _authenticate(self, msg: Auth, stream: trio.abc.Stream) -> str | None:
        if not hmac.compare_digest(msg.token.encode(), self._token.encode()):
            return "bad worker token"
        if msg.socket != self.supervisor_socket:
            return f"supervisor socket {msg.socket} is not this worker's {self.supervisor_socket}"
        peer = self._peer_pid(stream)
        if peer is not None and peer != msg.pid:
            return f"peer pid {peer} is not the claimed supervisor pid {msg.pid}"
        return None

    def _valid(self, conn: Conn) -> bool:
        if conn.dropped:
            return False
        if conn.direct:
            # a route stays good while its supervisor's claim is the one this worker serves
            serving = self.serving
            return (
                serving is not None
                and conn.fence.claim == serving.claim  # the same supervisor, reconnected too
                and serving.check() is None
            )
        return conn is self.current and conn.fence.check() is None

    async def _drop(self, conn: Conn, reason: str) -> None:
        if conn.dropped:
            return
        conn.dropped = True
        if conn in self.conns:
            self.conns.remove(conn)
        if self.current is conn:
            self.current = None
        log.warning("dropping supervisor generation %s: %s", conn.fence.claim.generation, reason)
        with trio.move_on_after(self.timing.drop_notice_timeout):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await conn.ms.send(
                    Dropped(code=ErrorCode.SUPERVISOR_GENERATION_STALE, message=reason)
                )
        conn.scope.cancel()
        await conn.ms.aclose()

    async def _refence_loop(self) -> None:
        while True:
            await self._wait_refence()
            for conn in list(self.conns):
                reason = conn.fence.check()
                if reason is not None and self._nursery is not None:
                    # dropped concurrently: a peer that stopped reading cannot delay the ticks
                    self._nursery.start_soon(
                        self._drop, conn, f"supervisor lost its claim: {reason}"
                    )

    # commands ---------------------------------------------------------------------------
    async def _respond(self, conn: Conn, msg: Any, *, last: bool = False) -> None:
        """Send ``msg`` unless the connection is gone; ``last``: the task's last act (see
        :meth:`MessageStream.send_last`)."""
        if conn.dropped:
            return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            if last:
                await conn.ms.send_last(msg)
            else:
                await conn.ms.send(msg)

    async def _send_chunk(
        self, conn: Conn, request_id: Any, at: int, piece: bytes, stream: str, *, raw: bool
    ) -> None:
        """One output chunk event: its bytes raw after the frame if the request asked for
        that, else base64 in it."""
        if not raw:
            await self._respond(conn, Event(id=request_id, event=chunk_event(at, piece, stream)))
            return
        if conn.dropped:
            return
        event = chunk_event(at, b"", stream)
        del event["data"]
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await conn.ms.send_event_raw(request_id, event, piece)

    async def _handle_counted(self, conn: Conn, req: Request) -> None:
        try:
            await self._handle(conn, req)
        finally:
            conn.in_flight.value -= 1

    async def _handle(self, conn: Conn, req: Request) -> None:
        if not self._valid(conn):
            if conn.direct:
                await self._respond(conn, fail(req.id, AgentdError(
                    ErrorCode.GRANT_REFUSED,
                    "this route's supervisor no longer owns the session — ask it for a new"
                    " route")))
                conn.scope.cancel()
                return
            await self._drop(conn, "supervisor claim no longer valid")
            return
        if conn.direct and req.op not in ("prompt", "cancel", "ping", "status", "follow"):
            await self._respond(conn, fail(req.id, AgentdError(
                ErrorCode.UNKNOWN_OP, f"op {req.op!r} is not served on a direct route")))
            return
        match req.op:
            case "prompt":
                await self._prompt(conn, req)
            case "ping" | "status":
                await self._respond(conn, ok(req.id, self.status()))
            case "cancel":
                await self._cancel(conn, req)
            case "follow":
                await self._follow(conn, req)
            case "stop":
                await self._respond(conn, ok(req.id, self._stop(req.args)))
            case _:
                await self._respond(
                    conn, fail(req.id, AgentdError(ErrorCode.UNKNOWN_OP, f"unknown op {req.op!r}"))
                )

    def status(self) -> dict[str, Any]:
        return {
            "session": self.session_id,
            "pid": self.pid,
            "turns": self.turns,
            "busy": bool(self._running),
        }


def _boot_id() -> str:
    """This boot's id (Linux), or "" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
