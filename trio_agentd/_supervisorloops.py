"""The supervisor's service loops: the self-check (ownership, state heal, socket rebind,
watchdog), the idle sweep, the upgrade sweep, signals — each kept running by ``keep_running``.

Theory of operation
-------------------
A service task never ends the daemon: an unexpected error is logged (rate-limited) and the
task starts again after ``SERVICE_RESTART_DELAY``. The self-check does with no traffic what
every command does (``Ownership.ensure_current``), makes again the state a cleaner deleted
under a live supervisor, and rebinds the socket path if it was unlinked or replaced; under a
service manager it pings the watchdog only after a healthy check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from . import _fs
from ._errors import AgentdError
from ._exhaustion import RateLimitedLog, exhaustion_text, is_exhaustion
from ._handle import WorkerHandle
from ._paths import Layout
from ._procops import ProcessWorkerOps
from ._protocol import APP_VERSION
from ._recovery import Mode, StopReason, idle_victims
from ._registry import Ownership
from ._sdnotify import Notifier, status_text
from ._session import write_meta
from ._supervisorsessions import SessionTable
from ._supervisorsocket import SupervisorSocket
from .timing import MIN_WAKE, SERVICE_RESTART_DELAY, Timing

log = logging.getLogger("trio_agentd.supervisor")

SUPERVISOR_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
SUPERVISOR_SIGNALS = (*sorted(SUPERVISOR_STOP_SIGNALS), signal.SIGUSR1, signal.SIGUSR2,
                      signal.SIGALRM)


class RequestShutdown(Protocol):
    def __call__(self, *, stop_workers: bool, restart: bool = False) -> None: ...


@dataclass(slots=True, kw_only=True)
class ServiceLoops:
    """The supervisor's periodic tasks, started in its service nursery by :meth:`start`.

    Attributes:
        request_shutdown: how a loop stops the supervisor (a revoked generation, a signal).
        start_client: where an accepted connection goes (also after a rebind).
    """

    layout: Layout
    timing: Timing
    generation: str
    ownership: Ownership
    notifier: Notifier
    rl: RateLimitedLog
    ops: ProcessWorkerOps
    table: SessionTable
    socket: SupervisorSocket
    request_shutdown: RequestShutdown
    start_client: Callable[[trio.abc.Stream], None]
    # mtime of sessions/ at the last heal check
    _sessions_stamp: int | None = field(default=None, init=False)
    # the dirs the heal check looks at, as strings (made once: the layout and generation never
    # change, and four checks a second need no pathlib objects)
    _heal_dirs: tuple[str, ...] = field(default=(), init=False)
    # sessions whose outdated worker is being replaced
    _replacing: set[str] = field(default_factory=set, init=False)

    def start(self, service: trio.Nursery) -> None:
        """Start every service task in ``service``: accept, signals, self-check, the sweeps."""
        # service tasks never end the daemon: an unexpected error is logged and the task
        # starts again (keep_running)
        listener = self.socket.client_listener
        if listener is None:
            self.start_accepting(service, self.socket.listen_sock)
        else:
            service.start_soon(self.keep_running, "accept", self.socket.accept_from, listener,
                               self.start_client)
        service.start_soon(self.keep_running, "signals", self.signals)
        service.start_soon(self.keep_running, "self-check", self.self_check_loop, service)
        service.start_soon(self.keep_running, "idle sweep", self.idle_sweep_loop)
        service.start_soon(self.keep_running, "upgrade sweep", self.upgrade_sweep_loop,
                           service)

    def start_accepting(
        self, service: trio.Nursery, sock: trio.socket.SocketType | None
    ) -> None:
        """Accept on ``sock`` (the bound socket, or the one a rebind made) until it closes."""
        service.start_soon(self.keep_running, "accept", self.socket.accept_loop, sock,
                                self.start_client)

    async def keep_running(
        self, name: str, fn: Callable[..., Awaitable[None]], *args: Any
    ) -> None:
        """Run a service task; if it raises, log it (rate-limited) and run it again.

        It ends when ``fn`` returns (its job is over) or when cancelled.
        """
        while True:
            try:
                await fn(*args)
                return
            except Exception as exc:
                exhausted = isinstance(exc, OSError) and is_exhaustion(exc)
                self.rl.error(
                    ("service", name, type(exc).__name__, str(exc)),
                    "%s failed: %s; starting it again in %gs", name,
                    exhaustion_text(exc.errno) if isinstance(exc, OSError) and exhausted
                    else repr(exc),
                    SERVICE_RESTART_DELAY, exc_info=not exhausted,
                )
            await trio.sleep(SERVICE_RESTART_DELAY)


    async def self_check_loop(self, service: trio.Nursery) -> None:
        last: str | None = None
        bind_error: str | None = None  # logged once per cause, not every tick
        # a watchdog shorter than the self-check interval needs checks as often as its pings
        period = self.notifier.check_period(self.timing.self_check_interval)
        while True:
            await trio.sleep(period)
            healthy = True
            try:
                # an owner record that cannot be read (EMFILE, EIO…) raises OwnershipUnknown:
                # logged (rate-limited) and checked again next tick, never "lost"
                await self.ownership.ensure_current()
                if last is not None:
                    self.rl.log(logging.INFO, ("self-check", None),
                                "self-check: ownership confirmed again")
                last = None
            except AgentdError as exc:
                self.rl.error(("self-check", exc.message), "self-check: %s", exc.message)
                last = exc.message
                healthy = False
            if self.ownership.revoked.is_set():
                log.error("generation %s was revoked; exiting (workers keep running)",
                          self.generation)
                self.request_shutdown(stop_workers=False)
                return
            self.heal_state()
            if self.socket.listen_sock is not None and not self.socket.intact():
                try:
                    self.start_accepting(service, self.socket.rebind())
                    bind_error = None
                except (OSError, AgentdError) as exc:
                    if str(exc) != bind_error:
                        log.error("could not bind %s again: %s", self.layout.socket, exc)
                    bind_error = str(exc)
                    healthy = False
            if self.notifier.enabled:
                # the watchdog ping only after a healthy check: a wedged supervisor (its loop
                # blocked, its record lost, its socket unbindable) stops pinging
                if healthy:
                    await self.notifier.healthy()
                await self.notifier.status(self.status_text())

    def status_text(self) -> str:
        running = sum(1 for h in self.table.sessions.values()
                      if h.mode.value not in (Mode.STOPPED, Mode.FAILED))
        return status_text(len(self.table.sessions), running)

    def heal_state(self) -> None:
        """Dirs a cleaner deleted under a live supervisor are made again and their files
        written again from memory: descriptors and tokens (the next supervisor adopts from
        them), this generation's proof of home, each session's metadata. One stat per dir per
        tick when nothing is missing; logged once per heal."""
        L = self.layout
        if not self._heal_dirs:
            self._heal_dirs = tuple(map(str, (
                L.state_dir, L.journal_dir, L.generations_dir / self.generation, L.workers_dir,
                L.sessions_dir)))
        state_dir, journal_dir, mine, workers_dir, sessions_dir = self._heal_dirs
        try:
            healed: list[str] = []
            for d in (state_dir, journal_dir, mine):
                if not os.path.isdir(d):
                    _fs.ensure_dir(d)
                    healed.append(d)
            if not os.path.isdir(workers_dir):
                _fs.ensure_dir(workers_dir)
                healed.append(workers_dir)
                for h in list(self.table.sessions.values()):
                    if h.token is not None:
                        _fs.atomic_write(L.token_path(h.session_id), h.token.encode())
                    self.ops.persist(h)
            # per-session dirs only when the sessions dir changed (a subdir removed changes
            # its mtime): no stat per session on every 250 ms tick
            try:
                stamp = os.stat(sessions_dir).st_mtime_ns
            except FileNotFoundError:
                stamp = None
            sessions = [] if stamp is not None and stamp == self._sessions_stamp else list(
                self.table.sessions.values())
            for h in sessions:
                if h.pid is None:
                    continue  # no worker started yet: its first start makes the dir
                session_dir = L.session_dir(h.session_id)
                if not session_dir.is_dir():
                    write_meta(session_dir, {
                        "session": h.session_id, "agent": h.agent, "cwd": h.cwd,
                        "created_at": h.created_at, "socket": L.socket,
                        **({"env": h.env} if h.env is not None else {})})
                    healed.append(str(session_dir))
        except (OSError, AgentdError) as exc:
            self.rl.error(("heal", str(exc)), "could not make the state dirs again: %s", exc)
            return
        with contextlib.suppress(OSError):
            self._sessions_stamp = os.stat(sessions_dir).st_mtime_ns  # after our own writes
        if healed:
            log.warning("state removed under the running supervisor; made again from memory:"
                        " %s", ", ".join(healed))

    async def idle_sweep_loop(self) -> None:
        """Stop the workers of idle sessions; transcripts and descriptors stay."""
        t = self.timing
        if t.idle_eviction <= 0:
            return
        while True:
            await trio.sleep(t.idle_sweep_period)
            # an idle supervisor heals too: the same check as every command
            with contextlib.suppress(AgentdError):
                await self.ownership.ensure_current()
            now = trio.current_time()
            victims = idle_victims(
                [(h.session_id, h.mode.value, h.idle_for(now))
                 for h in self.table.sessions.values()],
                now=now, idle_eviction=t.idle_eviction,
            )
            for sid in victims:
                h = self.table.sessions[sid]
                if h.stopping:
                    continue
                log.info("session %s idle for %.0fs: stopping its worker (evicted)",
                         sid, h.idle_for(now))
                # the worker declines it if a turn runs or waits (a direct route's prompt
                # may have reached it since its last notice): the session then stays ready
                h.request_stop(graceful=True, reason=StopReason.EVICT)

    async def upgrade_sweep_loop(self, service: trio.Nursery) -> None:
        """Replace each adopted worker of another version (or protocol) with one of this
        version once its session has been idle ``upgrade_idle`` (counted from the end of its
        last turn, or from the adoption). Until then it serves as before; a worker that has a
        turn running or queued declines, and is asked again once idle."""
        t = self.timing
        while True:
            now = trio.current_time()
            wake = t.upgrade_idle
            for h in list(self.table.sessions.values()):
                if not h.outdated or h.stopping or h.session_id in self._replacing:
                    continue
                idle = h.idle_for(now)
                if idle >= t.upgrade_idle:
                    self._replacing.add(h.session_id)
                    service.start_soon(self._replace_outdated, h)
                else:
                    wake = min(wake, t.upgrade_idle - idle)
            await trio.sleep(max(wake, MIN_WAKE))

    async def _replace_outdated(self, h: WorkerHandle) -> None:
        old_pid, old_version = h.pid, h.worker_version
        try:
            log.info("session %s: worker pid %s runs version %s (protocol %s) and the session"
                     " is idle: replacing it with a worker of version %s", h.session_id,
                     old_pid, old_version or "?", h.worker_protocol, APP_VERSION)
            if not await h.replace_worker():
                log.info("session %s: worker pid %s kept (a turn runs or another stop came);"
                         " asked again once the session is idle", h.session_id, old_pid)
                return
            with trio.move_on_after(self.timing.worker_connect_timeout):
                await h.mode.wait_value(lambda m: m not in (Mode.STOPPED, Mode.STARTING))
            log.info("session %s: worker pid %s (version %s) replaced by pid %s (version %s,"
                     " %s)", h.session_id, old_pid, old_version or "?", h.pid, h.worker_version,
                     h.mode.value)
        finally:
            self._replacing.discard(h.session_id)

    async def signals(self) -> None:
        """Every signal that would otherwise end the supervisor without a word is handled and
        logged (docs/operations.md has the table): INT (Ctrl-C on a foreground daemon) is a
        clean shutdown, workers stopped; TERM, HUP and QUIT stop it with workers left running,
        to be adopted by the next supervisor (a service manager's stop or restart); USR1, USR2
        and ALRM are ignored."""
        with trio.open_signal_receiver(*SUPERVISOR_SIGNALS) as sigs:
            async for signum in sigs:
                name = signal.Signals(signum).name
                if signum == signal.SIGINT:
                    log.info("signal %s: shutting down, stopping the workers", name)
                    self.request_shutdown(stop_workers=True)
                elif signum in SUPERVISOR_STOP_SIGNALS:
                    log.info("signal %s: stopping, workers left running", name)
                    self.request_shutdown(stop_workers=False)
                else:
                    log.warning("signal %s: ignored (TERM, INT, HUP or QUIT stop the"
                                " supervisor)", name)

    # sessions -------------------------------------------------------------------------------
