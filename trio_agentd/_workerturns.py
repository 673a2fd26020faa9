"""The worker's turns: a prompt's journalled run on the agent, its output relayed to
the listener and the followers, a cancel, the answer to a resend, and how a turn ends.

:class:`TurnRunner` is the turn half of :class:`._workercore.WorkerCore` (its base class):
the state it shares with the connection half is declared below and set by
``WorkerCore.__init__``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from . import _journal
from ._errors import AgentdError, ErrorCode
from ._followers import Followers
from ._identity import (
    GroupIdentity,
)
from ._output import (
    FIELDS,
    INLINE_MAX,
    RAW_CHUNK_MAX,
    STDERR,
    STDOUT,
    STREAMS,
    TurnOutput,
    chunk_event,
    inline,
    missing_output,
    pieces,
    prune,
    stored_pieces,
)
from ._protocol import (
    Event,
    Notice,
    Request,
    Response,
    fail,
    ok,
)
from ._session import Transcript
from ._storage import REMEDY, errno_name, retried, storage_error
from ._workerconn import Conn
from ._workerjournal import KEEP_COMPLETED, Journal
from .agents import (
    Agent,
    AgentStartError,
    Chunk,
    ExitStatus,
    Stderr,
    TurnContext,
    Waiting,
)
from .timing import AGENT_CLOSE_TIMEOUT, Timing

log = logging.getLogger("trio_agentd.worker")


class Running:
    def __init__(self, listener: Conn, request_id: Any, key: _journal.Key) -> None:
        self.key = key  # the command's journal key
        self.done = trio.Event()
        self.listener: Conn | None = listener
        self.request_id = request_id
        self.stream = True  # the listener wants the chunks as they come
        self.raw = False  # ... with their bytes raw after each frame (not base64)
        # replaced by the turn's own when it starts
        self.outputs = {STDOUT: TurnOutput(None), STDERR: TurnOutput(None, STDERR)}
        # per stream, bytes the current listener has been sent
        self.sent_to = dict.fromkeys(STREAMS, 0)
        self.exit_status: int | None = None  # as the agent reported it
        self.lock = trio.Lock()  # orders a listener's catch-up with the live chunks
        self.cancel_scope = trio.CancelScope()  # a client's cancel ends the agent's turn
        self.killed = False  # the session was killed: the turn ends with session_killed
        # its ``started`` marker was journalled with its acceptance (a replayable agent's turn
        # starts at once: one write for both)
        self.marked_started = False
        self.result: Any = None
        self.error: AgentdError | None = None

    def wants_chunks(self) -> bool:
        """Stream to the listener: it asked to, or the output is too big for the answer."""
        return self.stream or any(out.size > INLINE_MAX for out in self.outputs.values())


class StartedHere:
    """A prompt :meth:`TurnRunner.start_prompt` accepted for its caller to run
    (:meth:`TurnRunner.run_here`)."""

    __slots__ = ("accepted", "key", "running", "text")

    def __init__(self, key: _journal.Key, text: str, running: Running, accepted: int) -> None:
        self.key = key
        self.text = text
        self.running = running
        self.accepted = accepted


class TurnRunner:
    """Runs the session's turns, one at a time, for :class:`._workercore.WorkerCore`."""

    # what the turns share with the rest of the worker (set by WorkerCore.__init__)
    session_id: str
    agent: Agent
    journal: Journal | None
    transcript: Transcript | None
    cwd: Path
    timing: Timing
    pid: int
    boot_id: str
    current: Conn | None
    stop_requested: trio.Event
    agent_failure: str
    followers: Followers
    turns_run: int
    _turn_running: Running | None
    _immediate: bool  # the agent's turns never wait: the reader runs them (run_here)
    _recovered: trio.Event
    _killed: bool
    _answering: int
    _answered: trio.Event
    _turn: trio.Semaphore
    _running: dict[_journal.Key, Running]
    _nursery: trio.Nursery | None
    _memory_turns: int
    _memory_done: dict[_journal.Key, Any]
    _memory_cancelled: set[_journal.Key]

    if TYPE_CHECKING:  # the connection side's and the recovery's, in WorkerCore
        def _valid(self, conn: Conn) -> bool: ...

        async def _drop(self, conn: Conn, reason: str) -> None: ...

        async def _respond(self, conn: Conn, msg: Any, *, last: bool = False) -> None: ...

        async def _send_chunk(
            self, conn: Conn, request_id: Any, at: int, piece: bytes, stream: str, *, raw: bool
        ) -> None: ...

        def _on_group(self, k: _journal.Key, group: GroupIdentity) -> None: ...

    @property
    def turns(self) -> int:
        return self.transcript.turns if self.transcript is not None else self._memory_turns

    async def _prompt(self, conn: Conn, req: Request) -> None:
        # a resend that arrives while orphans of a killed worker are still being stopped must
        # meet its command as recovered (interrupted, or replaying), never run it as new
        if not self._recovered.is_set():  # (set for good once up: no yield then)
            await self._recovered.wait()
        self._answering += 1
        try:
            await self._prompt_answered(conn, req)
        finally:
            self._prompt_done()

    def _prompt_done(self) -> None:
        self._answering -= 1
        if not self._answering:
            self._answered.set()
            self._answered = trio.Event()

    def start_prompt(self, conn: Conn, req: Request) -> bool | Response | StartedHere:
        """Start a new prompt from the connection's reader, without a task of its own, when
        nothing stands in its way: the worker is up and not stopping, the command is neither
        done nor running, the session's turn is free, the connection still valid. Its turn
        runs in the worker's nursery, as any (a dropped connection cannot abandon it), and
        answers the prompt itself when it ends (:meth:`_execute_answered`): a prompt costs no
        handler task and no trip through the scheduler of its own.

        An agent that declares its turns ``immediate`` (they never wait on anything) has its
        turn run by the reader itself (:meth:`run_here`), shielded from the connection's
        cancellation: no task at all, and no pass of the event loop of its own.

        Returns:
            ``True``: started (the caller counts it in flight; the turn uncounts it);
            ``False``: the prompt takes the general path (:meth:`_prompt`, in a task);
            a response: the prompt was refused (it could not be journalled): send it;
            :class:`StartedHere`: accepted, to be run by the caller (:meth:`run_here`).
        """
        if not self._recovered.is_set() or self.stop_requested.is_set():
            return False
        text = req.args.get("text")
        if not isinstance(text, str):
            return False
        k, command_id = _command_key(req)
        if k in self._running or self._done_result(k) is not None:
            return False
        try:
            self._turn.acquire_nowait()
        except trio.WouldBlock:
            return False
        if not self._valid(conn):  # _handle drops the connection, or refuses the route
            self._turn.release()
            return False
        try:
            running, accepted = self._accept(conn, req, k, command_id)
        except AgentdError as exc:
            return fail(req.id, exc)
        running.stream = req.args.get("stream", True) is not False
        running.raw = req.args.get("raw") is True
        self._answering += 1
        if self._immediate and not conn.ms.line_waiting():
            # (a request pipelined behind it is read at once instead: its turn is a task)
            running.cancel_scope.shield = True  # see run_here
            return StartedHere(k, text, running, accepted)
        assert self._nursery is not None
        self._nursery.start_soon(self._execute_answered, k, text, running, accepted, conn, req)
        return True

    async def run_here(self, started: StartedHere, conn: Conn, req: Request) -> None:
        """Run an immediate agent's turn that :meth:`start_prompt` accepted, in the caller
        (the connection's reader), and answer it.

        Cancellation: the turn is shielded (a dropped connection cannot abandon it, as one
        in the worker's nursery); a client's ``cancel``, a ``kill`` and a stop still reach it
        through its own scope. Only the answer's send may be cut short. The turn's own scope
        is the shield (:meth:`start_prompt` made it one), and the few waits of the turn
        outside it shield themselves (:meth:`_execute`): a prompt enters one cancel scope, not
        two (each costs a few microseconds).
        """
        await self._execute_answered(started.key, started.text, started.running,
                                     started.accepted, conn, req)

    def _accept(self, conn: Conn, req: Request, k: _journal.Key, command_id: str | int
                ) -> tuple[Running, int]:
        """Journal a new command (the caller holds ``self._turn``): its running turn and
        the sequence number of its ``accepted`` record (0 without a journal).

        Raises:
            AgentdError: the record could not be written; the turn is released, and nothing
                of the command is left (a resend runs it).
        """
        running = Running(conn, req.id, k)
        self._running[k] = running
        accepted = 0
        if self.journal is not None:
            record = _journal.accepted(req.client_id, command_id, "prompt", req.args,
                                       boot=self.boot_id or None)
            try:
                if self.agent.replayable:
                    # its turn runs without waiting for the flush (see _execute): its started
                    # marker goes in the same write (a replayable command is replayed after a
                    # crash whether or not it is there)
                    accepted = self.journal.append(record, _journal.started(k[0], k[1]))
                    running.marked_started = True
                else:
                    accepted = self.journal.append(record)
            except AgentdError:
                # never accepted: nothing of it is in the journal; a resend runs it
                del self._running[k]
                self._turn.release()
                raise
        return running, accepted

    async def _execute_answered(
        self, k: _journal.Key, text: str, running: Running, accepted: int, conn: Conn,
        req: Request,
    ) -> None:
        """:meth:`_execute` a prompt :meth:`start_prompt` started, then answer it."""
        try:
            await self._execute(k, text, running, accepted)
            await self._answer(conn, req, running, last=True)
        finally:
            conn.in_flight.value -= 1
            self._prompt_done()

    async def _prompt_answered(self, conn: Conn, req: Request) -> None:
        before_stop = not self.stop_requested.is_set()
        k, command_id = _command_key(req)
        if await self._answer_if_done(conn, req, k):
            return
        running = self._running.get(k)
        if running is None:
            text = req.args.get("text")
            if not isinstance(text, str):
                await self._respond(
                    conn, fail(req.id, AgentdError(ErrorCode.BAD_REQUEST, "prompt needs text"))
                )
                return
            try:
                self._turn.acquire_nowait()
                waited = False
            except trio.WouldBlock:
                await self._turn.acquire()
                waited = True
            # a pending command of a connection that lost its claim (or was superseded by a
            # newer supervisor) while it waited must not run (no wait: _handle just checked)
            if waited and not self._valid(conn):
                self._turn.release()
                if conn.direct:
                    await self._respond(conn, fail(req.id, AgentdError(
                        ErrorCode.GRANT_REFUSED, "the route's supervisor was replaced while"
                        " the prompt waited — ask the supervisor for a new route")))
                    conn.scope.cancel()
                else:
                    await self._drop(conn, "supervisor claim no longer valid")
                return
            if self.stop_requested.is_set():
                # stopping: nothing new starts. A prompt queued behind a killed turn ends
                # with it; any other goes back to the supervisor, which serves it after the
                # stop (a fresh worker, or the session made anew after a kill)
                self._turn.release()
                if self._killed and before_stop:
                    error = session_killed_error(self.session_id)
                else:
                    error = AgentdError(ErrorCode.WORKER_UNAVAILABLE,
                                        f"session {self.session_id}: its worker is stopping")
                await self._respond(conn, fail(req.id, error))
                return
            # a resend queued behind the original: the original may have finished meanwhile
            if self._done_result(k) is not None:
                self._turn.release()
                await self._answer_if_done(conn, req, k)
                return
            running = self._running.get(k)
            if running is None:
                try:
                    running, accepted = self._accept(conn, req, k, command_id)
                except AgentdError as exc:
                    await self._respond(conn, fail(req.id, exc))
                    return
                assert self._nursery is not None
                # runs in the worker's nursery: a dropped connection cannot abandon it
                self._nursery.start_soon(self._execute, k, text, running, accepted)
            else:
                self._turn.release()
        await _acquire(running.lock)
        try:
            # a resend joining a running turn gets what it produced so far, then the rest
            running.listener = conn
            running.request_id = req.id
            running.stream = req.args.get("stream", True) is not False
            running.raw = req.args.get("raw") is True
            running.sent_to = dict.fromkeys(STREAMS, 0)
            await self._catch_up(running)
        finally:
            running.lock.release()
        await running.done.wait()
        await self._answer(conn, req, running)

    async def _answer(self, conn: Conn, req: Request, running: Running, *,
                      last: bool = False) -> None:
        """Answer ``req`` with the outcome of its turn, which has ended (``last``: the
        caller's last act, see :meth:`_respond`)."""
        if (
            running.error is None
            and isinstance(running.result, dict)
            and not inline(running.result)
            and running.listener is conn
        ):
            # an answer that cannot come inline (binary, or big) comes as chunks, streamed
            # or not
            await _acquire(running.lock)
            try:
                running.stream = True
                await self._catch_up(running)
            finally:
                running.lock.release()
        if running.error is not None:
            await self._respond(conn, fail(req.id, running.error), last=last)
        else:
            await self._respond(conn, ok(req.id, running.result), last=last)

    async def _cancel(self, conn: Conn, req: Request) -> None:
        """Cancel a running turn: this client's command ``command_id``, or without one the
        session's running turn. Answered once the turn has ended (its processes reaped)."""
        command_id = req.args.get("command_id")
        if command_id is not None:
            running = self._running.get(_journal.key_of(req.client_id, command_id))
        else:
            running = self._turn_running
        if running is None or running.done.is_set():
            await self._respond(conn, ok(req.id, {"cancelled": False,
                                                  "reason": "no such turn is running"}))
            return
        running.cancel_scope.cancel()
        await running.done.wait()
        await self._respond(conn, ok(req.id, {"cancelled": True}))

    def _notify(self, notice: Notice) -> None:
        """Tell the supervisor (if one is connected) without waiting for it."""
        if notice.kind == "turn_done":
            self.followers.turn_done(self.turns)
        conn = self.current
        if conn is not None and not conn.dropped:
            conn.notice = notice
            conn.notice_ready.set()

    async def _relay(self, running: Running, chunk: Chunk) -> None:
        """Keep a piece of the turn's output and pass it on at once. A listener that does not
        read makes this wait (and so the agent, whose pipe then fills): backpressure."""
        if isinstance(chunk, ExitStatus):
            running.exit_status = chunk.code
            return
        if isinstance(chunk, Waiting):
            await self._relay_waiting(running, chunk)
            return
        stream, raw = (STDERR, chunk.data) if isinstance(chunk, Stderr) else (STDOUT, chunk)
        data = raw.encode(errors="surrogateescape") if isinstance(raw, str) else bytes(raw)
        if not data:
            return
        # (a full acquire, a checkpoint: an agent that yields output without ever awaiting
        # anything still lets the rest of the worker run between its chunks; a turn's first
        # chunk, nothing before it to be fair to, takes a free lock without one)
        if running.outputs[STDOUT].size or running.outputs[STDERR].size:
            await running.lock.acquire()
        else:
            await _acquire(running.lock)
        try:
            output = running.outputs[stream]
            at = output.size
            output.add(data)  # OSError (a full disk): the turn fails, storage_error
            if stream == STDOUT:  # followers get the reply as it streams; the rest at the end
                self._follow_chunk(running, at, data)
            listener = running.listener
            if listener is None or listener.dropped or not running.wants_chunks():
                return
            if running.sent_to[stream] != at:
                await self._catch_up(running)
                return
            for offset, piece in pieces(data):
                await self._send_chunk(listener, running.request_id, at + offset, piece, stream,
                                       raw=running.raw)
            running.sent_to[stream] = at + len(data)
        finally:
            running.lock.release()

    async def _relay_waiting(self, running: Running, chunk: Waiting) -> None:
        """Output waiting in the agent's pipe: taken into the turn's output (straight into
        its file, once it has one, with ``splice``) and sent to the listener from there (with
        ``sendfile``, to a raw peer), so the bytes need not pass through Python."""
        stream = STDERR if chunk.stderr else STDOUT
        # a free lock without a checkpoint: the agent's wait for its pipe was one, and so is
        # the send below (a take is one trip through the scheduler, not two)
        await _acquire(running.lock)
        try:
            output = running.outputs[stream]
            at = output.size
            count, data = output.take(chunk.fd, chunk.size)  # OSError: storage_error
            if not count:
                return
            fd = output.file_fd
            if data is None and fd is not None and stream == STDOUT and self.followers.all:
                data = os.pread(fd, count, at)  # a follower gets the bytes themselves
            if stream == STDOUT:
                self._follow_chunk(running, at, data or b"")
            listener = running.listener
            if listener is None or listener.dropped or not running.wants_chunks():
                return
            if running.sent_to[stream] != at:
                await self._catch_up(running)
                return
            if data is not None:  # read (in memory still, or no splice): sent as it is
                for offset, piece in pieces(data):
                    await self._send_chunk(listener, running.request_id, at + offset, piece,
                                           stream, raw=running.raw)
                running.sent_to[stream] = at + count
                return
            if fd is None or not running.raw:
                await self._catch_up(running)  # read back from the file, base64 in frames
                return
            if listener.dropped:
                return
            end = at + count
            events = []
            for offset in range(at, end, RAW_CHUNK_MAX):
                event = chunk_event(offset, b"", stream)
                del event["data"]
                events.append((event, offset, min(RAW_CHUNK_MAX, end - offset)))
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await listener.ms.send_events_file(running.request_id, events, fd)
            running.sent_to[stream] = end
        finally:
            running.lock.release()

    def _follow_chunk(self, running: Running, at: int, data: bytes) -> None:
        """Pass a piece of the running turn's output on to its followers (never waits); ``b""``
        only marks the turn started for them."""
        key = running.key
        if self._running.get(key) is not running:
            return
        followers = self.followers
        if not followers.all:
            # nobody to pass it to: only the turn's start is kept, for a follower that comes
            current = followers.current
            if current is not None and current["command"] == [*key]:
                return
            data = b""

        def prompt() -> str | None:
            if self.journal is None:
                return None
            text = self.journal.state.accepted.get(key, {}).get("args", {}).get("text")
            return text if isinstance(text, str) else None

        # in chunk-sized events: a follower's events are base64 in their frames
        for offset, piece in pieces(data) if data else [(0, data)]:
            self.followers.chunk(list(key), self.turns + 1, prompt, at + offset, piece)

    async def _follow(self, conn: Conn, req: Request) -> None:
        """``follow``: the running turn so far, then every turn's output as it streams (chunk
        events) and each turn's end, until the connection closes. A follower never slows a
        turn: one more than ``FOLLOW_MAX_BYTES`` behind gets ``follower_behind`` and is let go.
        """
        follower = self.followers.add()
        try:
            current = self.followers.current
            running = self._turn_running
            if current is not None and running is not None:
                upto = running.outputs[STDOUT].size  # what the live events do not carry
                # a follower that comes back (it fell behind) has seen the turn up to ``at``
                seen = req.args.get("at") if req.args.get("command") == current["command"] else 0
                start = seen if isinstance(seen, int) and 0 <= seen <= upto else 0
                await self._respond(conn, Event(id=req.id, event=current))
                for at, piece in running.outputs[STDOUT].read(start):
                    if at >= upto:
                        break
                    piece = piece[: upto - at]
                    await self._respond(conn, Event(id=req.id, event={
                        **chunk_event(at, piece), "turn": current["turn"],
                        "command": current["command"]}))
            await self._respond(conn, Event(id=req.id, event={
                "kind": "following", "session": self.session_id, "pid": self.pid,
                "turns": self.turns}))
            while True:
                got = await follower.next()
                if got is None:
                    await self._respond(conn, fail(req.id, AgentdError(
                        ErrorCode.FOLLOWER_BEHIND,
                        f"fell more than {follower.max_bytes} bytes behind the output of session"
                        f" {self.session_id}; the turn went on without us — `trio-agentd logs"
                        f" {self.session_id}` shows it",
                        {"limit": follower.max_bytes})))
                    return
                event, size = got
                await self._respond(conn, Event(id=req.id, event=event))
                follower.done(size)
        finally:
            self.followers.remove(follower)

    async def _catch_up(self, running: Running) -> None:
        """Send the listener what it has not been sent yet (the caller holds the lock)."""
        listener = running.listener
        if listener is None or listener.dropped or not running.wants_chunks():
            return
        for stream, output in running.outputs.items():
            for at, piece in output.read(running.sent_to[stream]):
                await self._send_chunk(listener, running.request_id, at, piece, stream,
                                       raw=running.raw)
                running.sent_to[stream] = at + len(piece)

    def _done_result(self, k: _journal.Key) -> tuple[bool, Any] | None:
        """``(True, result)`` if completed, ``(False, started)`` if interrupted (``started``:
        it may have run), else ``None``."""
        if self.journal is not None:
            state = self.journal.state
            if k in state.completed:
                return (True, state.completed[k])
            if k in state.interrupted:
                if k in state.cancelled:
                    return (False, None)
                return (False, k not in state.never_started)
            return None
        if k in self._memory_done:
            return (True, self._memory_done[k])
        if k in self._memory_cancelled:
            return (False, None)
        return None

    async def _answer_if_done(self, conn: Conn, req: Request, k: _journal.Key) -> bool:
        done = self._done_result(k)
        if done is None:
            return False
        if self.journal is not None:
            # answer only from a durable record (it may have been written a moment ago)
            try:
                await self.journal.sync(self.journal.written)
            except AgentdError as exc:
                await self._respond(conn, fail(req.id, _ran(exc)))
                return True
        completed, result = done
        if completed and (gone := missing_output(result)) is not None:
            # it ran; what it printed went with the session's oldest output: say so, rather
            # than answer with part of it
            await self._respond(conn, fail(req.id, AgentdError(
                ErrorCode.STORAGE_ERROR,
                f"command {k[1]} ran (turn {result.get('turn')}), but its output is no longer"
                f" kept: {gone} was removed (a session keeps logs.output_max_bytes of output,"
                " the newest turns'); trio-agentd logs still shows its record",
                {"ran": True, "path": gone})))
            return True
        if completed and (req.args.get("stream", True) is not False or not inline(result)):
            # a resend of a finished command gets its whole output again
            for stream in STREAMS:
                for at, piece in stored_pieces(result, stream):
                    await self._send_chunk(conn, req.id, at, piece, stream,
                                           raw=req.args.get("raw") is True)
        if completed:
            answer = ok(req.id, result)
        elif result is None:
            answer = fail(req.id, AgentdError(
                ErrorCode.COMMAND_CANCELLED, f"command {k[1]} was cancelled", {"id": k[1]}))
        else:
            answer = fail(req.id, interrupted_error(k, started=bool(result)))
        await self._respond(conn, answer)
        return True

    async def _execute(
        self,
        k: _journal.Key,
        text: str,
        running: Running,
        accepted: int,
        *,
        replay: bool = False,
    ) -> None:
        """Run one accepted command to completion. The caller holds ``self._turn``.

        The command runs once its ``accepted`` record is on disk; the turn is released as soon
        as its ``completed`` record is written, so the next turn's ``accepted`` shares the same
        flush; its client is answered once that flush is done.

        Cancellation: a turn whose scope shields it (:meth:`run_here`) is shielded here as a
        whole: its waits outside that scope shield themselves.
        """
        seq = accepted
        try:
            if self.journal is not None and not self.agent.replayable:
                # a command with effects that must not repeat runs only once its acceptance
                # is on disk; a replayable one may run at once (its record is already in the
                # page cache, which a kill -9 of this process does not lose; if the machine
                # dies first, the client was never answered and may safely resend it)
                with trio.CancelScope(shield=running.cancel_scope.shield):
                    await self.journal.sync(accepted, inline=self._alone())
            elif self.journal is not None and (lost := self.journal.lost(accepted)) is not None:
                raise lost  # a flush failed after its acceptance: it never ran, a resend runs it
            seq = await self._run_turn(k, text, running, replay=replay)
        except AgentdError as exc:
            if exc.code != ErrorCode.STORAGE_ERROR:
                raise
            running.error = exc  # it never ran (_run_turn answers for a turn that ran)
            seq = 0
            if self.journal is not None and k in self.journal.state.accepted:
                # its acceptance ends here (no accepted command is left without its end);
                # a record that cannot be written now is kept and written before the next
                # one (the journal logged why)
                with contextlib.suppress(AgentdError):
                    self.journal.append(_journal.dropped(k[0], k[1]), keep=True)
        finally:
            self._turn_running = None
            self._turn.release()
            self._note_agent_start(running)
            self._notify(Notice(kind="turn_done", turn=self.turns, failure=self.agent_failure))
        if self.journal is not None:
            if seq:  # (0: it never ran, and its client is told so; nothing to wait for)
                try:
                    inline = self._alone()
                    if not self.journal.synced(seq, inline=inline):  # else: no wait, no scope
                        with trio.CancelScope(shield=True):
                            await self.journal.sync(seq, inline=inline)
                except AgentdError as exc:
                    running.error = _ran(exc)  # the turn ran; its outcome is kept
            if self.journal.wants_compaction():
                if self.transcript is not None:
                    with contextlib.suppress(OSError):  # logged when written; kept
                        self.transcript.sync()  # compaction forgets old results: keep the view
                self.journal.maybe_compact()
        self._running.pop(k, None)
        self._bound_output(running)
        running.done.set()

    def _bound_output(self, running: Running) -> None:
        """Once a turn whose output went to a file has ended (its outcome durable), remove
        the session's oldest turns' files past ``logs.output_max_bytes`` (:func:`prune`)."""
        if self.transcript is None:
            return
        budget = self.transcript.limits.output_max_bytes
        mine = [o.path for o in running.outputs.values() if o.spilled and o.path is not None]
        if budget <= 0 or not mine:
            return
        try:
            removed = prune(Path(mine[0]).parent, budget, {Path(p).name for p in mine})
        except OSError as exc:  # (the dir unreadable: nothing removed, tried after each turn)
            log.warning("output of session %s: could not bound it: %s", self.session_id, exc)
            return
        if removed:
            log.info("output of session %s past %d bytes: removed the files of older turns"
                     " (%s)", self.session_id, budget, ", ".join(removed))

    def _note_agent_start(self, running: Running) -> None:
        """A turn whose agent could not be started (no such program, not executable, no shell)
        leaves the session failed with that cause, which the supervisor shows; a turn that ran
        to completion clears it (a cancelled or interrupted one says nothing either way)."""
        if isinstance(running.error, AgentStartError):
            self.agent_failure = running.error.message
        elif running.result is not None:
            self.agent_failure = ""

    def _alone(self) -> bool:
        """Only one command in flight: flush inline (no thread hop); else group-commit."""
        return len(self._running) <= 1 and self._turn.statistics().tasks_waiting == 0

    async def _run_turn(
        self, k: _journal.Key, text: str, running: Running, *, replay: bool
    ) -> int:
        """Run the agent and write the outcome; the journal sequence number to wait for."""
        journal = self.journal
        turn = self.turns + 1
        ctx = TurnContext(
            session_id=self.session_id,
            turn=turn,
            cwd=self.cwd,
            session_dir=self.transcript.dir if self.transcript else self.cwd,
            on_group=functools.partial(self._on_group, k) if journal is not None else None,
            pipes=True,  # _relay takes Waiting chunks
        )
        prefix = self.transcript.output_prefix if self.transcript else None
        output = running.outputs[STDOUT] = TurnOutput(f"{prefix}{turn}.out" if prefix else None)
        errors = running.outputs[STDERR] = TurnOutput(
            f"{prefix}{turn}.err" if prefix else None, STDERR
        )
        self._notify(Notice(kind="turn_started", turn=self.turns))
        if journal is not None and not running.marked_started:
            # not flushed on its own: it rides the outcome's flush (see _recover_one)
            journal.append(_journal.started(k[0], k[1]))
        self._turn_running = running
        try:
            with running.cancel_scope:
                turn_chunks = self.agent.turn(text, ctx)
                try:
                    async for chunk in turn_chunks:
                        await self._relay(running, chunk)
                finally:
                    # closed now, not at garbage collection (its processes die)
                    aclose = _aclose_of(turn_chunks)
                    if aclose is not None:
                        with trio.move_on_after(AGENT_CLOSE_TIMEOUT, shield=True):
                            await aclose()
            if running.cancel_scope.cancelled_caught and running.killed:
                output.close()
                errors.close()
                log.info("turn %s ended: the session was killed", turn)
                running.error = session_killed_error(self.session_id, turn)
                if journal is None:
                    self._memory_cancelled.add(k)
                return self._outcome(running, _journal.interrupted(k[0], k[1], cancelled=True))
            if running.cancel_scope.cancelled_caught:
                output.close()
                errors.close()
                log.info("turn %s cancelled by its client", turn)
                running.error = AgentdError(
                    ErrorCode.COMMAND_CANCELLED,
                    f"turn {turn} was cancelled; its processes were stopped (what it did"
                    " before stays done)",
                    {"turn": turn},
                )
                if journal is None:
                    self._memory_cancelled.add(k)
                return self._outcome(running, _journal.interrupted(k[0], k[1], cancelled=True))
        except OSError as exc:
            output.close()
            errors.close()
            log.error("turn %s: cannot keep its output: %s", turn, exc)
            where = os.fspath(output.path or self.cwd)
            running.error = AgentdError(
                ErrorCode.STORAGE_ERROR,
                f"the turn ran but its output could not be kept: writing {where} failed with"
                f" {errno_name(exc)} ({exc.strerror or exc}) — {REMEDY}; check what it did"
                " before sending it again",
                {"path": where, "errno": errno_name(exc), "ran": True},
            )
            return self._outcome(running, _journal.interrupted(k[0], k[1]))
        except AgentdError as exc:
            output.close()
            errors.close()
            log.warning("agent refused turn %s: %s", turn, exc.message)
            running.error = exc
            return self._outcome(running, _journal.interrupted(k[0], k[1]))
        except Exception as exc:
            output.close()
            errors.close()
            log.exception("agent failed on turn %s", turn)
            running.error = AgentdError(ErrorCode.INTERNAL, f"agent failed: {exc}")
            return self._outcome(running, _journal.interrupted(k[0], k[1]))
        output.close()
        errors.close()
        result = {"session": self.session_id, "turn": turn, **output.result_fields(),
                  **errors.result_fields()}
        if running.exit_status is not None:
            result["exit_status"] = running.exit_status
        if self.transcript is not None:
            transcript = self.transcript
            try:
                transcript.append(
                    {"kind": "turn", "turn": turn, "prompt": text, **kept_output(result),
                     "client_id": k[0], "id": k[1], "replayed": replay}
                )
            except OSError as exc:
                # the line is kept (written before the next one) and the journal, the durable
                # record, brings the transcript up to date at the next start: go on
                with contextlib.suppress(OSError), trio.CancelScope(
                    shield=running.cancel_scope.shield
                ):
                    await retried(transcript.write_pending, what=f"transcript {transcript.path}",
                                  delays=self.timing.storage_retry_delays, log=log, failed=exc)
        else:
            self._memory_turns = turn
            self._memory_done[k] = result
            while len(self._memory_done) > KEEP_COMPLETED:
                del self._memory_done[next(iter(self._memory_done))]
        self.turns_run += 1
        running.result = result
        return self._outcome(running, _journal.completed(k[0], k[1], result))

    def _outcome(self, running: Running, record: bytes) -> int:
        """Journal the outcome of a turn that ran: its sequence number (0: nothing to wait
        for). If it cannot be written it is kept, and its client told so."""
        self._transcribe_end(running, record)
        if self.journal is None:
            return 0
        try:
            return self.journal.append(record, keep=True)
        except AgentdError as exc:
            running.error = _ran(exc)
            return 0


    def _transcribe_end(self, running: Running, record: bytes) -> None:
        """A turn that did not complete is an event in the transcript (``cancelled``,
        ``killed`` or ``failed``, with its error), so its history shows it."""
        error = running.error
        if self.transcript is None or error is None:
            return
        kinds: dict[str, str] = {ErrorCode.COMMAND_CANCELLED: "cancelled",
                                 ErrorCode.SESSION_KILLED: "killed"}
        kind = kinds.get(error.code, "failed")
        rec = _journal.record_of(record)
        k = _journal.key_of(str(rec.get("client_id", "")), rec.get("id", ""))
        text = None
        if self.journal is not None:
            text = self.journal.state.accepted.get(k, {}).get("args", {}).get("text")
        self.transcript.event(
            kind, turn=self.turns + 1, command=list(k),
            prompt=text if isinstance(text, str) else None, bytes=running.outputs[STDOUT].size,
            error=error.message)


