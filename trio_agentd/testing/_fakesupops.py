"""A supervisor's process layer on fake workers: :class:`FakeSupervisorOps`.

The supervisor's real :class:`~trio_agentd._procops.ProcessWorkerOps` (descriptors, tokens and
session files written for real) with the processes swapped for a
:class:`~trio_agentd.testing.FakeWorkerOps` machine's. Its own module so the machine can build
one (:meth:`FakeWorkerOps.for_supervisor`), and it names what it needs of the machine
(:class:`Machine`) instead of importing it: the arrows between the fakes point one way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .. import _fs
from .._fence import Claim
from .._groupwrite import GroupWriter
from .._handle import WorkerHandle
from .._procops import ProcessWorkerOps
from .._recovery import Mode
from .._session import read_meta, write_meta
from .._workerlink import WorkerLink

if TYPE_CHECKING:
    from .._supervisor import Supervisor


class Machine(Protocol):
    """What a supervisor's process layer needs of the fake machine (``FakeWorkerOps``): named
    here, so this module does not import the machine that imports it."""

    def alive(self, h: WorkerHandle) -> bool: ...

    def serving(self, h: WorkerHandle) -> bool: ...

    def signal(self, h: WorkerHandle, sig: int) -> bool: ...

    async def wait_exit(self, h: WorkerHandle) -> None: ...

    async def connect(self, h: WorkerHandle, *, claim: Claim = ...) -> WorkerLink: ...

    async def start_process(
        self, h: WorkerHandle, *, started: Callable[[], None] | None = None
    ) -> None: ...


class FakeSupervisorOps(ProcessWorkerOps):
    """A supervisor's :class:`ProcessWorkerOps` whose processes are ``machine``'s fakes.

    Built by :meth:`FakeWorkerOps.for_supervisor`. A spawn writes the session's metadata, its
    token and its descriptor (``starting``, before the worker is ready) as a real one does; a
    connect authenticates with the supervisor's own claim, which the fake worker checks against
    the registry it reads (``FakeWorkerOps(registry_dir=...)``: the supervisor's real one).
    """

    def __init__(self, sup: Supervisor, machine: Machine) -> None:
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

    def serving(self, h: WorkerHandle) -> bool:
        return self.machine.serving(h)

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
