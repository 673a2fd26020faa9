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

import collections
import contextlib
import functools
import hmac
import json
import logging
import math
import os
import signal
import socket as _socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio
from trio_util import AsyncValue

from . import _fs, _journal
from ._defaults import FOLLOW_MAX_BYTES
from ._errors import AgentdError, ErrorCode
from ._fence import Claim, Fence
from ._grant import check_grant
from ._identity import (
    GroupIdentity,
    group_members,
    own_start_id,
    peer_credentials,
    read_start_id,
)
from ._output import (
    FIELDS,
    INLINE_MAX,
    STDERR,
    STDOUT,
    STREAMS,
    TurnOutput,
    chunk_event,
    inline,
    pieces,
    stored_pieces,
)
from ._protocol import (
    APP_VERSION,
    MAX_IN_FLIGHT,
    Attach,
    Auth,
    AuthOk,
    Dropped,
    Event,
    Notice,
    Request,
    WorkerHello,
    decode,
    fail,
    ok,
    request_id_of,
)
from ._rotate import Limits
from ._session import Transcript
from ._storage import REMEDY, errno_name, retried, storage_error, write_all
from ._stream import MessageStream
from .agents import (
    Agent,
    AgentLoadError,
    AgentStartError,
    Chunk,
    ExitStatus,
    Stderr,
    TurnContext,
    load_agent,
)
from .agents._exec import stop_orphan_group
from .timing import DEFAULT_TIMING, Timing

log = logging.getLogger("trio_agentd.worker")

COMPACT_AFTER = 2000  # journal lines
KEEP_COMPLETED = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    session_id: str
    agent: str
    token: str
    supervisor_socket: str
    registry: str
    worker_socket: str
    journal: str
    session_dir: str
    cwd: str
    agent_path: tuple[str, ...] = ()  # where a module:attribute agent is imported from

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.__slots__})

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        fields = json.loads(text)
        fields["agent_path"] = tuple(fields.get("agent_path") or ())
        return cls(**fields)


