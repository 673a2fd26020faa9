"""Fake worker processes for the supervisor's recovery shell, all inside trio.

``FakeWorkerOps`` implements :class:`trio_agentd._handle.WorkerOps`: a "spawned" worker is a
real :class:`~trio_agentd._workercore.WorkerCore` served over in-memory streams, so links,
authentication, re-fence and journal-free dedup behave as in production, while every wait is
a trio wait that ``autojump_clock`` can skip exactly.
"""

from __future__ import annotations

import enum
import itertools
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio
import trio.testing

from .._errors import AgentdError, ErrorCode
from .._fence import Claim
from .._handle import WorkerHandle
from .._refence import watched_refence
from .._workerlink import WorkerLink, link_over_stream
from ..agents import Agent
from ..timing import DEFAULT_TIMING, Timing
from ._memory import MemoryRegistry, make_worker_core

if TYPE_CHECKING:
    from .._supervisor import Supervisor
    from ._fakesupops import FakeSupervisorOps

SUPERVISOR_GENERATION = "gen-1"
SUPERVISOR_PID = 1000
SUPERVISOR_SOCKET = "/run/s.sock"
SUPERVISOR_CLAIM = Claim(generation=SUPERVISOR_GENERATION, pid=SUPERVISOR_PID,
                         start_id="boot:1000", socket=SUPERVISOR_SOCKET)


class FakeWatcher:
    """A registry watcher (``_dnotify.DirNotify``'s shape) woken by the test, not the kernel:
    :meth:`changed` is a change the kernel reported. ``watched`` holds every path it was asked
    to watch."""

    def __init__(self) -> None:
        self.watched: set[Path] = set()
        self.wakeups = 0
        self._pending = False
        self._event = trio.Event()

    def watch(self, path: Path) -> bool:
        self.watched.add(Path(path))
        return True

    def pending(self) -> bool:
        return self._pending

    def changed(self) -> None:
        """Something in a watched dir changed (events queue until the next :meth:`wait`)."""
        self._pending = True
        self._event.set()

    async def wait(self) -> None:
        while not self._pending:
            await self._event.wait()
        self._pending = False
        self._event = trio.Event()
        self.wakeups += 1


class Behaviour(enum.Enum):
    """How one fake worker process behaves, for its whole life.

    ``FakeWorkerOps(behaviours=[...])`` gives the i-th spawn the i-th behaviour, and **the last
    one repeats**: ``[Behaviour.HUNG, Behaviour.ANSWERS]`` is a first worker that hangs and
    healthy ones after it. The timeouts named are fields of :class:`trio_agentd.timing.Timing`.
    """

    #: a healthy worker
    ANSWERS = "answers"
    #: alive, accepts nothing: every connect hangs until its timeout (the first one, after a
    #: spawn: ``worker_connect_timeout``; a reconnect: ``adopt_connect_timeout``)
    HUNG = "hung"
    #: alive, every connect is refused at once
    REFUSES = "refuses"
    #: healthy, but SIGTERM does nothing: a stop waits ``stop_grace``, then SIGKILL works
    IGNORES_TERM = "ignores-term"
    #: nothing kills it (each stop ends after ``kill_confirm_timeout`` unconfirmed)
    SURVIVES_KILL = "survives-kill"
    #: its spawn never reports ready: stopped after ``worker_connect_timeout``
    NEVER_READY = "never-ready"


@dataclass
class FakeProcess:
    """One fake worker process of a :class:`FakeWorkerOps` (``ops.processes[i]``: the i-th
    spawn). ``die()`` is ``kill -9``, ``cut()`` drops its connections, ``freeze()`` and
    ``thaw()`` are SIGSTOP and SIGCONT; ``signals`` lists what it was sent, ``received`` the
    ``(virtual time, op)`` of every request it read. These act at once, in your task: other
    tasks see the change when they next run (``await
    trio.testing.wait_all_tasks_blocked()`` before asserting on their reaction)."""

    pid: int
    behaviour: Behaviour
    alive: bool = True
    signals: list[int] = field(default_factory=list)
    scopes: list[trio.CancelScope] = field(default_factory=list)
    exited: trio.Event = field(default_factory=trio.Event)
    token: str = ""
    connections: list[trio.CancelScope] = field(default_factory=list)
    # SIGSTOP: set while stopped; its connections stay open but it reads and sends nothing
    frozen: bool = False
    thawed: trio.Event = field(default_factory=trio.Event)
    _behaviour_before: Behaviour | None = None
    received: list[tuple[float, str]] = field(default_factory=list)  # (time, op) it read
    watcher: FakeWatcher | None = None  # its registry watcher (``FakeWorkerOps(inotify=True)``)

    def freeze(self) -> None:
        """SIGSTOP (or an event loop that blocks): every connection stays open but nothing is
        read or answered, new connections hang, SIGTERM stays pending; SIGKILL still works."""
        if not self.frozen:
            self.frozen = True
            self.thawed = trio.Event()
            self._behaviour_before, self.behaviour = self.behaviour, Behaviour.HUNG

    def thaw(self) -> None:
        """SIGCONT: it goes on where it stopped."""
        if self.frozen:
            self.frozen = False
            self.thawed.set()
            if self._behaviour_before is not None:
                self.behaviour = self._behaviour_before

    async def running(self) -> None:
        """Return once the process is not stopped."""
        while self.frozen:
            await self.thawed.wait()

    def cut(self) -> None:
        """Break every connection to it; the process stays alive (a network-ish failure)."""
        for scope in self.connections:
            scope.cancel()
        self.connections.clear()

    def new_scope(self) -> trio.CancelScope:
        """A cancel scope for one of its tasks: cancelled when the process dies."""
        scope = trio.CancelScope()
        self.scopes.append(scope)
        if not self.alive:
            scope.cancel()
        return scope

    def die(self) -> None:
        """kill -9 from outside: every connection to it drops."""
        if self.alive:
            self.alive = False
            for scope in self.scopes:
                scope.cancel()
            self.exited.set()


