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
import errno
import functools
import json
import logging
import os
import signal
import socket as _socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from trio_util import AsyncValue

from . import _fs
from ._errors import AgentdError, ErrorCode, single_errors
from ._exhaustion import (
    RateLimitedLog,
    accept_forever,
    exhaustion_error,
    exhaustion_text,
    is_exhaustion,
)
from ._grant import make_grant
from ._handle import SessionRetired, StopBatch, WorkerHandle
from ._identity import is_alive, own_start_id, peer_credentials
from ._ownership import Phase
from ._paths import Layout, check_socket_path
from ._procops import ProcessWorkerOps
from ._protocol import (
    APP_VERSION,
    CAPABILITIES,
    MAX_IN_FLIGHT,
    OPS,
    PROTOCOL_VERSION,
    FrameTooLarge,
    Hello,
    Request,
    RequestId,
    decode,
    encode,
    fail,
    ok,
    request_id_of,
)
from ._protocol import Event as EventMsg
from ._recovery import Mode, StopReason, idle_victims
from ._registry import Ownership, Registry
from ._sdactivate import InheritedListener
from ._sdnotify import Notifier, status_text
from ._session import check_session_id, read_meta, write_meta
from ._stream import MessageStream
from ._trust import agent_environment, make_private_dirs, prove_socket_dir
from ._wirestr import shown as shown_path
from ._workerlink import WorkerDropped
from .agents._base import validate_agent_spec
from .timing import (
    DEFAULT_TIMING,
    IN_PROCESS_EXIT_MARGIN,
    LINK_CLOSE_TIMEOUT,
    LOG_RATE_INTERVAL,
    MAX_CLIENT_CONNECTIONS,
    MAX_SESSIONS,
    MIN_WAKE,
    OWNERSHIP_RELEASE_TIMEOUT,
    SERVICE_RESTART_DELAY,
    Timing,
    kill_answer_bound,
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


SUPERVISOR_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
SUPERVISOR_SIGNALS = (*sorted(SUPERVISOR_STOP_SIGNALS), signal.SIGUSR1, signal.SIGUSR2,
                      signal.SIGALRM)


class ClientListener(Protocol):
    """Where client connections come from when it is not the supervisor's Unix socket: an
    in-memory listener (``trio_agentd.testing.MemoryListener``) runs the whole supervisor on
    MockClock. ``close`` ends a pending ``accept`` with ``trio.ClosedResourceError``."""

    async def accept(self) -> trio.abc.Stream: ...

    def close(self) -> None: ...


def _self_heal_from_env() -> bool:
    return os.environ.get("TRIO_AGENTD_SELF_HEAL", "1").strip().lower() not in ("0", "false", "no")


class Supervisor:
    """Args:
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
        self._client_listener = listener
        self._inherited = inherited
        self._bound_by_us = False  # an inherited socket is the manager's: never unlinked
        self.notifier = notifier or Notifier(None)
        self.sessions: dict[str, WorkerHandle] = {}
        # sessions killed in this supervisor's life and not made anew since: a resent command
        # of theirs is answered session_killed, not run in a new session
        self.killed: set[str] = set()
        self._sessions_stamp: int | None = None  # mtime of sessions/ at the last heal check
        self._loaded: list[tuple[WorkerHandle, bool, Mode]] = []
        # sessions being removed (`trio-agentd rm`): a command for one waits until it is gone,
        # then makes it anew
        self._removing: dict[str, trio.Event] = {}
        self.shutdown_requested = trio.Event()
        self.stop_workers = config.stop_workers_on_exit
        self.restart_requested = False
        self.inflight: AsyncValue[int] = AsyncValue(0)  # commands in flight, all clients
        self.stopped = trio.Event()
        self._lease_fd: int | None = None
        self._listen_sock: trio.socket.SocketType | None = None
        self._bound_ino: int | None = None
        self._service: trio.Nursery | None = None
        self._clients: trio.Nursery | None = None
        self.clients_open = 0  # client connections being served now
        # repeated causes (EMFILE on every accept, an unreadable owner record on every
        # self-check) are logged once per LOG_RATE_INTERVAL, with a count
        self.rl = RateLimitedLog(log, LOG_RATE_INTERVAL, clock=trio.current_time)
        self._replacing: set[str] = set()  # sessions whose outdated worker is being replaced

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
        try:
            self._take_lease()
            try:
                (L.generations_dir / self.generation).mkdir(mode=0o700, exist_ok=True)
                # read every descriptor before listening, and serve hellos as soon as we
                # listen: a client never meets a listener that sends no hello (it would
                # take a starting supervisor for a wedged one)
                self._load_descriptors()
                if self._client_listener is None:
                    if self._inherited is not None:
                        self._take_inherited(self._inherited)
                    else:
                        self._bind()
                async with trio.open_nursery() as service:
                    self._service = service
                    self.ops.nursery = service
                    service.start_soon(self.ops.writer.run)
                    if self.config.prefork:
                        # the fork template starts now, beside everything else: the first
                        # session's worker need not wait for it
                        self.ops.start_template()
                    self.ownership.bind_nursery(service)
                    async with trio.open_nursery() as clients:
                        self._clients = clients
                        # service tasks never end the daemon: an unexpected error is
                        # logged and the task starts again (_keep_running)
                        if self._client_listener is None:
                            service.start_soon(self._keep_running, "accept", self._accept_loop,
                                               self._listen_sock)
                        else:
                            service.start_soon(self._keep_running, "accept",
                                               self._accept_from, self._client_listener)
                        service.start_soon(self._keep_running, "signals", self._signals)
                        service.start_soon(self._keep_running, "self-check",
                                           self._self_check_loop)
                        service.start_soon(self._keep_running, "idle sweep",
                                           self._idle_sweep_loop)
                        service.start_soon(self._keep_running, "upgrade sweep",
                                           self._upgrade_sweep_loop)
                        # adoption: every descriptor's session at once, in this one nursery
                        # (commands for a session wait until it is ready)
                        for h, alive, lifecycle in self._loaded:
                            await self._supervise(h, alive=alive, lifecycle=lifecycle)
                        self._loaded.clear()
                        # "owner" once hellos are served: ps never mistakes a starting
                        # supervisor (listening, no accept loop yet) for a wedged one
                        await self.ownership.set_phase(Phase.OWNER)
                        log.info(
                            "supervisor generation %s pid %s listening on %s",
                            self.generation, os.getpid(), L.socket,
                        )
                        task_status.started(self)
                        await self.notifier.ready(self._status_text())
                        await self.shutdown_requested.wait()
                        await self.notifier.stopping(
                            "stopping: " + ("stopping the workers" if self.stop_workers
                                            else "workers left running for adoption"))
                        # "stopping" before the listener closes: ps does not call it wedged
                        with contextlib.suppress(AgentdError, OSError):
                            await self.ownership.set_phase(Phase.STOPPING)
                        # drain: no new connections; commands in flight finish (bounded)
                        self._close_listener(unlink=True)
                        with trio.move_on_after(self.timing.stop_grace):
                            await self.inflight.wait_value(0)
                        clients.cancel_scope.cancel()
                    with trio.move_on_after(shutdown_shield(self.timing), shield=True):
                        await self._stop(service)
                    service.cancel_scope.cancel()
            finally:
                self._close_listener(unlink=True)
                self._release_lease()
        finally:
            with trio.move_on_after(OWNERSHIP_RELEASE_TIMEOUT, shield=True):
                await self.ownership.release()
            self.stopped.set()
        self.notifier.close()
        if self.restart_requested:
            self._spawn_successor()

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
        self._close_listener(unlink=True)
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

    def _take_lease(self) -> None:
        path = self.layout.lease_path
        fd = _fs.try_lock(path)
        if fd is None:
            holder: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
                holder = json.loads(f.read() or b"{}")
            raise AgentdError(
                ErrorCode.ALREADY_RUNNING,
                f"socket lease {path} is held by supervisor pid {holder.get('pid', '?')},"
                f" generation {holder.get('generation', '?')} — use it, or stop it with"
                " `trio-agentd shutdown`",
                {"pid": holder.get("pid"), "generation": holder.get("generation")},
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "generation": self.generation}).encode(), 0)
        self._lease_fd = fd

    def _release_lease(self) -> None:
        if self._lease_fd is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.layout.lease_path).st_ino == os.fstat(self._lease_fd).st_ino:
                    os.unlink(self.layout.lease_path)
            _fs.unlock(self._lease_fd)
            self._lease_fd = None

    # the listening socket ----------------------------------------------------------------
    def _bind(self) -> None:
        path = self.layout.socket
        # before every bind and rebind: the dir may have been deleted and made again by
        # someone else since we started
        prove_socket_dir(self.layout.socket_dir)
        if os.path.lexists(path):
            probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            probe.settimeout(self.timing.connect_timeout)
            try:
                probe.connect(path)
            except OSError as exc:
                if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                raise AgentdError(
                    ErrorCode.ALREADY_RUNNING,
                    f"something outside our lease is listening on {path} — stop it first",
                )
            finally:
                probe.close()
        raw = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            raw.bind(path)  # socket file mode 0600
        except BaseException:
            raw.close()
            raise
        finally:
            os.umask(old)
        raw.listen(128)
        self._listen_sock = trio.socket.from_stdlib_socket(raw)
        self._bound_ino = os.stat(path).st_ino
        self._bound_by_us = True

    def _take_inherited(self, inherited: InheritedListener) -> None:
        """Listen on the socket the service manager bound (proven ours already)."""
        self._listen_sock = trio.socket.from_stdlib_socket(inherited.sock)
        self._bound_ino = inherited.ino
        self._bound_by_us = False
        log.info("listening on %s, a socket passed by the service manager (socket"
                 " activation)", self.layout.socket)

    def _close_listener(self, *, unlink: bool) -> None:
        if self._client_listener is not None:
            self._client_listener.close()
        sock = self._listen_sock
        self._listen_sock = None
        if sock is None:
            return
        if unlink and self._bound_by_us:
            with contextlib.suppress(OSError):
                if os.stat(self.layout.socket).st_ino == self._bound_ino:
                    os.unlink(self.layout.socket)
        sock.close()

    def _socket_intact(self) -> bool:
        try:
            return os.stat(self.layout.socket).st_ino == self._bound_ino
        except FileNotFoundError:
            return False

    def _rebind(self) -> None:
        # refused: nothing changes, and the next self-check tries again
        prove_socket_dir(self.layout.socket_dir)
        old = self._listen_sock
        self._listen_sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.layout.socket)  # we hold the lease: the path is ours
        self._bind()
        if old is not None:
            old.close()
        self.service_nursery.start_soon(self._keep_running, "accept", self._accept_loop,
                                        self._listen_sock)
        log.warning("socket %s was removed or replaced; bound it again", self.layout.socket)

    async def _keep_running(
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

    async def _accept_loop(self, sock: trio.socket.SocketType | None) -> None:
        """Accept clients until ``sock`` is closed (shutdown, or replaced by a rebind).

        Out of descriptors (or memory), it backs off and goes on; a connection that arrives
        meanwhile is answered with one ``resource_exhausted`` line. Beyond ``max_clients``
        connections, a new one gets that line too.
        """
        if sock is None or sock.fileno() == -1:
            return
        assert self._clients is not None
        clients = self._clients

        def start(stream: trio.SocketStream) -> None:
            self.clients_open += 1  # counted here: a burst of accepts cannot overshoot
            clients.start_soon(self._serve_client, stream)

        await accept_forever(
            trio.SocketListener(sock), start, rl=self.rl, what="supervisor",
            shed_line=lambda e: encode(fail(None, exhaustion_error(OSError(e, os.strerror(e))))),
        )

    async def _accept_from(self, listener: ClientListener) -> None:
        """Accept clients from an injected listener until it is closed."""
        assert self._clients is not None
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            self.clients_open += 1
            self._clients.start_soon(self._serve_client, stream)

    # periodic -----------------------------------------------------------------------------
    async def _self_check_loop(self) -> None:
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
            self._heal_state()
            if self._listen_sock is not None and not self._socket_intact():
                try:
                    self._rebind()
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
                await self.notifier.status(self._status_text())

    def _status_text(self) -> str:
        running = sum(1 for h in self.sessions.values()
                      if h.mode.value not in (Mode.STOPPED, Mode.FAILED))
        return status_text(len(self.sessions), running)

    def _heal_state(self) -> None:
        """Dirs a cleaner deleted under a live supervisor are made again and their files
        written again from memory: descriptors and tokens (the next supervisor adopts from
        them), this generation's proof of home, each session's metadata. One stat per dir per
        tick when nothing is missing; logged once per heal."""
        L = self.layout
        try:
            healed: list[str] = []
            for d in (L.state_dir, L.journal_dir):
                if not d.is_dir():
                    _fs.ensure_dir(d)
                    healed.append(str(d))
            mine = L.generations_dir / self.generation
            if not mine.is_dir():
                _fs.ensure_dir(mine)
                healed.append(str(mine))
            if not L.workers_dir.is_dir():
                _fs.ensure_dir(L.workers_dir)
                healed.append(str(L.workers_dir))
                for h in list(self.sessions.values()):
                    if h.token is not None:
                        _fs.atomic_write(L.token_path(h.session_id), h.token.encode())
                    self.ops.persist(h)
            # per-session dirs only when the sessions dir changed (a subdir removed changes
            # its mtime): no stat per session on every 250 ms tick
            try:
                stamp = L.sessions_dir.stat().st_mtime_ns
            except FileNotFoundError:
                stamp = None
            sessions = [] if stamp is not None and stamp == self._sessions_stamp else list(
                self.sessions.values())
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
            self._sessions_stamp = L.sessions_dir.stat().st_mtime_ns  # after our own writes
        if healed:
            log.warning("state removed under the running supervisor; made again from memory:"
                        " %s", ", ".join(healed))

    async def _idle_sweep_loop(self) -> None:
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
                [(h.session_id, h.mode.value, h.idle_for(now)) for h in self.sessions.values()],
                now=now, idle_eviction=t.idle_eviction,
            )
            for sid in victims:
                h = self.sessions[sid]
                if h.stopping:
                    continue
                log.info("session %s idle for %.0fs: stopping its worker (evicted)",
                         sid, h.idle_for(now))
                # the worker declines it if a turn runs or waits (a direct route's prompt
                # may have reached it since its last notice): the session then stays ready
                h.request_stop(graceful=True, reason=StopReason.EVICT)

    async def _upgrade_sweep_loop(self) -> None:
        """Replace each adopted worker of another version (or protocol) with one of this
        version once its session has been idle ``upgrade_idle`` (counted from the end of its
        last turn, or from the adoption). Until then it serves as before; a worker that has a
        turn running or queued declines, and is asked again once idle."""
        t = self.timing
        while True:
            now = trio.current_time()
            wake = t.upgrade_idle
            for h in list(self.sessions.values()):
                if not h.outdated or h.stopping or h.session_id in self._replacing:
                    continue
                idle = h.idle_for(now)
                if idle >= t.upgrade_idle:
                    self._replacing.add(h.session_id)
                    self.service_nursery.start_soon(self._replace_outdated, h)
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

    async def _signals(self) -> None:
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
    def _load_descriptors(self) -> None:
        for path in sorted(self.layout.workers_dir.glob("*.json")):
            try:
                h, alive, lifecycle = self.ops.load(path)
            except ValueError as exc:
                log.error("skipping worker descriptor %s: %s — move it away to silence this",
                          path, exc)
                continue
            self.sessions[h.session_id] = h
            self._loaded.append((h, alive, lifecycle))

    async def _supervise(self, h: WorkerHandle, *, alive: bool, lifecycle: Mode) -> None:
        """Start the session's supervise task in the service nursery (its own cancel scope)."""
        await self.service_nursery.start(
            functools.partial(
                h.supervise,
                alive=alive,
                wanted=lifecycle not in (Mode.STOPPED, Mode.FAILED),
                failed=lifecycle is Mode.FAILED and not alive,
            )
        )
        if h.loaded_stop_reason is StopReason.KILL:
            # a predecessor died while killing it: finish the kill (stop, then forget)
            self.service_nursery.start_soon(self._complete_kill, h)

    async def _complete_kill(self, h: WorkerHandle) -> None:
        """Once a kill's stop is done, forget the session: its descriptor and token go, and
        commands waiting on it look it up again (a prompt creates the session anew). A worker
        that survived SIGKILL leaves the session failed, for the operator."""
        await h.wait_stop_handled()
        if (
            h.mode.value is Mode.STOPPED
            and h.state.stop_reason is StopReason.KILL
            and self.sessions.get(h.session_id) is h
        ):
            del self.sessions[h.session_id]
            self.killed.add(h.session_id)
            self.ops.forget(h.session_id)
            h.cancel_scope.cancel()
            h.retire()
            log.info("session %s killed", h.session_id)

    async def get_session(
        self,
        session_id: str,
        agent: str | None,
        cwd: str | None,
        *,
        create: bool,
        env: dict[str, str] | None = None,
        cwd_given: bool = False,
    ) -> WorkerHandle:
        """The session's handle; a new one is created (``create``) with the creating client's
        ``cwd`` and environment ``env`` (minus the daemon's own variables).

        ``cwd_given``: the user chose ``cwd`` (``--cwd``); an existing session with another
        working directory is then refused, naming it (a new one starts there)."""
        check_session_id(session_id)
        while (removing := self._removing.get(session_id)) is not None:
            await removing.wait()  # a command during `rm` comes after it: a new session
        known = self.sessions.get(session_id)
        if known is not None and (agent is None or agent == known.agent):
            if cwd_given and cwd is not None:
                _check_cwd(session_id, known.cwd, cwd)
            return known  # the per-command fast path: no lock, no checkpoint
        # no await from here to the return: a session is looked up and created atomically,
        # with no lock (a lock's checkpoint would make 100 new sessions queue one scheduling
        # round each)
        h = self.sessions.get(session_id)
        if h is None:
            meta = read_meta(self.layout.session_dir(session_id))
            if meta is None and not create:
                raise AgentdError(
                    ErrorCode.UNKNOWN_SESSION,
                    f"no session {session_id!r} — create it with"
                    f" `trio-agentd prompt -s {session_id} TEXT`",
                )
            known_agent = str(meta["agent"]) if meta and "agent" in meta else None
            use_agent = agent or known_agent or self.config.default_agent
            if known_agent is not None and agent is not None and agent != known_agent:
                raise _agent_mismatch(session_id, known_agent, agent)
            known_cwd = (meta or {}).get("cwd")
            if cwd_given and cwd is not None and isinstance(known_cwd, str):
                _check_cwd(session_id, known_cwd, cwd)
            validate_agent_spec(use_agent)
            # every session kept counts, stopped ones too: a stopped session keeps its
            # handle, supervise task and files, and any prompt starts it again unchecked
            if len(self.sessions) >= self.config.max_sessions:
                raise AgentdError(
                    ErrorCode.RESOURCE_EXHAUSTED,
                    f"this supervisor already keeps the most sessions it may"
                    f" ({self.config.max_sessions}, stopped ones included) — `trio-agentd"
                    " kill` sessions you no longer need",
                    {"limit": "max_sessions", "value": self.config.max_sessions},
                )
            self._claim_session(session_id, meta)
            h = self.ops.new_handle(
                session_id, use_agent,
                (meta or {}).get("cwd") or cwd or str(self.layout.session_dir(session_id)),
                None if env is None else agent_environment(env),
            )
            self.sessions[session_id] = h
            self.killed.discard(session_id)  # made anew by a new command
            # started, not awaited (its commands wait for readiness, and their demand starts
            # its worker whenever the task runs)
            self.service_nursery.start_soon(functools.partial(
                h.supervise, alive=False, wanted=False, failed=False))
        elif agent is not None and agent != h.agent:
            raise _agent_mismatch(session_id, h.agent, agent)
        elif cwd_given and cwd is not None:
            _check_cwd(session_id, h.cwd, cwd)
        return h

    def _claim_session(self, session_id: str, meta: dict[str, Any] | None) -> None:
        """A session lives in one supervisor at a time (sessions are per home, workers per
        socket). Refuse one whose worker runs under another socket; adopt an abandoned one."""
        other = (meta or {}).get("socket")
        if not isinstance(other, str) or other == self.layout.socket:
            return
        theirs = Layout(home=self.layout.home, socket=other, registry=self.layout.registry)
        desc: Any = None
        try:
            raw = _fs.read_bytes(theirs.descriptor_path(session_id))
            desc = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError) as exc:
            log.error("session %s: ignoring the descriptor under socket %s: %s",
                      session_id, other, exc)
        if isinstance(desc, dict) and isinstance(desc.get("pid"), int) and is_alive(
            int(desc["pid"]), desc.get("start_id")
        ) and desc.get("start_id"):
            raise AgentdError(
                ErrorCode.BAD_REQUEST,
                f"session {session_id!r} runs under the supervisor on {other} (worker pid"
                f" {desc['pid']}) — use --socket {other}, or another session name",
            )
        log.info("session %s: taking it over from socket %s (no live worker there)",
                 session_id, other)
        assert meta is not None
        write_meta(self.layout.session_dir(session_id), {**meta, "socket": self.layout.socket})

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

    async def _serve_client(self, stream: trio.abc.Stream) -> None:
        """Serve one client connection. Nothing a client sends or does can escape from here."""
        ms = MessageStream(stream)
        try:
            if self.clients_open > self.config.max_clients:
                self.rl.error(("clients", "cap"), "refused a client connection: %d are open"
                              " (the most is %d)", self.clients_open - 1, self.config.max_clients)
                with trio.move_on_after(LINK_CLOSE_TIMEOUT):
                    await ms.send(fail(None, AgentdError(
                        ErrorCode.RESOURCE_EXHAUSTED,
                        f"the supervisor serves at most {self.config.max_clients} client"
                        " connections at once — close idle clients and try again",
                        {"limit": "max_clients", "value": self.config.max_clients})))
                return
            uid = _peer_uid(stream)
            if uid is not None and uid != os.getuid():
                await ms.send(fail(None, AgentdError(
                    ErrorCode.PERMISSION_DENIED,
                    f"uid {uid} may not use the supervisor of uid {os.getuid()}")))
                return
            await ms.send(self.hello())
            inflight = AsyncValue(0)
            # one error from the nursery comes out bare: a broken client is no error, and
            # EMFILE is the rate-limited line below, never a traceback per connection
            with single_errors():
                async with trio.open_nursery() as requests:
                    await self._read_requests(ms, requests, inflight)
                    # the client half-closed or broke: let its requests finish, bounded
                    with trio.move_on_after(self.timing.stop_grace):
                        await inflight.wait_value(0)
                    requests.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            if is_exhaustion(exc):
                self.rl.error(("client", type(exc).__name__, getattr(exc, "errno", None)),
                              "client connection failed: %s", exc)
            else:
                log.exception("client connection failed")
        finally:
            self.clients_open -= 1
            await ms.aclose()

    async def _read_requests(
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
        self.inflight.value += 1
        try:
            await self._dispatch_one(ms, req)
        finally:
            inflight.value -= 1
            self.inflight.value -= 1

    async def _dispatch_one(self, ms: MessageStream, req: Request) -> None:
        try:
            if req.op != "shutdown":
                if self.shutdown_requested.is_set():
                    raise AgentdError(ErrorCode.SHUTTING_DOWN, "the supervisor is shutting down")
                await self.ownership.ensure_current()
            with single_errors():  # an op's nursery: its one error is classified as itself
                result = await self._run_op(ms, req)
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
                self.rl.error(("op", exc.errno), "%s: %s", req.op, err.message)
                response = fail(req.id, err)
        except Exception as exc:
            log.exception("internal error in %s", req.op)
            response = fail(req.id, AgentdError(ErrorCode.INTERNAL, f"internal error: {exc}"))
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await ms.send(response)
        if req.op == "shutdown" and response.ok:
            self.request_shutdown(stop_workers=bool(req.args.get("stop_workers", True)))
        elif req.op == "restart" and response.ok:
            self.request_shutdown(stop_workers=False, restart=True)

    async def _run_op(self, ms: MessageStream, req: Request) -> Any:
        args = req.args
        match req.op:
            case "ping":
                return {"pong": True, "generation": self.generation, "pid": os.getpid()}
            case "status":
                return self.status()
            case "sessions":
                await self._refresh_from_workers()
                return [h.summary() for h in sorted(self.sessions.values(),
                                                     key=lambda h: h.session_id)]
            case "create_session":
                while True:
                    h = await self.get_session(
                        _str_arg(args, "session"), _opt_str(args, "agent"),
                        _opt_str(args, "cwd"), create=True, env=_opt_env(args),
                cwd_given=args.get("cwd_given") is True,
                    )
                    with contextlib.suppress(SessionRetired):  # killed meanwhile: anew
                        await self._wait_ready(h)
                        return h.summary()
            case "prompt":
                return await self._prompt(ms, req)
            case "route":
                return await self._route(args)
            case "cancel":
                h = self._known(_str_arg(args, "session"))
                command_id = args.get("command_id")
                response = await h.call(
                    "cancel", {} if command_id is None else {"command_id": command_id},
                    client_id=req.client_id, on_event=None,
                )
                if not response.ok:
                    from ._protocol import error_of

                    raise error_of(response)
                return response.result
            case "kill_session":
                sid = _str_arg(args, "session")
                victim = self._known(sid)
                # durable before it acts (the descriptor says stopping: kill); its turn ends
                # at once with session_killed; then the session is forgotten, even if this
                # answer gives up waiting — or by the next supervisor if this one dies
                kill_running = victim.stopping and victim.stop_reason is StopReason.KILL
                victim.request_stop(graceful=True, reason=StopReason.KILL)
                if not kill_running:
                    self.service_nursery.start_soon(self._complete_kill, victim)
                with trio.move_on_after(kill_answer_bound(self.timing)):
                    await victim.wait_stop_handled()
                    if victim.mode.value is Mode.STOPPED:
                        await victim.retired.wait()  # forgotten by _complete_kill
                stopped = victim.retired.is_set()
                return {"session": sid, "killed": stopped,
                        "state": "killed" if stopped else str(victim.mode.value)}
            case "remove_session":
                return await self._remove_session(_str_arg(args, "session"),
                                                  force=args.get("force") is True)
            case "retry_session":
                again = self._known(_str_arg(args, "session"))
                failed = bool(again.cause)  # failed, or its last turn could not start its agent
                again.retry()
                with trio.move_on_after(self.timing.worker_connect_timeout):
                    await again.wait_retried()
                return {**again.summary(), "retried": failed}
            case "shutdown":
                return {"generation": self.generation, "pid": os.getpid(),
                        "stop_workers": bool(args.get("stop_workers", True))}
            case "restart":
                return {"generation": self.generation, "pid": os.getpid(),
                        "sessions": len(self.sessions)}
            case _:
                raise AgentdError(
                    ErrorCode.UNKNOWN_OP,
                    f"unknown op {req.op!r} — known: {', '.join(sorted(OPS))}",
                )

    async def _remove_session(self, sid: str, *, force: bool) -> dict[str, Any]:
        """``trio-agentd rm``: stop the session (refused while a turn runs, unless ``force``,
        which kills the turn), forget it, and delete its data: the session dir (metadata,
        transcript, logs, outputs), its journal, descriptor and token. A command for the
        session that arrives meanwhile waits, then finds no session and makes a new one.
        """
        check_session_id(sid)
        if sid in self._removing:
            raise AgentdError(ErrorCode.SESSION_BUSY, f"session {sid} is being removed already")
        L = self.layout
        done = self._removing[sid] = trio.Event()
        try:
            h = self.sessions.get(sid)
            session_dir = L.session_dir(sid)
            if h is None and not session_dir.is_dir() and not L.journal_path(sid).exists():
                raise AgentdError(ErrorCode.UNKNOWN_SESSION,
                                  f"no session {sid!r} — `trio-agentd sessions` lists them")
            if h is None:
                self._claim_session(sid, read_meta(session_dir))  # not one another runs
            else:
                await self._stop_for_removal(h, force=force)
            log.info("session %s removed%s", sid, " (--force)" if force else "")
            self.killed.add(sid)  # a resent command of it is not run in a new session
            self.ops.forget(sid)
            with contextlib.suppress(FileNotFoundError):
                L.journal_path(sid).unlink()
            if session_dir.is_dir() and not session_dir.is_symlink():
                import shutil

                shutil.rmtree(session_dir)
            return {"session": sid, "removed": True}
        finally:
            del self._removing[sid]
            done.set()

    async def _stop_for_removal(self, h: WorkerHandle, *, force: bool) -> None:
        """Stop ``h``'s worker for good and forget the session. Without ``force`` the worker
        itself declines while a turn runs or waits (as an eviction: no turn is ever cut)."""
        sid = h.session_id
        bound = kill_answer_bound(self.timing)
        if not force and h.mode.value not in (Mode.STOPPED, Mode.FAILED):
            h.request_stop(graceful=True, reason=StopReason.EVICT)
            with trio.move_on_after(bound):
                await h.wait_stop_handled()
            if h.mode.value is Mode.READY:  # the worker declined: a turn runs or waits
                raise AgentdError(
                    ErrorCode.SESSION_BUSY,
                    f"session {sid} is running a turn — wait for it, `trio-agentd cancel"
                    f" {sid}`, or `trio-agentd rm --force {sid}`", {"session": sid})
            if h.mode.value not in (Mode.STOPPED, Mode.FAILED):
                raise AgentdError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"session {sid} did not stop within {bound:g}s (it is"
                    f" {h.mode.value}); nothing was deleted — try again, or `trio-agentd rm"
                    f" --force {sid}`", {"session": sid})
        h.request_stop(graceful=True, reason=StopReason.KILL)  # ends a running turn at once
        with trio.move_on_after(bound):
            await h.wait_stop_handled()
        if h.mode.value is not Mode.STOPPED and h.pid is not None and is_alive(
            h.pid, h.start_id
        ):
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"session {sid}: its worker pid {h.pid} did not stop; nothing was deleted —"
                " see `trio-agentd ps` and `trio-agentd doctor`", {"session": sid})
        if self.sessions.get(sid) is h:
            del self.sessions[sid]
        h.cancel_scope.cancel()
        h.retire()

    async def _route(self, args: dict[str, Any]) -> dict[str, Any]:
        """The data plane's entry: make the session ready (creating or recovering it) and grant
        the client a direct route to its worker.

        ``resend``: the client asks again for a command it already sent (its route failed). If
        the session was killed meanwhile the command is not carried into a session made anew:
        ``session_killed``, as its client would have heard from the worker.
        """
        session = _opt_str(args, "session") or "default"
        resend = args.get("resend") is True
        while True:
            if resend and session in self.killed:
                raise _killed_while_sent(session)
            h = await self.get_session(
                _opt_str(args, "session") or "default", _opt_str(args, "agent"),
                # ``existing`` (a follower): never a new session
                _opt_str(args, "cwd"), create=args.get("existing") is not True,
                env=_opt_env(args), cwd_given=args.get("cwd_given") is True,
            )
            h.touch()
            try:
                await self._wait_ready(h)  # a stopping session: after its stop, as if then
                break
            except SessionRetired:
                if resend:
                    raise _killed_while_sent(session) from None
                continue  # it was killed: the prompt creates the session anew
        if h.token is None or h.pid is None:
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE,
                              f"session {h.session_id} has no worker to route to")
        expires = time.time() + self.timing.grant_ttl
        return {
            "session": h.session_id,
            "agent": h.agent,
            "worker_socket": self.layout.worker_socket(h.session_id),
            "worker_pid": h.pid,
            "generation": self.generation,
            "grant": make_grant(h.token, h.session_id, self.generation, expires),
            "expires": expires,
        }

    async def _refresh_from_workers(self) -> None:
        """Turns and activity as each worker says now (clients prompt workers directly; the
        notices a worker sends may still be on their way)."""

        async def ask(h: WorkerHandle) -> None:
            link = h.link
            if link is None or link.closed.is_set():
                return
            with contextlib.suppress(WorkerDropped, AgentdError):
                response = await link.call("status", {}, client_id="")
                status = response.result if response.ok else None
                if isinstance(status, dict) and isinstance(status.get("turns"), int):
                    h.turns = max(h.turns, status["turns"])
                    h.busy = bool(status.get("busy"))

        with trio.move_on_after(self.timing.status_timeout):
            async with trio.open_nursery() as nursery:
                for h in list(self.sessions.values()):
                    nursery.start_soon(ask, h)

    def _rearm_if_exhausted(self, h: WorkerHandle) -> None:
        """A session that failed only because its worker could not be started for want of
        resources (descriptors, processes, memory, room on disk) is started again by the
        next command: that failure was the command's, not the session's."""
        if h.mode.value is Mode.FAILED and self.ops.exhausted.get(h.session_id) is not None:
            log.info("session %s: trying to start it again (its last start ran out of"
                     " resources)", h.session_id)
            h.retry()

    def _exhausted_instead(self, h: WorkerHandle, exc: AgentdError) -> AgentdError:
        """``resource_exhausted`` (naming the limit) or ``storage_error`` (naming the file)
        for a session whose worker could not be started for want of resources or room;
        ``exc`` otherwise."""
        if exc.code == ErrorCode.WORKER_UNAVAILABLE:
            why = self.ops.exhausted.get(h.session_id)
            if why is not None:
                return AgentdError(
                    why.code,  # resource_exhausted, or storage_error (no room for its files)
                    f"{why.message} (the next command tries again)",
                    why.details,
                )
        return exc

    async def _wait_ready(self, h: WorkerHandle) -> None:
        self._rearm_if_exhausted(h)
        try:
            await h.wait_ready()
        except AgentdError as exc:
            raise self._exhausted_instead(h, exc) from None

    def _known(self, session_id: str) -> WorkerHandle:
        h = self.sessions.get(session_id)
        if h is None:
            raise AgentdError(
                ErrorCode.UNKNOWN_SESSION,
                f"no session {session_id!r} — `trio-agentd sessions` lists them",
            )
        return h

    async def _prompt(self, ms: MessageStream, req: Request) -> Any:
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
            h = await self.get_session(
                _opt_str(args, "session") or "default", _opt_str(args, "agent"),
                _opt_str(args, "cwd"), create=True, env=_opt_env(args),
                cwd_given=args.get("cwd_given") is True,
            )
            h.touch()
            self._rearm_if_exhausted(h)
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
                raise self._exhausted_instead(h, exc) from None
        if not response.ok:
            from ._protocol import error_of

            raise error_of(response)
        result = response.result
        if isinstance(result, dict) and isinstance(result.get("turn"), int):
            h.turns = max(h.turns, result["turn"])
        return result

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
            "sessions": len(self.sessions),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "phase": str(self.ownership.record.phase),
            "restores": self.ownership.statistics().restores,
            # workers forked ahead of need, parked until a session's start takes one
            "spare_pids": [sp.pid for sp in fs.spares] if (fs := self.ops.forkserver) else [],
        }


def _killed_while_sent(session: str) -> AgentdError:
    return AgentdError(
        ErrorCode.SESSION_KILLED,
        f"session {session} was killed while this prompt ran or waited; it was not run again"
        " — send it again to start the session anew",
        {"session": session},
    )


def _agent_mismatch(session_id: str, have: str, asked: str) -> AgentdError:
    return AgentdError(
        ErrorCode.BAD_REQUEST,
        f"session {session_id!r} runs agent {have!r}, not {asked!r} — drop --agent or use"
        " another session",
    )


def _check_cwd(session_id: str, have: str, asked: str) -> None:
    """``--cwd`` for an existing session must name its working directory (the same path, or
    the same directory by another path); anything else is refused, naming the session's."""
    if os.path.normpath(have) == os.path.normpath(asked):
        return
    with contextlib.suppress(OSError):
        if os.path.samefile(have, asked):
            return
    raise AgentdError(
        ErrorCode.BAD_REQUEST,
        f"session {session_id!r} works in {shown_path(have)}, not {shown_path(asked)} — drop"
        " --cwd, or use another session (-s NEW --cwd DIR)",
        {"session": session_id, "cwd": have},
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