class Journal:
    """The worker's command journal, with group commit.

    ``append`` writes a record at once (so it survives a ``kill -9`` of this process: it is in
    the page cache, in order); ``await sync(seq)`` returns once that record is on disk. One
    flusher task runs ``fdatasync`` in a thread and covers every record written before it
    started, so a turn's ``completed`` and the next turn's ``accepted`` share one flush, and
    so do the records of concurrent commands. Durability is unchanged: nobody is answered, and
    no command runs, before its record is on disk.

    Failed writes (ENOSPC, EDQUOT, EFBIG, EIO) raise ``storage_error`` and leave no torn record:
    a failed append is cut back to the last good offset. A failed flush means nothing written
    since the last good flush can be trusted: the file is cut back to that flush, every
    ``sync`` of a record after it raises ``storage_error``, the acceptance of every command that
    never started is forgotten (a resend runs it), and the records of commands that did run
    (started, outcomes) are kept in memory and written again before anything else
    (:attr:`backlog`), so a resend gets its result and nothing runs twice.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        _fs.ensure_dir(path.parent)
        data = _fs.read_bytes(path) or b""
        self.state = _journal.parse(data)
        self._lines = len(self.state.accepted) + len(self.state.completed)
        self._fd = _fs.open_trusted(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        if data and not data.endswith(b"\n"):
            try:
                write_all(self._fd, b"\n")  # seal a truncated tail so the next record parses
            except OSError:
                os.ftruncate(self._fd, data.rfind(b"\n") + 1)  # no room: cut the torn tail
        self._offset = os.fstat(self._fd).st_size  # end of the last good record
        self._torn: int | None = None  # a cut that failed: the offset to cut back to first
        self.written = 0  # sequence number of the last record written
        self._durable = 0  # ... and of the last one known to be on disk
        self._durable_offset = self._offset
        self._unflushed: list[tuple[int, int, bytes]] = []  # (seq, end offset, line)
        self.backlog: list[bytes] = []  # records of commands that ran, to write again
        self._lost: list[tuple[int, int, OSError]] = []  # (after, through, why)
        self._durable_changed = trio.Event()
        self._wanted = trio.Event()
        self._flusher_running = False
        self._flushing = False
        self.flushes = 0
        self.storage_failures = 0
        self.last_storage_error: AgentdError | None = None

    def append(self, line: bytes, *, keep: bool = False) -> int:
        """Write a record (not yet durable); its sequence number for :meth:`sync`.

        ``keep``: the record is the outcome of a command that ran; if it cannot be written it is
        still applied, and kept in :attr:`backlog` to be written before the next record.

        Raises:
            AgentdError: ``storage_error``; nothing of the record is left in the file.
        """
        try:
            self._write_backlog()
            self._write(line)
        except AgentdError:
            if keep:
                self.backlog.append(line)
                self._apply(line)
            raise
        self._apply(line)
        return self.written

    def _apply(self, line: bytes) -> None:
        rec = _journal.record_of(line)
        self.state.apply(rec)
        if rec.get("kind") not in ("started", "dropped", "group", "group_stopped"):
            # markers ride along: compaction counts commands
            self._lines += 1

    def _write(self, line: bytes) -> None:
        if self._torn is not None:
            try:
                os.ftruncate(self._fd, self._torn)
            except OSError as exc:
                raise self._failed(exc) from exc
            self._torn = None
        start = self._offset
        try:
            write_all(self._fd, line)
        except OSError as exc:
            self._cut(start)
            raise self._failed(exc) from exc
        self._offset = start + len(line)
        self.written += 1
        self._unflushed.append((self.written, self._offset, line))

    def _write_backlog(self) -> None:
        while self.backlog:
            self._write(self.backlog[0])
            del self.backlog[0]

    def _cut(self, offset: int) -> None:
        """Cut the file back to ``offset`` (a torn record); if even that fails, before the
        next write."""
        try:
            os.ftruncate(self._fd, offset)
        except OSError as exc:
            log.error("journal %s: cannot cut a torn record at %d: %s", self.path, offset, exc)
            self._torn = offset

    def _failed(self, exc: OSError) -> AgentdError:
        err = storage_error(self.path, exc)
        self.storage_failures += 1
        self.last_storage_error = err
        log.error("journal %s: a write or flush failed: %s (%s)", self.path, errno_name(exc),
                  exc)
        return err

    def lost(self, seq: int) -> AgentdError | None:
        """Why record ``seq`` will never be durable (a flush failed after it), or ``None``."""
        for after, through, exc in self._lost:
            if after < seq <= through:
                err = storage_error(self.path, exc)
                err.__cause__ = exc
                return err
        return None

    async def sync(self, seq: int, *, inline: bool = False) -> None:
        """Return once record ``seq`` (and every one before it) is on disk.

        ``inline``: nobody else is waiting, so flush here without a thread hop (the lowest
        latency for a lone command; concurrent commands share the flusher's flushes).

        Raises:
            AgentdError: ``storage_error``: a flush failed after the record was written (or the
                backlog, written first, could not be).

        Cancellation: the caller stops waiting; the flush goes on for the others.
        """
        if self.backlog:
            self._write_backlog()
            seq = max(seq, self.written)
        while True:
            err = self.lost(seq)
            if err is not None:
                raise err
            if self._durable >= seq:
                return
            if not self._flusher_running or (inline and not self._flushing):
                self._flush_now()
                continue
            self._wanted.set()
            event = self._durable_changed
            await event.wait()

    def append_durable(self, line: bytes) -> None:
        """Write and flush inline (startup recovery, before the flusher runs).

        Raises:
            AgentdError: ``storage_error`` (the record is kept in :attr:`backlog`).
        """
        seq = self.append(line, keep=True)
        self._flush_now()
        err = self.lost(seq)
        if err is not None:
            raise err

    def _flush_now(self) -> None:
        target, offset = self.written, self._offset
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._flush_failed(exc)
            return  # the caller finds its record lost
        self.flushes += 1
        self._mark_durable(target, offset)

    def _mark_durable(self, seq: int, offset: int) -> None:
        if seq > self._durable:
            self._durable = seq
            self._durable_offset = offset
            self._unflushed = [u for u in self._unflushed if u[0] > seq]
            self._durable_changed.set()
            self._durable_changed = trio.Event()

    def _flush_failed(self, exc: OSError) -> None:
        """A flush failed: nothing after the last good one can be trusted (fsync errors
        are reported once and the data may be gone). Cut back to it; keep what ran."""
        self._failed(exc)
        self._lost.append((self._durable, self.written, exc))
        state = self.state
        kept: list[bytes] = []
        for _seq, _end, line in self._unflushed:
            rec = _journal.record_of(line)
            k = _journal.key_of(str(rec.get("client_id", "")), rec.get("id", ""))
            ran = k in state.started or k in state.completed or k in state.interrupted
            if rec.get("kind") == "accepted" and not ran:
                state.accepted.pop(k, None)  # never ran: forgotten, a resend runs it
                self._lines -= 1
                continue
            kept.append(line)
        self._unflushed = []
        self.backlog[:0] = kept
        self._cut(self._durable_offset)
        self._offset = self._durable_offset
        self._durable_changed.set()  # every waiter looks again: theirs may be lost
        self._durable_changed = trio.Event()

    async def run_flusher(self) -> None:
        """Group commit: flush whatever was written since the last flush, in a thread."""
        self._flusher_running = True
        try:
            while True:
                await self._wanted.wait()
                self._wanted = trio.Event()
                target, offset = self.written, self._offset
                if target <= self._durable:
                    continue
                self._flushing = True
                try:
                    await trio.to_thread.run_sync(os.fdatasync, self._fd)
                except OSError as exc:
                    self._flush_failed(exc)
                    continue
                finally:
                    self._flushing = False
                self.flushes += 1
                self._mark_durable(target, offset)
        finally:
            self._flusher_running = False
            if self._durable < self.written or self.backlog:
                # stopping: whoever still waits is answered by one last flush, here
                with contextlib.suppress(AgentdError):  # logged; waiters see their record lost
                    self._write_backlog()
                    self._flush_now()

    def wants_compaction(self) -> bool:
        return self._lines >= COMPACT_AFTER

    def maybe_compact(self) -> None:
        """Rewrite the journal when it grew long; only when every record is durable.

        A rewrite that fails (no space) is logged and left for a later turn.
        """
        if (self._lines < COMPACT_AFTER or self._flushing or self._durable < self.written
                or self.backlog or self._torn is not None):
            return
        from ._fs import atomic_write

        try:
            atomic_write(self.path, _journal.compacted(self.state, KEEP_COMPLETED))
        except OSError as exc:
            log.warning("journal %s: compaction failed (%s); trying again later", self.path, exc)
        if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
            return  # not replaced
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.state = _journal.parse(self.path.read_bytes())
        self._lines = len(self.state.accepted) + len(self.state.completed)
        self._offset = self._durable_offset = os.fstat(self._fd).st_size

    def close(self) -> None:
        os.close(self._fd)


class _Conn:
    """A supervisor connection (``fence``: its claim), or a client's direct route (``direct``:
    admitted by a grant of the supervisor generation ``fence`` was for)."""

    def __init__(self, ms: MessageStream, fence: Fence, *, direct: bool = False,
                 notice_interval: float = 0.0) -> None:
        self.ms = ms
        self.fence = fence
        self.direct = direct
        self.notice_interval = notice_interval
        self.scope = trio.CancelScope()
        self.dropped = False
        # the newest turn notice not yet sent (notices coalesce: only the latest matters)
        self.notice: Notice | None = None
        self.notice_ready = trio.Event()
        self.in_flight = AsyncValue(0)  # requests being handled

    async def send_notices(self) -> None:
        """Send turn notices one at a time, never cancelled half-way through a frame (that
        would corrupt the stream): runs for the connection's life.

        Notices coalesce into the latest (only it matters) and are paced: two may go at once
        (a lone turn's ``turn_started`` and ``turn_done`` are never held), then one per
        ``notice_interval`` (a token bucket of two), so back-to-back prompts cost the
        supervisor a notice per interval instead of two per prompt, and its view of a busy
        session lags by at most that.
        """
        tokens, last = float(_NOTICE_BURST), -math.inf
        while True:
            await self.notice_ready.wait()
            self.notice_ready = trio.Event()
            if self.notice is None:
                continue  # sent already, by the hold below
            if self.notice_interval > 0:
                now = trio.current_time()
                tokens = min(float(_NOTICE_BURST), tokens + (now - last) / self.notice_interval)
                last = now
                if tokens < 1:
                    # notices that come meanwhile replace this one (nothing wakes this task
                    # for them): the latest goes when the hold ends
                    await trio.sleep((1 - tokens) * self.notice_interval)
                    tokens, last = 1.0, trio.current_time()
            else:
                tokens = float(_NOTICE_BURST)
            notice, self.notice = self.notice, None
            if notice is None:
                continue
            tokens -= 1
            if not self.dropped:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.ms.send(notice)


_NOTICE_BURST = 2  # notices that may go at once: a lone turn's start and end


class _Running:
    def __init__(self, listener: _Conn, request_id: Any) -> None:
        self.done = trio.Event()
        self.listener: _Conn | None = listener
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
        self.result: Any = None
        self.error: AgentdError | None = None

    def wants_chunks(self) -> bool:
        """Stream to the listener: it asked to, or the output is too big for the answer."""
        return self.stream or any(out.size > INLINE_MAX for out in self.outputs.values())


class _Follower:
    """One ``logs -f`` subscriber: the events it has not been sent yet, at most ``max_bytes``
    of output. Pushing never waits: one that falls further behind is let go (``dropped``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.size = 0
        self.dropped = False
        self.ready = trio.Event()

    def push(self, event: dict[str, Any], size: int = 0) -> None:
        if self.dropped:
            return
        if self.size and self.size + size > self.max_bytes:  # (one piece always fits)
            self.dropped = True
            self.queue.clear()
            self.size = 0
        else:
            self.queue.append(event)
            self.size += size
        self.ready.set()

    async def next(self) -> tuple[dict[str, Any], int] | None:
        """The next event and its size; ``None`` once dropped."""
        while not self.queue and not self.dropped:
            await self.ready.wait()
            self.ready = trio.Event()
        if self.dropped:
            return None
        event = self.queue.popleft()
        size = len(event["data"]) if event.get("kind") == "chunk" else 0
        return event, size

    def done(self, size: int) -> None:
        """``size`` bytes of output were sent on: room for as many more."""
        self.size -= size


class Followers:
    """Who follows the session's turns as they stream (``follow``), and the turn they see.

    The turn calls :meth:`chunk` for every piece of output and the worker :meth:`turn_done`
    at each turn's end; both only append to bounded queues (see :class:`_Follower`).
    """

    def __init__(self, max_bytes: int = FOLLOW_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.all: set[_Follower] = set()
        self.current: dict[str, Any] | None = None  # the streaming turn's start event

    def add(self) -> _Follower:
        follower = _Follower(self.max_bytes)
        self.all.add(follower)
        return follower

    def remove(self, follower: _Follower) -> None:
        self.all.discard(follower)

    def _push(self, event: dict[str, Any], size: int = 0) -> None:
        for follower in self.all:
            follower.push(event, size)

    def chunk(self, command: list[Any], turn: int, prompt: Callable[[], str | None], at: int,
              data: bytes) -> None:
        if self.current is None or self.current["command"] != command:
            self.current = {"kind": "turn_started", "turn": turn, "command": command,
                            "prompt": prompt()}
            self._push(self.current)
        if not self.all:
            return
        self._push({"kind": "chunk", "turn": turn, "command": command, "at": at,
                    "data": data}, len(data))

    def turn_done(self, turns: int) -> None:
        self.current = None
        self._push({"kind": "turn_done", "turns": turns})


class WorkerCore:
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
        # registry changes (a real worker: inotify, with a slow fallback poll)
        self._watch_claims = watch_claims
        self._wait_change = wait_change
        self.pid = os.getpid() if pid is None else pid
        self.start_id = own_start_id() if start_id is None else start_id
        # in every acceptance: after a restart in the same boot the page cache is intact, so
        # a command without its ``started`` marker certainly never ran
        self.boot_id = _boot_id() if boot_id is None else boot_id
        self.conns: list[_Conn] = []
        self.current: _Conn | None = None
        self._turn_running: _Running | None = None  # the turn whose agent runs now
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
        self._running: dict[_journal.Key, _Running] = {}
        self._nursery: trio.Nursery | None = None
        self.turns_run = 0
        self._memory_turns = 0
        self._memory_done: dict[_journal.Key, Any] = {}
        self._memory_cancelled: set[_journal.Key] = set()  # without a journal
        self.followers = Followers()  # `logs -f`: turns as they stream

    @property
    def turns(self) -> int:
        return self.transcript.turns if self.transcript is not None else self._memory_turns

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
            for k, result in state.completed.items():
                if not isinstance(result, dict) or self.transcript.has(k, result.get("turn")):
                    continue
                if not isinstance(result.get("turn"), int):
                    continue
                text = state.accepted.get(k, {}).get("args", {}).get("text", "")
                try:
                    self.transcript.append(
                        {"kind": "turn", "turn": result["turn"], "prompt": text,
                         **_kept_output(result), "client_id": k[0], "id": k[1],
                         "recovered": True}
                    )
                except OSError as exc:  # kept: written before its next line
                    log.error("transcript %s: %s", self.transcript.path, exc)
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
                "session": self.session_id, "turn": last.get("turn"), **_kept_output(last)}))
        elif self.agent.replayable and rec.get("op") == "prompt":
            running = _Running(listener=None, request_id=rec.get("id"))  # type: ignore[arg-type]
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

    async def _replay(self, k: _journal.Key, rec: dict[str, Any], running: _Running) -> None:
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
            conn = _Conn(ms, fence, notice_interval=self.timing.notice_interval)
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
        conn = _Conn(ms, self.serving, direct=True)
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

    async def _read_commands(self, conn: _Conn, handlers: trio.Nursery) -> None:
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

    def _valid(self, conn: _Conn) -> bool:
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

    async def _drop(self, conn: _Conn, reason: str) -> None:
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
    async def _respond(self, conn: _Conn, msg: Any) -> None:
        if conn.dropped:
            return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await conn.ms.send(msg)

    async def _send_chunk(
        self, conn: _Conn, request_id: Any, at: int, piece: bytes, stream: str, *, raw: bool
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

    async def _handle_counted(self, conn: _Conn, req: Request) -> None:
        try:
            await self._handle(conn, req)
        finally:
            conn.in_flight.value -= 1

    async def _handle(self, conn: _Conn, req: Request) -> None:
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

    async def _prompt(self, conn: _Conn, req: Request) -> None:
        # a resend that arrives while orphans of a killed worker are still being stopped must
        # meet its command as recovered (interrupted, or replaying), never run it as new
        if not self._recovered.is_set():  # (set for good once up: no yield then)
            await self._recovered.wait()
        self._answering += 1
        try:
            await self._prompt_answered(conn, req)
        finally:
            self._answering -= 1
            if not self._answering:
                self._answered.set()
                self._answered = trio.Event()

    async def _prompt_answered(self, conn: _Conn, req: Request) -> None:
        before_stop = not self.stop_requested.is_set()
        # the journal key is the client's (client_id, command id); req.id is per link
        command_id = req.args.get("command_id", req.id)
        if not isinstance(command_id, (str, int)):
            command_id = str(command_id)
        k = _journal.key_of(req.client_id, command_id)
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
                running = _Running(conn, req.id)
                self._running[k] = running
                accepted = 0
                if self.journal is not None:
                    try:
                        accepted = self.journal.append(
                            _journal.accepted(req.client_id, command_id, "prompt", req.args,
                                              boot=self.boot_id or None)
                        )
                    except AgentdError as exc:
                        # never accepted: nothing of it is in the journal; a resend runs it
                        del self._running[k]
                        self._turn.release()
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
            await self._respond(conn, fail(req.id, running.error))
        else:
            await self._respond(conn, ok(req.id, running.result))

    async def _cancel(self, conn: _Conn, req: Request) -> None:
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

    async def _relay(self, running: _Running, chunk: Chunk) -> None:
        """Keep a piece of the turn's output and pass it on at once. A listener that does not
        read makes this wait (and so the agent, whose pipe then fills): backpressure."""
        if isinstance(chunk, ExitStatus):
            running.exit_status = chunk.code
            return
        stream, raw = (STDERR, chunk.data) if isinstance(chunk, Stderr) else (STDOUT, chunk)
        data = raw.encode(errors="surrogateescape") if isinstance(raw, str) else bytes(raw)
        if not data:
            return
        # (a full acquire, a checkpoint: an agent that yields output without ever awaiting
        # anything still lets the rest of the worker run between its chunks)
        await running.lock.acquire()
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

    def _follow_chunk(self, running: _Running, at: int, data: bytes) -> None:
        """Pass a piece of the running turn's output on to its followers (never waits)."""
        key = next((k for k, r in self._running.items() if r is running), None)
        if key is None:
            return

        def prompt() -> str | None:
            if self.journal is None:
                return None
            text = self.journal.state.accepted.get(key, {}).get("args", {}).get("text")
            return text if isinstance(text, str) else None

        self.followers.chunk(list(key), self.turns + 1, prompt, at, data)

    async def _follow(self, conn: _Conn, req: Request) -> None:
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

    async def _catch_up(self, running: _Running) -> None:
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

    async def _answer_if_done(self, conn: _Conn, req: Request, k: _journal.Key) -> bool:
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
        running: _Running,
        accepted: int,
        *,
        replay: bool = False,
    ) -> None:
        """Run one accepted command to completion. The caller holds ``self._turn``.

        The command runs once its ``accepted`` record is on disk; the turn is released as soon
        as its ``completed`` record is written, so the next turn's ``accepted`` shares the same
        flush; its client is answered once that flush is done.
        """
        seq = accepted
        try:
            if self.journal is not None and not self.agent.replayable:
                # a command with effects that must not repeat runs only once its acceptance
                # is on disk; a replayable one may run at once (its record is already in the
                # page cache, which a kill -9 of this process does not lose; if the machine
                # dies first, the client was never answered and may safely resend it)
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
                    with trio.CancelScope(shield=True):
                        await self.journal.sync(seq, inline=self._alone())
                except AgentdError as exc:
                    running.error = _ran(exc)  # the turn ran; its outcome is kept
            if self.journal.wants_compaction():
                if self.transcript is not None:
                    with contextlib.suppress(OSError):  # logged when written; kept
                        self.transcript.sync()  # compaction forgets old results: keep the view
                self.journal.maybe_compact()
        self._running.pop(k, None)
        running.done.set()

    def _note_agent_start(self, running: _Running) -> None:
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
        self, k: _journal.Key, text: str, running: _Running, *, replay: bool
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
        )
        out_dir = self.transcript.dir / "output" if self.transcript else None
        output = running.outputs[STDOUT] = TurnOutput(out_dir / f"{turn}.out" if out_dir else None)
        errors = running.outputs[STDERR] = TurnOutput(
            out_dir / f"{turn}.err" if out_dir else None, STDERR
        )
        self._notify(Notice(kind="turn_started", turn=self.turns))
        if journal is not None:
            # not flushed on its own: it rides the outcome's flush (see _recover_one)
            journal.append(_journal.started(k[0], k[1]))
        self._turn_running = running
        try:
            with running.cancel_scope:
                turn_chunks = self.agent.turn(text, ctx)
                async with _closing(turn_chunks):
                    async for chunk in turn_chunks:
                        await self._relay(running, chunk)
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
                    {"kind": "turn", "turn": turn, "prompt": text, **_kept_output(result),
                     "client_id": k[0], "id": k[1], "replayed": replay}
                )
            except OSError as exc:
                # the line is kept (written before the next one) and the journal, the durable
                # record, brings the transcript up to date at the next start: go on
                with contextlib.suppress(OSError):
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

    def _outcome(self, running: _Running, record: bytes) -> int:
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


    def _transcribe_end(self, running: _Running, record: bytes) -> None:
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