class FakeWorkerOps:
    """The process layer of a session handle (:class:`~trio_agentd._handle.WorkerOps`), faked.

    Each "spawn" is a :class:`FakeProcess` whose worker is a real
    :class:`~trio_agentd._workercore.WorkerCore` served over in-memory streams, started on the
    first connect. Pass it to ``WorkerHandle(ops, session_id, agent, cwd)``; nothing is spawned
    until the handle's first command (``supervise_new``) or ``supervise(wanted=True)``.

    Attributes:
        processes: every spawn, in order (``processes[-1]`` is the current worker).
        events: ``(virtual time, "spawn PID" | "connect PID" | "signal SIGTERM PID" ...)``.
        admission: set True to hold the shutdown admission (respawns and stops defer).

    Args:
        nursery: where fake processes run (a test's nursery); they outlive the handle.
        behaviours: the :class:`Behaviour` of each successive spawn; **the last one repeats**
            (default: every spawn answers).
        timing: the workers' :class:`~trio_agentd.timing.Timing` (give the handle's).
        agent_factory: a new agent for each worker (default: the echo agent).
        registry_dir: the worker cores fence against the owner records in this real registry
            dir, and real process start ids (as a worker does), instead of ``self.registry``
            (a :class:`MemoryRegistry`).
        inotify: each worker re-fences when its :class:`FakeWatcher` wakes
            (:meth:`registry_changed`), else every ``refence_fallback``; without it, every
            ``refence_interval`` (a worker with no inotify).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        behaviours: list[Behaviour] | None = None,
        timing: Timing = DEFAULT_TIMING,
        agent_factory: Callable[[], Agent] | None = None,
        registry_dir: Path | None = None,
        inotify: bool = False,
    ) -> None:
        self.nursery = nursery
        self.timing = timing
        self.behaviours = list(behaviours or [Behaviour.ANSWERS])
        self.agent_factory = agent_factory
        self.processes: list[FakeProcess] = []
        self.by_pid: dict[int, FakeProcess] = {}
        self.admission = False
        self.events: list[tuple[float, str]] = []
        self.persisted: list[str] = []
        self._pids = itertools.count(2000)
        self.registry = MemoryRegistry()
        self.registry.add_owner(
            generation=SUPERVISOR_GENERATION, pid=SUPERVISOR_PID, socket=SUPERVISOR_SOCKET,
            start_id="boot:1000",
        )
        self.registry_dir = registry_dir
        self.inotify = inotify
        self.read_record: Callable[[str], bytes | None] = self.registry.read_record
        self.read_start_id: Callable[[int], str | None] = self.registry.read_start_id
        if registry_dir is not None:
            from .._fs import read_bytes
            from .._identity import read_start_id

            self.read_record = lambda g: read_bytes(registry_dir / f"{g}.owner" / "owner.json")
            self.read_start_id = read_start_id

    def registry_changed(self) -> None:
        """An inotify event in the registry: every live worker's watcher wakes."""
        for p in self.processes:
            if p.alive and p.watcher is not None:
                p.watcher.changed()

    def for_supervisor(self, sup: Supervisor) -> FakeSupervisorOps:
        """``Supervisor(config, worker_ops=ops.for_supervisor)``: the supervisor's worker ops
        with these fake processes (descriptors, tokens and session files stay real)."""
        from ._fakesupops import FakeSupervisorOps

        return FakeSupervisorOps(sup, self)

    def _event(self, what: str) -> None:
        self.events.append((trio.current_time(), what))

    # WorkerOps ------------------------------------------------------------------------------
    def alive(self, h: WorkerHandle) -> bool:
        p = self.by_pid.get(h.pid or -1)
        return p is not None and p.alive

    def serving(self, h: WorkerHandle) -> bool:
        return self.alive(h)  # a fake process dies at once: nothing is ever pending

    def admission_held(self) -> bool:
        return self.admission

    def persist(self, h: WorkerHandle) -> None:
        self.persisted.append(str(h.mode.value))

    async def durable(self) -> None:
        await trio.lowlevel.checkpoint()

    def signal(self, h: WorkerHandle, sig: int) -> bool:
        p = self.by_pid.get(h.pid or -1)
        if p is None or not p.alive:
            return False
        p.signals.append(sig)
        self._event(f"signal {signal.Signals(sig).name} {p.pid}")
        if p.behaviour is Behaviour.SURVIVES_KILL:
            return True
        if p.frozen and sig != signal.SIGKILL:
            return True  # pending until SIGCONT
        if sig == signal.SIGKILL or p.behaviour is not Behaviour.IGNORES_TERM:
            p.die()
        return True

    async def wait_exit(self, h: WorkerHandle) -> None:
        p = self.by_pid.get(h.pid or -1)
        if p is not None:
            await p.exited.wait()

    async def spawn(self, h: WorkerHandle) -> None:
        await self.start_process(h)

    async def start_process(
        self, h: WorkerHandle, *, started: Callable[[], None] | None = None
    ) -> None:
        """A spawn; ``started`` runs once the process exists (pid, start id and token set),
        before it becomes ready (or never does)."""
        index = min(len(self.processes), len(self.behaviours) - 1)
        behaviour = self.behaviours[index]
        p = FakeProcess(pid=next(self._pids), behaviour=behaviour)
        p.token = f"token-{p.pid}"
        self.processes.append(p)
        self.by_pid[p.pid] = p
        h.pid, h.start_id, h.token = p.pid, f"boot:{p.pid}", p.token
        self._event(f"spawn {p.pid}")
        if started is not None:
            started()
        if behaviour is Behaviour.NEVER_READY:
            await trio.sleep_forever()

    async def connect(self, h: WorkerHandle, *, claim: Claim = SUPERVISOR_CLAIM) -> WorkerLink:
        """Connect as the supervisor of ``claim`` (its worker checks it against the registry
        the worker reads)."""
        p = self.by_pid.get(h.pid or -1)
        self._event(f"connect {h.pid}")
        if p is None or not p.alive:
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, "connection refused (no process)")
        if p.behaviour is Behaviour.HUNG:
            await trio.sleep_forever()
        if p.behaviour is Behaviour.REFUSES:
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, "connection refused")
        core = getattr(p, "core", None)
        if core is None:
            refence: tuple[Callable[[str], None] | None, Callable[[], Awaitable[None]] | None]
            refence = (None, None)
            if self.inotify:
                p.watcher = FakeWatcher()
                refence = watched_refence(
                    p.watcher, self.registry_dir or Path("/registry"), self.timing,
                    lambda: p.core.conns,  # type: ignore[attr-defined]
                )
            core = make_worker_core(
                self.registry, supervisor_socket=claim.socket, session_id=h.session_id,
                token=p.token, timing=self.timing, read_record=self.read_record,
                read_start_id=self.read_start_id, watch_claims=refence[0],
                wait_change=refence[1],
                agent=None if self.agent_factory is None else self.agent_factory(),
            )
            p.core = core  # type: ignore[attr-defined]

            async def run_process() -> None:
                with p.new_scope():
                    await core.serve()
                p.die()

            self.nursery.start_soon(run_process)
        client, server = trio.testing.memory_stream_pair()

        conn_scope = trio.CancelScope()
        p.connections.append(conn_scope)

        async def serve_conn() -> None:
            with p.new_scope(), conn_scope:
                await core.serve_connection(_ProcessStream(server, p))
            await server.aclose()
            await client.aclose()

        self.nursery.start_soon(serve_conn)
        return await link_over_stream(
            client, token=p.token, generation=claim.generation, pid=claim.pid,
            start_id=claim.start_id, socket=claim.socket,
        )


class _ProcessStream(trio.abc.Stream):
    """The worker's end of a connection: reads and sends nothing while its process is
    stopped (:meth:`FakeProcess.freeze`), and notes the op of every request it reads."""

    def __init__(self, inner: trio.abc.Stream, process: FakeProcess) -> None:
        self.inner = inner
        self.process = process

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.process.running()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        await self.process.running()
        data = await self.inner.receive_some(max_bytes)
        await self.process.running()  # stopped while it waited: it reads this when continued
        for line in bytes(data).splitlines():
            op = _op_of(line)
            if op is not None:
                self.process.received.append((trio.current_time(), op))
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


def _op_of(line: bytes) -> str | None:
    import json

    try:
        msg = json.loads(line)
    except ValueError:
        return None
    op = msg.get("op") if isinstance(msg, dict) and msg.get("type") == "request" else None
    return op if isinstance(op, str) else None
