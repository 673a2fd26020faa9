"""The supervisor: one root nursery serving clients, owning workers, checking its claim.

Theory of operation
-------------------
Startup order is a contract: acquire the ownership record (conflict scan under the
registry guard), take the socket lease, prove the generation belongs to this home
(``generations/<g>/``), bind the socket, and only then listen — so any supervisor that answers a
hello has a record. Every command first calls ``Ownership.ensure_current`` (one file read; a
single-flight restore when a cleaner deleted the record). A self-check every
``self_check_interval`` does the same with no traffic, and re-binds the socket path if it was
unlinked or replaced. SIGTERM/SIGHUP/SIGQUIT stop the supervisor and leave workers running for
the next one to adopt; SIGINT (Ctrl-C on a foreground ``daemon``) and the ``shutdown`` op stop the
workers too.

Under a service manager (``_sdnotify``, ``_sdactivate``): READY/STATUS/STOPPING notifications,
watchdog pings from the self-check loop after a healthy check, and a listening socket taken
from the manager (socket activation) instead of bound — never unlinked by us then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_util import AsyncValue

from . import _fs
from ._errors import AgentdError, single_errors
from ._exhaustion import RateLimitedLog
from ._handle import StopBatch, WorkerHandle
from ._identity import own_start_id
from ._ownership import Phase
from ._paths import Layout, check_socket_path
from ._procops import ProcessWorkerOps
from ._protocol import APP_VERSION, CAPABILITIES, PROTOCOL_VERSION, Hello
from ._registry import Ownership, Registry
from ._sdactivate import InheritedListener
from ._sdnotify import Notifier
from ._supervisorloops import ServiceLoops
from ._supervisorops import Dispatcher
from ._supervisorsessions import SessionTable
from ._supervisorsocket import ClientListener, SupervisorSocket
from ._trust import make_private_dirs
from .timing import (
    DEFAULT_TIMING,
    IN_PROCESS_EXIT_MARGIN,
    LOG_RATE_INTERVAL,
    MAX_CLIENT_CONNECTIONS,
    MAX_SESSIONS,
    OWNERSHIP_RELEASE_TIMEOUT,
    Timing,
    shutdown_bound,
    shutdown_shield,
    workers_stop_bound,
)

log = logging.getLogger("trio_agentd.supervisor")



@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorConfig:
    """How to run a supervisor. Unset paths resolve as ``Layout.resolve`` says."""

    socket: str | None = None
    home: str | None = None
    registry: str | None = None
    self_heal: bool | None = None  # None: TRIO_AGENTD_SELF_HEAL (default on)
    timing: Timing = field(default_factory=lambda: DEFAULT_TIMING)
    admission_ticket: str | None = None
    stop_workers_on_exit: bool = False
    # caps: beyond them a connection or a new session gets ``resource_exhausted``
    max_clients: int = MAX_CLIENT_CONNECTIONS
    max_sessions: int = MAX_SESSIONS
    default_agent: str = "echo"  # of a new session prompted without an agent
    # start the worker fork template (and its spare worker) as the supervisor starts, not at
    # the first session's start: the daemon does; an embedded supervisor (open_supervisor)
    # starts it when a session first needs a worker
    prefork: bool = False

    def layout(self) -> Layout:
        return Layout.resolve(socket=self.socket, home=self.home, registry=self.registry)




def _self_heal_from_env() -> bool:
    return os.environ.get("TRIO_AGENTD_SELF_HEAL", "1").strip().lower() not in ("0", "false", "no")



class Supervisor:
    """The composition: the session table, the socket, the ops and the service loops, under
    one service nursery (workers, loops) and one clients nursery (connections).

    Args:
        worker_ops: builds the supervisor's :class:`ProcessWorkerOps` (default: real worker
            processes); ``trio_agentd.testing.FakeSupervisorOps`` runs fake ones.
        listener: where clients connect instead of the Unix socket (then no socket is bound,
            watched or rebound); ``trio_agentd.testing.MemoryListener`` hands out in-memory
            streams.
        inherited: the listening socket a service manager passed (socket activation), proven
            by ``_sdactivate.take_listener``: used instead of binding, never unlinked.
        notifier: tells a service manager READY/STATUS/STOPPING and pings its watchdog.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        worker_ops: Callable[[Supervisor], ProcessWorkerOps] | None = None,
        listener: ClientListener | None = None,
        inherited: InheritedListener | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.layout = config.layout()
        self.timing = config.timing
        self.generation = uuid.uuid4().hex
        self.registry = Registry(self.layout.registry)
        self.ownership = Ownership(
            self.registry,
            self.layout,
            generation=self.generation,
            app_version=APP_VERSION,
            protocol=PROTOCOL_VERSION,
            self_heal=_self_heal_from_env() if config.self_heal is None else config.self_heal,
            # a ticket is for this process alone: no successor or worker inherits it
            admission_ticket=config.admission_ticket
            or os.environ.pop("TRIO_AGENTD_ADMISSION_TICKET", None),
            timing=config.timing,
        )
        self.start_id = own_start_id()
        self.started_at = time.monotonic()
        self.ops = (ProcessWorkerOps(self.layout, self.ownership, self.timing)
                    if worker_ops is None else worker_ops(self))
        self.notifier = notifier or Notifier(None)
        # repeated causes (EMFILE on every accept, an unreadable owner record on every
        # self-check) are logged once per LOG_RATE_INTERVAL, with a count
        self.rl = RateLimitedLog(log, LOG_RATE_INTERVAL, clock=trio.current_time)
        self.table = SessionTable(layout=self.layout, timing=self.timing, ops=self.ops,
                                  default_agent=config.default_agent,
                                  max_sessions=config.max_sessions)
        self.sessions: dict[str, WorkerHandle] = self.table.sessions
        self.socket = SupervisorSocket(layout=self.layout, timing=self.timing,
                                       generation=self.generation, rl=self.rl,
                                       client_listener=listener, inherited=inherited)
        self.dispatcher = Dispatcher(self, max_clients=config.max_clients)
        self.loops = ServiceLoops(
            layout=self.layout, timing=self.timing, generation=self.generation,
            ownership=self.ownership, notifier=self.notifier, rl=self.rl, ops=self.ops,
            table=self.table, socket=self.socket, request_shutdown=self.request_shutdown,
            start_client=self._start_client,
        )
        self.shutdown_requested = trio.Event()
        self.stop_workers = config.stop_workers_on_exit
        self.restart_requested = False
        self.inflight: AsyncValue[int] = AsyncValue(0)  # commands in flight, all clients
        self.stopped = trio.Event()
        self._service: trio.Nursery | None = None
        self._clients: trio.Nursery | None = None

    @property
    def service_nursery(self) -> trio.Nursery:
        assert self._service is not None
        return self._service

    # lifecycle --------------------------------------------------------------------------
    async def serve(
        self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until shutdown. ``task_status.started(self)`` once the socket listens.

        Raises:
            AgentdError: ``already_running`` (naming the incumbent), ``shutting_down``,
                ``config`` or ``permission_denied`` for a bad socket dir.
        """
        L = self.layout
        check_socket_path(L.socket)
        check_socket_path(L.worker_socket("x"))
        make_private_dirs(L.socket_dir, private=True)
        for d in (L.state_dir, L.workers_dir, L.journal_dir, L.generations_dir):
            _fs.ensure_dir(d)
        await self.ownership.acquire()

        def started() -> None:  # once hellos are served
            task_status.started(self)

        try:
            await self._serve_owned(started)
        finally:
            with trio.move_on_after(OWNERSHIP_RELEASE_TIMEOUT, shield=True):
                await self.ownership.release()
            self.stopped.set()
        self.notifier.close()
        if self.restart_requested:
            self._spawn_successor()

    async def _serve_owned(self, started: Callable[[], None]) -> None:
        """Under the ownership record: the lease, the proof of home, the socket, the service."""
        self.socket.take_lease()
        try:
            (self.layout.generations_dir / self.generation).mkdir(mode=0o700, exist_ok=True)
            # read every descriptor before listening, and serve hellos as soon as we
            # listen: a client never meets a listener that sends no hello (it would
            # take a starting supervisor for a wedged one)
            self.table.load_descriptors()
            self.socket.listen()
            await self._run_service(started)
        finally:
            self.socket.close(unlink=True)
            self.socket.release_lease()

    async def _run_service(self, started: Callable[[], None]) -> None:
        """The service nursery (workers, loops) around the clients nursery; then the stop."""
        async with trio.open_nursery() as service:
            self._service = service
            self.ops.nursery = service
            self.table.bind_nursery(service)
            service.start_soon(self.ops.writer.run)
            if self.config.prefork:
                # the fork template starts now, beside everything else: the first
                # session's worker need not wait for it
                self.ops.start_template()
            self.ownership.bind_nursery(service)
            async with trio.open_nursery() as clients:
                self._clients = clients
                await self._serve_clients(service, clients, started)
            with trio.move_on_after(shutdown_shield(self.timing), shield=True):
                await self._stop(service)
            service.cancel_scope.cancel()

    async def _serve_clients(
        self, service: trio.Nursery, clients: trio.Nursery, started: Callable[[], None]
    ) -> None:
        """Start the loops, adopt the sessions found, serve until shutdown, then drain."""
        self.loops.start(service)
        await self.table.adopt_loaded()
        # "owner" once hellos are served: ps never mistakes a starting
        # supervisor (listening, no accept loop yet) for a wedged one
        await self.ownership.set_phase(Phase.OWNER)
        log.info(
            "supervisor generation %s pid %s listening on %s",
            self.generation, os.getpid(), self.layout.socket,
        )
        started()
        await self.notifier.ready(self.loops.status_text())
        await self.shutdown_requested.wait()
        await self.notifier.stopping(
            "stopping: " + ("stopping the workers" if self.stop_workers
                            else "workers left running for adoption"))
        # "stopping" before the listener closes: ps does not call it wedged
        with contextlib.suppress(AgentdError, OSError):
            await self.ownership.set_phase(Phase.STOPPING)
        # drain: no new connections; commands in flight finish (bounded)
        self.socket.close(unlink=True)
        with trio.move_on_after(self.timing.stop_grace):
            await self.inflight.wait_value(0)
        clients.cancel_scope.cancel()

    def _start_client(self, stream: trio.abc.Stream) -> None:
        assert self._clients is not None
        self.dispatcher.clients_open += 1  # counted here: a burst of accepts cannot overshoot
        self._clients.start_soon(self.dispatcher.serve_client, stream)

    def request_shutdown(self, *, stop_workers: bool, restart: bool = False) -> None:
        self.stop_workers = self.stop_workers or stop_workers
        self.restart_requested = self.restart_requested or (restart and not self.stop_workers)
        self.shutdown_requested.set()

    def _spawn_successor(self) -> None:
        """After a ``restart``: everything is released; start the replacement supervisor."""
        from ._autostart import spawn_daemon

        try:
            proc = spawn_daemon(self.layout)
        except OSError as exc:
            log.error("restart: could not start the new supervisor: %s", exc)
            return
        log.info("restart: started the new supervisor, pid %s", proc.pid)


    async def _stop(self, service: trio.Nursery) -> None:
        if self.ownership.record.phase is not Phase.STOPPING:  # (serve wrote it already)
            with contextlib.suppress(AgentdError, OSError):
                await self.ownership.set_phase(Phase.STOPPING)
        self.socket.close(unlink=True)
        if self.stop_workers:
            with trio.move_on_after(workers_stop_bound(self.timing)):
                # one batch: every intent in one commit, every worker told to stop before
                # any is waited for, one grace for them all
                batch = StopBatch(trio.current_time() + self.timing.stop_grace)
                done = [h.request_stop(graceful=True, batch=batch)
                        for h in self.sessions.values()]
                for event in done:
                    await event.wait()
        # every descriptor written so far is on disk before the next supervisor reads them
        await self.ops.durable()
        for h in self.sessions.values():
            h.cancel_scope.cancel()
        with contextlib.suppress(OSError):
            (self.layout.generations_dir / self.generation).rmdir()
        log.info("supervisor generation %s stopped (workers %s)", self.generation,
                 "stopped" if self.stop_workers else "left running for adoption")


    # clients --------------------------------------------------------------------------------
    def hello(self) -> Hello:
        return Hello(
            protocol=PROTOCOL_VERSION,
            app_version=APP_VERSION,
            generation=self.generation,
            pid=os.getpid(),
            start_id=self.start_id,
            socket=self.layout.socket,
            capabilities=CAPABILITIES,
            home=str(self.layout.home),
        )


    def status(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "pid": os.getpid(),
            "start_id": self.start_id,
            "socket": self.layout.socket,
            "home": str(self.layout.home),
            "state_dir": str(self.layout.state_dir),
            "app_version": APP_VERSION,
            "protocol": PROTOCOL_VERSION,
            "sessions": len(self.table.sessions),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "phase": str(self.ownership.record.phase),
            "restores": self.ownership.statistics().restores,
            # workers forked ahead of need, parked until a session's start takes one
            "spare_pids": [sp.pid for sp in fs.spares] if (fs := self.ops.forkserver) else [],
        }


@contextlib.asynccontextmanager
async def open_supervisor(config: SupervisorConfig | None = None) -> AsyncIterator[Supervisor]:
    """Run a supervisor inside a Trio program for the body of the ``async with``.

    On exit the supervisor stops (its workers too if ``config.stop_workers_on_exit``).

    Cancellation: cancelling the body stops the supervisor the same way; workers not stopped
    keep running and are adopted by the next supervisor on the socket.
    """
    sup = Supervisor(config or SupervisorConfig())
    with single_errors():
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            try:
                yield sup
            finally:
                sup.request_shutdown(stop_workers=sup.config.stop_workers_on_exit)
                bound = shutdown_bound(sup.timing) + IN_PROCESS_EXIT_MARGIN
                with trio.move_on_after(bound, shield=True):
                    await sup.stopped.wait()