async def _acquire(lock: trio.Lock) -> None:
    """Take ``lock``; a free one without a trip through the scheduler."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


def _kept_output(record: dict[str, Any]) -> dict[str, Any]:
    """The fields of a result or transcript line that say where a turn's output is, and how
    its command ended."""
    return {f: record[f] for f in (*FIELDS[STDOUT], *FIELDS[STDERR], "exit_status")
            if f in record}


@contextlib.asynccontextmanager
async def _closing(chunks: AsyncIterator[Chunk]) -> AsyncIterator[None]:
    """Close an agent's chunk generator now, not at garbage collection (its processes die)."""
    try:
        yield
    finally:
        aclose = getattr(chunks, "aclose", None)
        # (a native generator that ran to its end has no frame: nothing to close, no scope)
        if aclose is not None and getattr(chunks, "ag_frame", True) is not None:
            with trio.move_on_after(10, shield=True):
                await aclose()


class RegistryWatcher(Protocol):
    """What the re-fence needs of a registry watcher: ``_inotify.Watcher``, or a fake one
    (``trio_agentd.testing.FakeWatcher``)."""

    def watch(self, path: Path) -> bool: ...

    async def wait(self) -> None: ...


def watched_refence(
    watcher: RegistryWatcher, registry: Path, timing: Timing,
    conns: Callable[[], Iterable[_Conn]], on_wake: Callable[[], None] = lambda: None,
) -> tuple[Callable[[str], None], Callable[[], Awaitable[None]]]:
    """``(watch_claims, wait_change)`` for a :class:`WorkerCore` that re-fences when the
    registry changes: an authenticated supervisor's record dir is watched, and the re-fence
    loop waits for a change, or ``refence_fallback`` at most (a change not reported).
    ``on_wake`` runs each time the loop wakes, once the watches are in place again."""

    def watch_claims(generation: str) -> None:
        watcher.watch(registry)
        watcher.watch(registry / f"{generation}.owner")
        on_wake()

    async def wait_change() -> None:
        with trio.move_on_after(timing.refence_fallback):
            await watcher.wait()
        # a record dir that was removed and made again needs its watch again
        for conn in conns():
            watcher.watch(registry / f"{conn.fence.claim.generation}.owner")
        on_wake()

    return watch_claims, wait_change