def _command_key(req: Request) -> tuple[_journal.Key, str | int]:
    """A prompt's journal key, the client's ``(client_id, command id)`` (``req.id`` is per
    link), and its command id."""
    command_id = req.args.get("command_id", req.id)
    if not isinstance(command_id, (str, int)):
        command_id = str(command_id)
    return _journal.key_of(req.client_id, command_id), command_id


async def _acquire(lock: trio.Lock) -> None:
    """Take ``lock``; a free one without a trip through the scheduler."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


def kept_output(record: dict[str, Any]) -> dict[str, Any]:
    """The fields of a result or transcript line that say where a turn's output is, and how
    its command ended."""
    return {f: record[f] for f in (*FIELDS[STDOUT], *FIELDS[STDERR], "exit_status")
            if f in record}


def _aclose_of(chunks: AsyncIterator[Chunk]) -> Callable[[], Awaitable[object]] | None:
    """How to close an agent's chunk generator, if it has anything to close (a native
    generator that ran to its end has no frame: nothing to close, no scope to enter)."""
    aclose: Callable[[], Awaitable[object]] | None = getattr(chunks, "aclose", None)
    if aclose is None or getattr(chunks, "ag_frame", True) is None:
        return None
    return aclose


def session_killed_error(session_id: str, turn: int | None = None) -> AgentdError:
    """A prompt cut short by `trio-agentd kill`: one line, its own code."""
    what = f"turn {turn}" if turn is not None else "the prompt"
    return AgentdError(
        ErrorCode.SESSION_KILLED,
        f"session {session_id} was killed; {what} was stopped (what it did before stays done)",
        {"session": session_id, **({"turn": turn} if turn is not None else {})},
    )


def interrupted_error(k: _journal.Key, *, started: bool = True) -> AgentdError:
    """``started``: the turn had started (or may have), so its effects may have happened."""
    if started:
        advice = "it had started and may have had effects; check before sending it again"
    else:
        advice = "it never started; send it again"
    return AgentdError(
        ErrorCode.COMMAND_INTERRUPTED,
        f"command {k[1]} of client {k[0] or '?'} was interrupted by a worker restart and its"
        f" agent cannot replay it — {advice}",
        {"client_id": k[0], "id": k[1], "started": started},
    )


def _ran(exc: AgentdError) -> AgentdError:
    """A ``storage_error`` for a turn that ran (its result is kept, a resend gets it)."""
    cause = exc.__cause__
    if exc.code == ErrorCode.STORAGE_ERROR and isinstance(cause, OSError):
        return storage_error(exc.details.get("path", "?"), cause, ran=True)
    return exc
