"""The whole supervisor on MockClock: fake worker processes, clients over in-memory streams.

``Supervisor(config, worker_ops=machine.for_supervisor, listener=MemoryListener())`` runs the
real supervisor — startup, ownership record, self-check, idle sweep, every op, the shutdown
drain — with these two seams swapped:

- :class:`FakeSupervisorOps` — the process layer (spawn, connect, signals, exits) is a
  :class:`~trio_agentd.testing.FakeWorkerOps` "machine" whose processes outlive the supervisor
  (a successor adopts them); descriptors, tokens and session files are the real ones, written
  under the config's (temporary) dirs.
- :class:`MemoryListener` — clients connect over ``trio.testing.memory_stream_pair``;
  :class:`MemoryClient` speaks the protocol over such a stream.

Everything the supervisor's loops wait on is then a trio wait; its files are read and written
synchronously (no thread), so ``autojump_clock`` skips exactly to each deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
import trio.testing

from .. import _fs
from .._errors import AgentdError, ErrorCode
from .._fence import Claim
from .._groupwrite import GroupWriter
from .._handle import WorkerHandle
from .._procops import ProcessWorkerOps
from .._protocol import Event, Hello, Request, Response
from .._recovery import Mode
from .._session import read_meta, write_meta
from .._stream import MessageStream
from .._workerlink import WorkerLink
from ..timing import TEST_VIRTUAL_TIME_LIMIT
from ._daemon import fits_socket_dir
from ._fakeops import Behaviour, FakeWorkerOps

if TYPE_CHECKING:
    from .._supervisor import Supervisor
    from ..agents import Agent
    from ..timing import Timing


class FakeSupervisorOps(ProcessWorkerOps):
    """A supervisor's :class:`ProcessWorkerOps` whose processes are ``machine``'s fakes.

    Built by :meth:`FakeWorkerOps.for_supervisor`. A spawn writes the session's metadata, its
    token and its descriptor (``starting``, before the worker is ready) as a real one does; a
    connect authenticates with the supervisor's own claim, which the fake worker checks against
    the registry it reads (``FakeWorkerOps(registry_dir=...)``: the supervisor's real one).
    """

    def __init__(self, sup: Supervisor, machine: FakeWorkerOps) -> None:
        super().__init__(sup.layout, sup.ownership, sup.timing)
        self.machine = machine
        self.writer = GroupWriter(threaded=False)  # a thread would let virtual time jump

    def start_template(self) -> None:
        """No fork template: the processes are fakes."""

    def claim(self) -> Claim:
        own = self.ownership.record
        return Claim(generation=own.generation, pid=own.pid, start_id=own.start_id,
                     socket=self.layout.socket)

    def alive(self, h: WorkerHandle) -> bool:
        return self.machine.alive(h)

    def signal(self, h: WorkerHandle, sig: int) -> bool:
        return self.machine.signal(h, sig)

    async def wait_exit(self, h: WorkerHandle) -> None:
        await self.machine.wait_exit(h)

    async def connect(self, h: WorkerHandle) -> WorkerLink:
        link = await self.machine.connect(h, claim=self.claim())
        self.exhausted.pop(h.session_id, None)
        return link

    async def spawn(self, h: WorkerHandle) -> None:
        self.exhausted.pop(h.session_id, None)
        L = self.layout
        session_dir = L.session_dir(h.session_id)
        if read_meta(session_dir) is None:
            write_meta(session_dir, {"session": h.session_id, "agent": h.agent, "cwd": h.cwd,
                                     "created_at": h.created_at, "socket": L.socket,
                                     "env": h.env or {}})

        def started() -> None:
            assert h.token is not None
            _fs.atomic_write(L.token_path(h.session_id), h.token.encode(), mode=0o600)
            self.persist(h, lifecycle=Mode.STARTING)  # on disk before the worker works

        await self.machine.start_process(h, started=started)


class MemoryListener:
    """The supervisor's listener over in-memory streams (``Supervisor(listener=...)``).

    :meth:`connect` returns the client's end once the supervisor accepted it; after
    :meth:`close` (the supervisor's drain) it raises ``ConnectionRefusedError`` at once, as a
    removed Unix socket would.
    """

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[trio.abc.Stream](0)
        self.accepted = 0
        self.closed_at: float | None = None

    async def accept(self) -> trio.abc.Stream:
        stream = await self._receive.receive()
        self.accepted += 1
        return stream

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = trio.current_time()
        self._receive.close()

    async def connect(self) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        try:
            await self._send.send(server)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ConnectionRefusedError(
                errno.ECONNREFUSED, "connection refused (the supervisor closed its listener)"
            ) from None
        return client


class MemoryClient:
    """One client connection to a supervisor over a :class:`MemoryListener`: the hello, then
    one request at a time (open more clients for concurrent requests).

    ``events`` collects the events of the requests it sent (chunks of a streamed prompt)."""

    _ids = itertools.count(1)

    def __init__(self, ms: MessageStream, hello: Hello, client_id: str) -> None:
        self.ms = ms
        self.hello = hello
        self.client_id = client_id
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, listener: MemoryListener, *, client_id: str = "test") -> MemoryClient:
        ms = MessageStream(await listener.connect())
        hello = await ms.receive()
        if not isinstance(hello, Hello):
            await ms.aclose()
            raise AgentdError(ErrorCode.INTERNAL, f"expected a hello, got {hello!r}")
        return cls(ms, hello, client_id)

    async def request(
        self, op: str, args: dict[str, Any] | None = None, *, request_id: int | None = None
    ) -> Response:
        """Send one request and return its response.

        Raises:
            trio.EndOfChannel: the supervisor closed the connection before answering.
        """
        rid = next(self._ids) if request_id is None else request_id
        await self.ms.send(Request(id=rid, op=op, client_id=self.client_id, args=args or {}))
        while True:
            msg = await self.ms.receive()
            if msg is None:
                raise trio.EndOfChannel(f"the supervisor closed the connection ({op})")
            if isinstance(msg, Event) and msg.id == rid:
                self.events.append(msg.event)
            elif isinstance(msg, Response) and msg.id == rid:
                return msg

    async def aclose(self) -> None:
        await self.ms.aclose()


@dataclasses.dataclass
class FakeSupervisor:
    """A real :class:`~trio_agentd.Supervisor` on fake workers, with in-memory clients.

    Made by :func:`open_fake_supervisor` (or the ``agentd_fake_supervisor`` fixture). The
    supervisor is serving when you get it (at virtual time 0 on a fresh MockClock); it starts
    no worker until a prompt names a session.

    Attributes:
        sup: the supervisor (``sup.timing``, ``sup.layout``, ``sup.request_shutdown`` ...).
        machine: its fake processes: ``machine.processes`` in spawn order, ``machine.events``
            the log of ``(virtual time, "spawn PID" | "connect PID" | "signal SIGTERM PID")``.
        listener: where :meth:`client` connects (no socket is bound).
        nursery: the nursery the supervisor and the fake processes run in.
    """

    sup: Supervisor
    machine: FakeWorkerOps
    listener: MemoryListener
    nursery: trio.Nursery

    @property
    def timing(self) -> Timing:
        """The supervisor's :class:`~trio_agentd.timing.Timing` (assert times from it)."""
        return self.sup.timing

    async def client(self, client_id: str = "test") -> MemoryClient:
        """A new client connection (the caller closes it: ``await client.aclose()``)."""
        return await MemoryClient.connect(self.listener, client_id=client_id)

    async def request(self, op: str, args: dict[str, Any] | None = None, *,
                      client_id: str = "test") -> Response:
        """One request on a connection of its own: ``await fake.request("sessions")``."""
        c = await self.client(client_id)
        try:
            return await c.request(op, args)
        finally:
            await c.aclose()

    async def prompt(self, text: str, *, session: str = "s1", client_id: str = "test"
                     ) -> Response:
        """A prompt to ``session`` (created, and its worker spawned, on its first prompt)."""
        return await self.request("prompt", {"session": session, "text": text},
                                  client_id=client_id)


async def _fail_after_virtual(limit: float) -> None:
    await trio.sleep(limit)
    raise AssertionError(
        f"the test still runs at {limit:g}s of trio time (open_fake_supervisor's time_limit)"
    )


@contextlib.asynccontextmanager
async def open_fake_supervisor(
    state_dir: Path,
    *,
    behaviours: list[Behaviour] | None = None,
    timing: Timing | None = None,
    agent_factory: Callable[[], Agent] | None = None,
    self_heal: bool = True,
    time_limit: float | None = TEST_VIRTUAL_TIME_LIMIT,
) -> AsyncIterator[FakeSupervisor]:
    """Run a real supervisor on fake workers inside this test's trio run.

    Its home and registry are real dirs under ``state_dir`` (a test's ``tmp_path``): its owner
    record, descriptors, tokens and session files are written there synchronously, so with
    ``autojump_clock`` every wait is a trio wait and each step lands at an exact virtual time.
    The workers are :class:`FakeWorkerOps` processes (real ``WorkerCore``s over memory
    streams) that authenticate its real claim and re-fence against its real registry on
    inotify-like events (``machine.registry_changed()``) or every ``refence_fallback``.

    Args:
        behaviours: each successive spawn's :class:`Behaviour` (the last one repeats;
            default: every worker answers).
        timing: the supervisor's and the fake workers' schedule (default
            :data:`~trio_agentd.timing.DEFAULT_TIMING`).
        agent_factory: a new agent for each fake worker (default: the echo agent).
        self_heal: the supervisor restores its deleted files (``TRIO_AGENTD_SELF_HEAL``).
        time_limit: fail the test with ``AssertionError`` once this much trio time has passed
            (the supervisor takes SIGALRM for itself, so pytest-timeout cannot stop a test that
            waits for ever; on MockClock this is virtual time); ``None``: no limit.

    At exit the supervisor shuts down leaving the fake workers running (as a real one leaves
    its workers to a successor), then everything in the nursery is cancelled.
    """
    from .._supervisor import Supervisor, SupervisorConfig
    from ..timing import DEFAULT_TIMING

    timing = timing or DEFAULT_TIMING
    with contextlib.ExitStack() as stack:
        run_dir = Path(state_dir)
        if not fits_socket_dir(run_dir):  # the socket is never bound, but its path is checked
            run_dir = Path(tempfile.mkdtemp(prefix="ta-fake-", dir="/tmp"))
            stack.callback(shutil.rmtree, run_dir, True)
        config = SupervisorConfig(
            socket=str(run_dir / "s" / "d.sock"), home=str(Path(state_dir) / "home"),
            registry=str(Path(state_dir) / "registry"), self_heal=self_heal, timing=timing,
        )
        async with trio.open_nursery() as nursery:
            if time_limit is not None:
                nursery.start_soon(_fail_after_virtual, time_limit)
            machine = FakeWorkerOps(nursery, behaviours=behaviours, timing=timing,
                                    agent_factory=agent_factory,
                                    registry_dir=config.layout().registry, inotify=True)
            listener = MemoryListener()
            sup = Supervisor(config, worker_ops=machine.for_supervisor, listener=listener)
            await nursery.start(sup.serve)
            yield FakeSupervisor(sup, machine, listener, nursery)
            if not sup.stopped.is_set():
                sup.request_shutdown(stop_workers=False)
                await sup.stopped.wait()
            nursery.cancel_scope.cancel()