class CachedRecords:
    """The fence's owner-record reads, from memory while inotify reports no change.

    A command's fence check reads its supervisor's record (an open, a stat, a read): most of
    what a worker spends on a prompt beyond the journal's flush. With the registry watched the
    kernel says whether anything changed, for one ``poll`` with no timeout: while no event is
    pending and the re-fence loop has not woken since (it drains the events, watches a record
    dir made again, and wakes on the slow fallback poll anyway), the bytes read last are the
    bytes on disk. A pending event means a read from disk, uncached, until the loop has dealt
    with it. Only a few generations are remembered (a supervisor and its successor).
    """

    _KEEP = 4

    def __init__(self, read: Callable[[str], bytes | None], fd: int) -> None:
        import select

        self._read = read
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._cache: dict[str, bytes | None] = {}
        self.reads = 0  # reads that went to the file

    def invalidate(self) -> None:
        self._cache.clear()

    def __call__(self, generation: str) -> bytes | None:
        if self._poll.poll(0):
            self._cache.clear()  # something changed: read, and trust nothing until the loop ran
            self.reads += 1
            return self._read(generation)
        if generation in self._cache:
            return self._cache[generation]
        self.reads += 1
        raw = self._read(generation)
        if len(self._cache) >= self._KEEP:
            self._cache.clear()
        self._cache[generation] = raw
        return raw


def _registry_watcher(registry: Path, *, poll: bool) -> Any:
    """An inotify watcher on the registry, or None where there is none (then: polling)."""
    if poll:
        return None
    try:
        from ._inotify import Watcher

        watcher = Watcher()
    except OSError as exc:
        log.info("no inotify (%s): re-fencing by polling every 250 ms", exc)
        return None
    watcher.watch(registry)
    return watcher


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


def _boot_id() -> str:
    """This boot's id (Linux), or "" where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


# --- the process shell ---------------------------------------------------------------------


def _so_peercred_pid(stream: trio.abc.Stream) -> int | None:
    """The peer's pid; -1 (never a claimed pid) for a peer of another uid."""
    creds = peer_credentials(stream)
    if creds is None:
        return None
    pid, uid = creds
    return pid if uid == os.getuid() else -1


async def run_worker(
    config: WorkerConfig,
    timing: Timing = DEFAULT_TIMING,
    on_ready: Callable[[], None] = lambda: None,
    *,
    poll_refence: bool = False,
    log_limits: Limits | None = None,
) -> None:
    """The worker process's main: bind the private socket, serve until stopped or signalled."""
    from ._fs import read_bytes
    from ._trust import prove_socket_dir

    registry = Path(config.registry)
    agent = load_agent(config.agent, config.agent_path)
    watcher = _registry_watcher(registry, poll=poll_refence)

    def read_record(generation: str) -> bytes | None:
        return read_bytes(registry / f"{generation}.owner" / "owner.json")

    records = CachedRecords(read_record, watcher.fd) if watcher is not None else None
    watch_claims, wait_change = (
        watched_refence(watcher, registry, timing, lambda: core.conns,
                        on_wake=records.invalidate if records is not None else lambda: None)
        if watcher is not None else (None, None)
    )
    journal = Journal(Path(config.journal))
    transcript = Transcript(Path(config.session_dir), limits=log_limits or Limits())
    core = WorkerCore(
        session_id=config.session_id,
        agent=agent,
        token=config.token,
        supervisor_socket=config.supervisor_socket,
        read_record=records if records is not None else read_record,
        journal=journal,
        transcript=transcript,
        cwd=Path(config.cwd),
        timing=timing,
        peer_pid=_so_peercred_pid,
        watch_claims=watch_claims,
        wait_change=wait_change,
    )
    path = config.worker_socket
    prove_socket_dir(os.path.dirname(path))  # never bind where another user can listen
    sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(path)
    finally:
        os.umask(old_umask)
    sock.listen(128)
    bound_ino = os.stat(path).st_ino
    listener = trio.SocketListener(sock)
    on_ready()
    stopped_by: list[str] = []
    with _stop_signals_received() as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if signum not in WORKER_STOP_SIGNALS:
                        log.warning("signal %s: ignored (TERM, INT, HUP or QUIT stop a worker)",
                                    name)
                        continue
                    log.info("signal %s: stopping cleanly (turns in progress may finish)", name)
                    if not stopped_by:
                        stopped_by.append(name)
                    core.stop_requested.set()

            async def accept() -> None:
                # out of descriptors (or memory): back off and go on, as trio.serve_listeners
                # does; anything else is logged and the loop starts again (never a silent stop)
                from ._exhaustion import RateLimitedLog, accept_forever
                from .timing import LOG_RATE_INTERVAL, SERVICE_RESTART_DELAY

                rl = RateLimitedLog(log, LOG_RATE_INTERVAL, clock=trio.current_time)
                while True:
                    try:
                        await accept_forever(
                            listener, lambda s: nursery.start_soon(core.serve_connection, s),
                            rl=rl, what="worker",
                        )
                        return
                    except OSError as exc:
                        rl.error(("accept", exc.errno), "worker: accept failed: %s; starting"
                                 " again in %gs", exc, SERVICE_RESTART_DELAY)
                    await trio.sleep(SERVICE_RESTART_DELAY)

            nursery.start_soon(on_signal)
            nursery.start_soon(accept)
            await core.serve()
            if stopped_by:  # an operator's signal: a clean stop, which the supervisor is told
                await core.announce_stopped(f"stopped cleanly on signal {stopped_by[0]}")
            nursery.cancel_scope.cancel()
    transcript.event("worker_stopped", pid=os.getpid(),
                     **({"signal": stopped_by[0]} if stopped_by else {}))
    transcript.sync()
    transcript.close()
    try:
        if os.stat(path).st_ino == bound_ino:
            os.unlink(path)
    except OSError:
        pass
    journal.close()


# what a worker does on each signal it handles (docs/operations.md has the table): these stop it
# cleanly (exit 0, reported to its supervisor: a stop, not a crash), the others are logged and
# ignored. Anything else (KILL, SEGV, ...) ends it: a crash, respawned within the restart limit.
WORKER_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
WORKER_SIGNALS = (*sorted(WORKER_STOP_SIGNALS), signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)


@contextlib.contextmanager
def _stop_signals_received() -> Iterator[AsyncIterator[int]]:
    """The worker's signals, received while it serves; once it is leaving, the stop signals
    are ignored. Its supervisor TERMs a worker that said it stopped (to be sure it is gone),
    and a stop signal's default action would end it midway, before its ``atexit`` handlers
    and its flushed log: blocked before the receiver gives the default action back, then
    ignored (a pending one with it), the worker still leaves by its own exit. (It stays
    killable: its supervisor's SIGKILL follows after ``stop_grace``.)"""
    stop = set(WORKER_STOP_SIGNALS)
    try:
        with trio.open_signal_receiver(*WORKER_SIGNALS) as signals:
            try:
                yield signals
            finally:
                signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    finally:
        for signum in stop:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)


def main() -> None:
    """``python -m trio_agentd.worker``: config on stdin, then wait for the start gate."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s worker[%(process)d] %(levelname)s %(message)s",
    )
    from ._exhaustion import raise_nofile_limit

    raise_nofile_limit(log)  # soft to hard: a busy worker has the descriptors it may have
    config_line = sys.stdin.readline()
    if not config_line:
        sys.exit("trio-agentd worker: no config on stdin (workers are started by the supervisor)")
    config = WorkerConfig.from_json(config_line)
    gate = sys.stdin.readline().strip()
    if gate != "go":
        sys.exit(0)  # the supervisor died or gave up before opening the gate
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    with contextlib.suppress(OSError):
        os.chdir(config.cwd)
    os.umask(0o077)  # the worker's own files; agents' children get the umask they set
    from .timing import timing_from_env

    timing = timing_from_env()
    poll = os.environ.get("TRIO_AGENTD_REFENCE_POLL") == "1"
    log_limits = _rotating_log(Path(config.session_dir) / "worker.log")
    # no variable of the daemon's reaches an agent (the session's environment stays)
    for name in [k for k in os.environ if k.startswith("TRIO_AGENTD_")]:
        del os.environ[name]
    try:
        trio.run(functools.partial(run_worker, config, timing, _signal_ready, poll_refence=poll,
                                   log_limits=log_limits))
    except AgentLoadError as exc:
        # the whole traceback here, in worker.log; one line to the supervisor, which answers
        # the prompt with it and marks the session failed (never a restart loop)
        log.error("%s\n%s", exc.message, exc.traceback.rstrip() or "(no traceback)")
        where = os.path.join(config.session_dir, "worker.log")
        _signal_failed(f"{exc.message} (full traceback in {where})")
        sys.exit(1)
    except (AgentdError, _fs.UntrustedFile, OSError) as exc:
        # one line for the supervisor to pass on (it quotes the tail of this log)
        sys.exit(f"trio-agentd worker for session {config.session_id}: cannot start: {exc}")


# the most of an agent's load error the supervisor reads from a worker's stdout
FAILED_LINE_MAX = 4096


def _signal_failed(cause: str) -> None:
    """Tell the supervisor, instead of ``ready``, why the agent could not be loaded: one line,
    ``failed <JSON string>``, bounded."""
    if len(cause) > FAILED_LINE_MAX // 2:
        cause = cause[: FAILED_LINE_MAX // 2 - 1] + "…"
    with contextlib.suppress(OSError):
        os.write(1, b"failed " + json.dumps(cause).encode() + b"\n")


def _rotating_log(path: Path) -> Limits:
    """Log to ``worker.log`` (our stderr) through a size-bounded handler; stderr follows it to
    each new file, so what is written there directly stays bounded too. The limits (for the
    transcript too)."""
    from ._rotate import RotatingLog, limits_from_env

    try:
        limits = limits_from_env()
    except ValueError as exc:
        limits = Limits()
        log.warning("%s; using %d bytes x %d", exc, limits.max_bytes, limits.backups)
    try:
        handler = RotatingLog(path, limits, stdio=(2,))
    except (OSError, _fs.UntrustedFile) as exc:
        log.warning("worker.log: %s; logging to stderr without rotation", exc)
        return limits
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s worker[%(process)d] %(levelname)s %(message)s"))
    root.addHandler(handler)
    return limits


def _signal_ready() -> None:
    """Tell the supervisor (reading our stdout pipe) that the socket listens; then let go."""
    with contextlib.suppress(OSError):
        os.write(1, b"ready\n")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
