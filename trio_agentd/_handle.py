"""One session as the supervisor sees it: a task that runs the recovery planner.

``WorkerHandle.supervise`` is the thin shell around :func:`._recovery.decide`: it performs each
action (connect, wait, serve, stop, spawn) through a :class:`WorkerOps` — real processes in
:mod:`._procops`, fakes in :mod:`trio_agentd.testing` — and feeds the outcome back. Every
timeout is a cancel scope here, so the whole schedule runs on MockClock with fakes.

Commands (``call``) wait until the session is ready, then send over the current link; if the
link drops mid-command the same command id is resent over the next link, and the worker's
journal answers it without running it twice.

Stops (kill, eviction, shutdown) are durable intents: ``request_stop`` writes the descriptor
(lifecycle ``stopping`` and the reason, atomically and fsynced) before the supervise task tells
or signals the worker. A command that arrives while the session is stopping waits for the stop
and is then served as if it came after it: an evicted or shut-down session starts a fresh
worker; a killed session is retired (:class:`SessionRetired`), and the supervisor creates the
session anew for it.

Every link is pinged (:meth:`WorkerLink.watch_liveness`): a worker that answers no ping within
``link_ping_timeout`` loses its link and is recovered like one that cannot be reached
(``LinkLost(alive=True)``: reconnects, deferred rounds, stop and respawn); a command waiting on
it fails ``worker_unresponsive`` instead of waiting for ever — at most ``link_ping_interval +
link_ping_timeout`` after the later of the command's start and the worker's last sign of life.
An idle link (no command outstanding, no turn running) is pinged only after
``link_idle_ping_interval`` of silence: an idle hung worker is found at most
``link_idle_ping_interval + link_ping_timeout`` after its last sign of life, or
``link_ping_interval + link_ping_timeout`` after a client was routed to it (:meth:`touch`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
from dataclasses import replace
from typing import Any, Protocol, assert_never

import trio
from trio_util import wait_any

from ._errors import AgentdError, ErrorCode
from ._protocol import APP_VERSION, PROTOCOL_VERSION, Notice, Response
from ._recovery import (
    Action,
    Connect,
    Connected,
    ConnectFailed,
    Demand,
    Fail,
    Idle,
    IllegalObservation,
    LinkLost,
    Mode,
    Observation,
    RecoveryState,
    Retry,
    Serve,
    Spawn,
    Spawned,
    SpawnFailed,
    Start,
    Stop,
    StopDeclined,
    Stopped,
    StopReason,
    StopRequested,
    TimerFired,
    Wait,
    decide,
    descriptor_lifecycle,
)
from ._session import now_iso
from ._watched import WatchedValue
from ._workerlink import EventSink, WorkerDropped, WorkerLink
from .timing import LINK_CLOSE_TIMEOUT, Timing

log = logging.getLogger("trio_agentd.supervisor")
# notes a handle keeps of its schedule (its ``log``): between this many and twice as many
LOG_KEEP = 64


class SessionRetired(AgentdError):
    """The session was killed while a command waited for it: its handle is gone for good. The
    supervisor looks the session up again (creating it anew) and serves the command there."""

    def __init__(self, session_id: str) -> None:
        super().__init__(ErrorCode.UNKNOWN_SESSION, f"session {session_id!r} was killed")


class StopBatch:
    """Workers stopped together (a clean shutdown): each of them is told to stop first, and
    none is waited for until every one has been (or the batch's grace is over), so the batch
    has one deadline, ``stop_grace`` from its start, instead of one per worker in turn.

    A handle joins when its stop is asked for while its worker is ready
    (:meth:`WorkerHandle.request_stop`); one that is starting or recovering stops on its own
    schedule and never holds up the others.
    """

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline  # trio time: the told workers' grace ends here
        self._untold: set[object] = set()
        self.all_told = trio.Event()
        self.all_told.set()  # until someone joins

    def join(self, member: object) -> None:
        if self.all_told.is_set():
            self.all_told = trio.Event()
        self._untold.add(member)

    def told(self, member: object) -> None:
        """``member``'s worker was told to stop (or there was nothing to tell)."""
        self._untold.discard(member)
        if not self._untold:
            self.all_told.set()

    async def wait_all_told(self) -> None:
        with trio.move_on_at(self.deadline):
            await self.all_told.wait()


class WorkerOps(Protocol):
    """The I/O a handle needs. Every async method is bounded by the caller's cancel scope."""

    timing: Timing

    def alive(self, h: WorkerHandle) -> bool:
        """Is the worker process with the handle's recorded identity running?"""
        ...

    def serving(self, h: WorkerHandle) -> bool:
        """:meth:`alive`, and not about to die: no ``SIGKILL`` is pending (a worker killed a
        moment ago runs, and keeps its socket, until the kernel has it act on the signal)."""
        ...

    async def connect(self, h: WorkerHandle) -> WorkerLink:
        """Connect to the running worker and authenticate (raises AgentdError)."""
        ...

    async def spawn(self, h: WorkerHandle) -> None:
        """Start a fresh worker: sets h.pid/start_id/token, descriptor written before the gate
        opens, returns once the worker listens (raises AgentdError)."""
        ...

    def signal(self, h: WorkerHandle, sig: int) -> bool:
        """Identity-checked signal to the worker's process group."""
        ...

    async def wait_exit(self, h: WorkerHandle) -> None:
        """Return once the worker process is gone."""
        ...

    def admission_held(self) -> bool: ...

    def persist(self, h: WorkerHandle) -> None:
        """Write the handle's descriptor (it may be committed later: see :meth:`durable`)."""
        ...

    async def durable(self) -> None:
        """Return once every descriptor written so far is on disk."""
        ...


class WorkerHandle:
    """One session as the supervisor sees it; its worker's processes go through ``ops``.

    Making one spawns nothing, nor does ``supervise_new`` (a session with no worker yet): the
    first command (:meth:`call`, :meth:`wait_ready`) spawns its worker.
    ``supervise(alive=False, wanted=True)`` spawns as soon as it starts. ``mode`` (a
    :class:`~trio_agentd._watched.WatchedValue` of :class:`~trio_agentd._recovery.Mode`, the
    interface of ``trio_util.AsyncValue`` in a few bytes) says what the worker is doing:
    ``await handle.mode.wait_value(Mode.READY)``.
    """

    # slots: a supervisor keeps one handle per session, thousands (an instance dict of this
    # many fields is a kilobyte more each)
    __slots__ = (
        "_changed", "_demand", "_persist_failed", "_persist_retrying", "_persisted", "_prompts",
        "_readers", "_retry", "_retry_pending", "_spawn_failure", "_stop_batch", "_stop_done",
        "_stop_event", "_stop_request", "agent", "agent_failure", "busy", "cancel_scope",
        "created_at", "cwd", "env", "evicted", "last_prompt", "link", "loaded_stop_reason", "log",
        "mode", "ops", "pid", "restarts_loaded", "retired", "session_id", "spawn_limiter",
        "start_id", "state", "supervised_since", "timing", "token", "turns", "unresponsive",
        "worker_protocol", "worker_version",
    )

    def __init__(
        self,
        ops: WorkerOps,
        session_id: str,
        agent: str,
        cwd: str,
        *,
        created_at: str | None = None,
        spawn_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self.ops = ops
        # shared by a supervisor's handles: at most so many worker starts at once
        self.spawn_limiter = spawn_limiter
        self.timing = ops.timing
        self.session_id = session_id
        self.agent = agent
        self.cwd = cwd
        # the creating client's environment (minus the daemon's variables), for a new session
        self.env: dict[str, str] | None = None
        self.created_at = created_at or now_iso()
        self.pid: int | None = None
        self.start_id: str | None = None
        self.token: str | None = None
        self.turns = 0
        self.restarts_loaded = 0  # restarts before this supervisor (from the descriptor)
        # trio clock times: the last prompt, or when supervision began (idle since then)
        self.last_prompt: float | None = None
        self.busy = False  # a turn is running (as the worker last said)
        # why its last turn could not start the agent (an exec program missing, ...), as the
        # worker said: the session shows failed with it until a turn succeeds or a retry
        self.agent_failure = ""
        self._spawn_failure = ""  # the agent-load cause of the last spawn that failed
        self.supervised_since = 0.0
        self.evicted = False
        self.link: WorkerLink | None = None
        # the version and protocol the current worker said in its hello (None: it did not)
        self.worker_version: str | None = None
        self.worker_protocol: int | None = None
        # set while recovering a worker that stopped answering pings: when its ping was sent
        self.unresponsive: float | None = None
        self.state = RecoveryState()
        self.mode: WatchedValue[Mode] = WatchedValue(Mode.STOPPED)
        self._demand = trio.Event()
        self._retry = trio.Event()
        self._stop_event = trio.Event()
        self._stop_request: StopRequested | None = None
        self._stop_done: trio.Event | None = None
        self._stop_batch: StopBatch | None = None  # stopped with others: told, then waited
        # an operator's stop the descriptor recorded (lifecycle stopping, or stopped after an
        # eviction or a kill): the supervise task starts by finishing it
        self.loaded_stop_reason = StopReason.NONE
        self.retired = trio.Event()  # killed and forgotten: commands look the session up again
        self._changed: WatchedValue[int] = WatchedValue(0)  # bumped on every state change
        self._prompts = 0  # prompts through this supervisor in flight (running or queued)
        self._persisted = (Mode.STOPPED, StopReason.NONE)  # what the descriptor says
        self._retry_pending = False
        self._readers: trio.Nursery | None = None
        self._persist_failed = False  # the last descriptor write failed
        self._persist_retrying = False
        self.cancel_scope = trio.CancelScope()  # cancelled: stop supervising (worker kept)
        # (time, what): the schedule, for tests and -v; the newest LOG_KEEP..2*LOG_KEEP notes
        self.log: list[tuple[float, str]] = []

    # public --------------------------------------------------------------------------------
    @property
    def restarts(self) -> int:
        return self.restarts_loaded + self.state.restarts_total

    @property
    def cause(self) -> str:
        """Why the session is failed ("" if it is not): its agent cannot be loaded, its
        worker crashed too often, or (worker alive) its last turn could not start the agent."""
        if self.mode.value is Mode.FAILED:
            return self.state.failure or "see its worker.log"
        if self.mode.value is Mode.READY:
            return self.agent_failure
        return ""

    def summary(self) -> dict[str, Any]:
        alive = self.pid is not None and self.mode.value not in (Mode.STOPPED, Mode.FAILED)
        cause = self.cause
        if self.evicted and self.mode.value is Mode.STOPPED:
            state = "evicted"
        elif cause:
            state = str(Mode.FAILED)  # also a live worker whose agent could not start
        else:
            state = str(self.mode.value)
        return {
            "session": self.session_id,
            "agent": self.agent,
            "state": state,
            "pid": self.pid if alive else None,
            # as the worker itself said it in its hello; None when no worker runs (or one
            # older than the field)
            "version": self.worker_version if alive else None,
            "restarts": self.restarts,
            "turns": self.turns,
            "idle_s": round(self.idle_for(trio.current_time()), 3),
            "cause": cause or None,
            "busy": bool(self.busy or self._prompts),
        }

    @property
    def outdated(self) -> bool:
        """A worker of another version (or protocol) serves this session: adopted from a
        supervisor of another installation. It serves until the session is idle, then
        :meth:`replace_worker` replaces it."""
        return (
            self.mode.value is Mode.READY
            and self.link is not None
            and (self.worker_version != APP_VERSION or self.worker_protocol != PROTOCOL_VERSION)
        )

    async def replace_worker(self) -> bool:
        """Replace the worker with one of this version if the session is idle: an eviction
        (durable, and declined by a worker with a turn running or queued), then a start as for
        a prompt. ``True`` once the old worker stopped and a new one is being started;
        ``False`` if it declined (busy) or another stop took over."""
        await self.request_stop(graceful=True, reason=StopReason.EVICT).wait()
        if (
            self.retired.is_set()
            or self.mode.value is not Mode.STOPPED
            or self.state.stop_reason is not StopReason.EVICT
        ):
            return False
        self.evicted = False  # replaced, not evicted: it starts again at once
        self._demand.set()
        self._changed.value += 1
        return True

    @property
    def stop_reason(self) -> StopReason:
        """The operator's stop asked for or done: a pending request's, else the planner's."""
        req = self._stop_request
        if req is not None and self.state.stop_reason is not StopReason.KILL:
            return req.reason
        return self.state.stop_reason

    @property
    def stopping(self) -> bool:
        """An operator's stop is asked for and not yet done."""
        return self._stop_request is not None or self.state.stop_wanted

    def idle_for(self, now: float) -> float:
        if self.busy or self._prompts:
            return 0.0  # a session with a turn running or queued is never idle
        since = self.last_prompt if self.last_prompt is not None else self.supervised_since
        return max(0.0, now - since)

    def touch(self) -> None:
        """A prompt arrived (or a route for one): not idle, and no longer evicted; the
        worker's link, if idle, proves soon that the worker answers (:meth:`WorkerLink.probe`)."""
        self.last_prompt = trio.current_time()
        self.evicted = False
        if self.link is not None:
            self.link.probe()

    def request_stop(
        self, *, graceful: bool = True, reason: StopReason = StopReason.SHUTDOWN,
        batch: StopBatch | None = None,
    ) -> trio.Event:
        """Ask the supervise task to stop the worker; the event is set once it has been
        handled (mode STOPPED, or FAILED if the worker survived SIGKILL, or READY again if
        the worker declined an eviction).

        The intent is durable before anything acts on it: when a worker may run, the
        descriptor (lifecycle ``stopping``, ``stop_reason``) is written here, atomically and
        fsynced; a supervisor that dies now leaves its successor to finish the stop. A write
        that fails (no space) is logged and retried in the background; the stop goes on.
        """
        if self._stop_request is not None and self._stop_request.reason is StopReason.KILL:
            reason = StopReason.KILL  # a kill is never weakened by a later stop
        if batch is not None and self._stop_batch is None and self.mode.value is Mode.READY:
            batch.join(self)  # its supervise task reaches the stop at once: told with the rest
            self._stop_batch = batch
        self._stop_request = StopRequested(graceful=graceful, reason=reason)
        if self._stop_done is None:
            self._stop_done = trio.Event()
        if self.mode.value is not Mode.STOPPED and not (
            self.mode.value is Mode.FAILED and not self.state.unconfirmed
        ):
            self._persist()  # written before the supervise task can act on it
        self._stop_event.set()
        self._changed.value += 1
        return self._stop_done

    async def wait_stop_handled(self) -> None:
        """Return once no operator's stop is pending: it is done (STOPPED, or FAILED if the
        worker survived SIGKILL) or was declined (an eviction of a busy worker)."""
        while self.stopping or self.mode.value is Mode.STOPPING:
            await self._changed.wait_transition()

    def retire(self) -> None:
        """The session was killed and forgotten: commands waiting on this handle look the
        session up again."""
        self.retired.set()
        self._changed.value += 1

    def retry(self) -> None:
        """Re-arm a FAILED session (``trio-agentd retry``); a prompt right after waits for it.
        A live worker whose last turn could not start its agent is shown ready again (its next
        turn tries again)."""
        if self.mode.value is Mode.FAILED:
            self._retry_pending = True
        if self.agent_failure:
            self.agent_failure = ""
            self._persist()
        self._retry.set()

    async def wait_retried(self) -> None:
        """Return once a pending retry has moved the session out of FAILED."""
        if self._retry_pending:
            await self.mode.wait_value(lambda m: m is not Mode.FAILED)

    async def call(
        self, op: str, args: dict[str, Any], *, client_id: str, on_event: EventSink | None
    ) -> Response:
        """Send a command once the worker is ready, resending the same id if the link drops.

        Raises:
            AgentdError: ``worker_unavailable`` if the session failed or did not become ready
                within ``worker_connect_timeout``.

        Cancellation: the command may still run in the worker; a resend with the same id
        returns its result.
        """
        last: Exception | None = None
        prompt = op == "prompt"
        self._prompts += prompt  # running or queued: not idle (idle counts from its end)
        try:
            for _attempt in range(4):
                link = await self.wait_ready()
                try:
                    return await link.call(op, args, client_id=client_id, on_event=on_event)
                except WorkerDropped as exc:
                    last = exc
                    if link.unresponsive is not None:
                        # hung, not gone: the command stays in its journal for a later resend
                        raise self._unresponsive_error() from None
                    # the supervise task sees the drop and recovers; wait for the next link
                    await link.closed.wait()
        finally:
            self._prompts -= prompt
            if prompt:
                self.last_prompt = trio.current_time()
        raise AgentdError(
            ErrorCode.WORKER_UNAVAILABLE,
            f"session {self.session_id}: worker connection kept dropping ({last})",
        )

    async def wait_ready(self) -> WorkerLink:
        """The current link once the session is ready (starting a stopped session).

        A session that is stopping is waited for, then served as if the command came after
        the stop: a stopped (evicted, shut-down) session starts a fresh worker; a killed one
        raises :class:`SessionRetired` for the supervisor to create the session anew.

        Raises:
            SessionRetired: the session was killed (its handle is forgotten).
            AgentdError: ``worker_unavailable`` if it failed or is not ready in time.
        """
        if self.unresponsive is not None and self.mode.value is Mode.RECOVERING:
            await self._wait_responsive()
        with trio.move_on_after(self.timing.worker_connect_timeout):
            while True:
                if self.retired.is_set():
                    raise SessionRetired(self.session_id)
                await self.wait_retried()
                mode, link = self.mode.value, self.link
                if not self.stopping:
                    if (mode is Mode.READY and link is not None and not link.closed.is_set()
                            and self.ops.serving(self)):
                        return link
                    if mode is Mode.FAILED:
                        raise self._failed_error()
                    if mode is Mode.STOPPED and self.state.stop_reason is not StopReason.KILL:
                        self._demand.set()
                # not yet: stopping, starting, recovering, killed and about to be retired, or
                # ready with a link that just dropped or a worker that just died, its link's
                # end not read yet (a route to it would only fail: the recovery moves on)
                await self._changed.wait_transition()
        raise AgentdError(
            ErrorCode.WORKER_UNAVAILABLE,
            f"session {self.session_id} is {self.mode.value}: its worker did not become ready"
            f" within {self.timing.worker_connect_timeout:g}s — retry later",
        )

    def _failed_error(self) -> AgentdError:
        sid = self.session_id
        if self.state.agent_failed:
            return AgentdError(
                ErrorCode.AGENT_FAILED,
                f"session {sid} failed: {self.state.failure} — fix it, then run"
                f" `trio-agentd retry {sid}`",
                # the CLI's exit status, as for an exec: program that cannot be run
                {"session": sid, "cause": self.state.failure, "exit_status": 126},
            )
        return AgentdError(
            ErrorCode.WORKER_UNAVAILABLE,
            f"session {sid} failed ({self.state.failure or 'see its worker.log'})"
            f" — run `trio-agentd retry {sid}`",
        )

    async def _wait_responsive(self) -> None:
        """The worker stopped answering and is being recovered: give the recovery
        ``link_ping_timeout`` to reach it again (or move on to a respawn), else fail."""
        with trio.move_on_after(self.timing.link_ping_timeout):
            await self.mode.wait_value(lambda m: m is not Mode.RECOVERING)
            return
        raise self._unresponsive_error()

    def _unresponsive_error(self) -> AgentdError:
        t = self.timing
        return AgentdError(
            ErrorCode.WORKER_UNRESPONSIVE,
            f"session {self.session_id}: its worker (pid {self.pid}) answers nothing, not even"
            f" a ping within {t.link_ping_timeout:g}s (stopped, or its event loop is blocked);"
            " it is being recovered — send the command again later (the same id gets its"
            " result if it ran)",
            {"session": self.session_id, "pid": self.pid},
        )

    # the supervise loop -----------------------------------------------------------------------
    async def supervise(
        self, *, alive: bool, wanted: bool, failed: bool = False,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the planner for this session until cancelled (supervisor exit or ``kill``).

        Cancellation: by ``cancel_scope`` or from outside; the link to the worker is closed
        and the worker keeps running.
        """
        self.supervised_since = trio.current_time()
        if self.loaded_stop_reason is not StopReason.NONE and self._stop_done is None:
            self._stop_done = trio.Event()  # finishing a predecessor's stop
        with self.cancel_scope:
            state, action = self._decide(
                self.state,
                Start(alive=alive, wanted=wanted, failed=failed,
                      stop_reason=self.loaded_stop_reason),
            )
            task_status.started()
            try:
                async with trio.open_nursery() as nursery:
                    self._readers = nursery
                    while True:
                        self._publish(state)
                        obs = await self._perform(action)
                        if self._stop_request is not None and not isinstance(obs, StopRequested):
                            # a stop arrived during an action that could not be interrupted:
                            # the planner honours it after this outcome, never respawning
                            req = self._take_stop()
                            reason = (StopReason.KILL if state.stop_reason is StopReason.KILL
                                      else req.reason)
                            state = replace(state, stop_wanted=True, graceful=req.graceful,
                                            stop_reason=reason)
                        state, action = self._decide(state, obs)
            finally:
                if self.link is not None:
                    with trio.move_on_after(LINK_CLOSE_TIMEOUT, shield=True):
                        await self.link.aclose()

    def _decide(self, state: RecoveryState, obs: Observation) -> tuple[RecoveryState, Action]:
        """The planner's next state and action; a pair the table has no cell for (a bug of
        this shell) fails this session alone: logged once with its traceback, the session
        ``failed`` with an internal-error cause that ``retry`` clears, the daemon serving on.
        A worker that may still run is marked unconfirmed: a retry or stop kills it first, so
        a retry never runs two workers for one session."""
        try:
            return decide(state, obs, trio.current_time(), self.timing,
                          admission_held=self.ops.admission_held())
        except IllegalObservation as exc:
            log.error("session %s: internal error: %s (a bug; the session is marked failed,"
                      " everything else is served)", self.session_id, exc, exc_info=True)
            may_run = self.ops.alive(self)
            return replace(
                state, mode=Mode.FAILED, unconfirmed=may_run, stop_wanted=False,
                failure=f"internal error: {exc} — see daemon.log; `trio-agentd retry"
                        f" {self.session_id}` starts it again",
            ), Fail()

    async def supervise_new(  # noqa: ASYNC114, ASYNC128 - delegates task_status
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Supervise a session that has no worker yet: its first command starts one."""
        await self.supervise(alive=False, wanted=False, task_status=task_status)

    def _publish(self, state: RecoveryState) -> None:
        self.state = state
        if (
            self._stop_done is not None
            and self._stop_request is None
            and not state.stop_wanted
            and state.mode is not Mode.STOPPING  # stopped, failed, or an eviction declined
        ):
            self._stop_done.set()
            self._stop_done = None
        if state.mode is not Mode.FAILED:
            self._retry_pending = False
        if state.mode is Mode.READY and self._demand.is_set():
            self._demand = trio.Event()  # a demand is satisfied by readiness: never stale
        if state.mode is Mode.STOPPED and state.stop_reason is StopReason.EVICT:
            self.evicted = True
        if self.mode.value is not state.mode:
            self._note(f"mode {state.mode}")
            self.mode.value = state.mode
        target = (descriptor_lifecycle(state.mode, self.stop_reason), self.stop_reason)
        if self._persisted != target:
            if self._spawn_writes(target):
                self._persisted = target
            else:
                self._persist()
        self._changed.value += 1

    def _spawn_writes(self, target: tuple[Mode, StopReason]) -> bool:
        """Is the ``starting`` descriptor left to the spawn that follows? Every spawn writes
        the descriptor itself (``starting``, with the new worker's pid) and waits for it to
        be durable before the worker's gate opens. A write here, of the same lifecycle with
        the old worker's pid, would be a second commit on the respawn's path: the spawn's
        commit waits for it. It changes nothing a successor reads: the descriptor already
        records a worker that is wanted and (whatever its pid) dead or being replaced, which
        a successor respawns just the same. When the descriptor says stopped or failed (a
        start on demand, a retry) or an operator's stop, ``starting`` is written now."""
        life, reason = self._persisted
        return (
            target == (Mode.STARTING, StopReason.NONE)
            and reason is StopReason.NONE
            and life not in (Mode.STOPPED, Mode.FAILED)
            and not self._persist_failed
        )

    def _persist(self) -> None:
        """Write the descriptor (adoption by the next supervisor reads it). A write that fails
        (no space) is logged and retried in the background, bounded by
        ``storage_retry_delays``; each retry writes the state of that moment."""
        self._persisted = (descriptor_lifecycle(self.mode.value, self.stop_reason),
                           self.stop_reason)
        try:
            self.ops.persist(self)
        except OSError as exc:
            self._persist_failed = True
            if self._persist_retrying or self._readers is None:
                log.warning("session %s: could not write its descriptor: %s",
                            self.session_id, exc)
                return
            self._persist_retrying = True
            self._readers.start_soon(self._retry_persist, exc)
        else:
            self._persist_failed = False

    async def _retry_persist(self, first: OSError) -> None:
        delays = self.timing.storage_retry_delays
        log.warning("session %s: could not write its descriptor: %s", self.session_id, first)
        try:
            for attempt, delay in enumerate(delays, start=1):
                await trio.sleep(delay)
                if not self._persist_failed:
                    return  # a later write succeeded
                self._note(f"persist retry {attempt}")
                try:
                    self.ops.persist(self)
                except OSError as exc:
                    log.warning("session %s: could not write its descriptor (attempt %d of %d):"
                                " %s", self.session_id, attempt + 1, len(delays) + 1, exc)
                    continue
                self._persist_failed = False
                log.info("session %s: descriptor written after %d retries", self.session_id,
                         attempt)
                return
            log.error("session %s: gave up writing its descriptor after %d attempts; a"
                      " supervisor started later may not adopt its worker — free space, the"
                      " next state change writes it again", self.session_id, len(delays) + 1)
        finally:
            self._persist_retrying = False

    def _note(self, what: str) -> None:
        self.log.append((trio.current_time(), what))
        if len(self.log) > 2 * LOG_KEEP:
            del self.log[:-LOG_KEEP]  # bounded: the newest notes only, whatever the uptime
        log.debug("session %s: %s", self.session_id, what)

    def _take_stop(self) -> StopRequested:
        req = self._stop_request or StopRequested()
        self._stop_request = None
        self._stop_event = trio.Event()
        return req

    async def _perform(self, action: Action) -> Observation:
        match action:
            case Connect(timeout=timeout):
                self._note("connect")
                with trio.move_on_after(timeout):
                    return await self._connect()
                self._note("connect timed out")
                return ConnectFailed(alive=self.ops.alive(self))
            case Wait(seconds=seconds):
                self._note(f"wait {seconds:g}")
                await wait_any(functools.partial(trio.sleep, seconds), self._stop_event.wait)
                return self._take_stop() if self._stop_event.is_set() else TimerFired()
            case Serve():
                link = self.link
                assert link is not None
                self._note("ready")
                with link.cancelled_on_close():  # the link's end, or a stop
                    await self._stop_event.wait()
                if self._stop_event.is_set():
                    return self._take_stop()
                self.link = None
                await link.aclose()
                self.unresponsive = link.unresponsive
                self._note("link lost" if link.unresponsive is None else "worker unresponsive")
                clean = link.drop_code == ErrorCode.WORKER_STOPPED
                if clean:
                    log.info("session %s: worker pid %s %s — the session is stopped, not"
                             " restarted; its next prompt starts it", self.session_id,
                             self.pid, link.drop_reason)
                # (liveness treats a process that is already exiting as dead: a killed
                # worker's socket closes a moment before it becomes a zombie)
                return LinkLost(alive=self.ops.alive(self), clean_stop=clean)
            case Stop(graceful=graceful):
                link = self.link
                evict = self.state.stop_reason is StopReason.EVICT and link is not None
                if evict and link is not None and await self._busy_declines_eviction(link):
                    self._note("eviction declined: a turn is running or queued")
                    return StopDeclined()
                return await self._stop(graceful=graceful)
            case Spawn(timeout=timeout):
                self._spawn_failure = ""
                async with self.spawn_limiter or contextlib.nullcontext():
                    # the start's own deadline counts from its slot, not from the queue
                    self._note("spawn")
                    with trio.move_on_after(timeout):
                        if await self._spawn():
                            return Spawned()
                # failed or not ready in time: make sure it is gone before anything else
                outcome = await self._stop(graceful=False)
                return SpawnFailed(self._spawn_failure) if outcome.confirmed else outcome
            case Idle():
                await wait_any(self._demand.wait, self._stop_event.wait)
                if self._stop_event.is_set():
                    return self._take_stop()
                self._demand = trio.Event()  # consumed
                return Demand()
            case Fail():
                self._note("failed")
                await wait_any(self._retry.wait, self._stop_event.wait)
                if self._stop_event.is_set():
                    return self._take_stop()
                self._retry = trio.Event()  # consumed
                return Retry()
            case _:
                assert_never(action)

    async def _connect(self) -> Observation:
        """One attempt (the caller bounds it); a refusal is reported at once: the delays
        between attempts are the planner's."""
        try:
            self._adopt_link(await self.ops.connect(self))
            return Connected()
        except AgentdError as exc:
            self._note(f"connect failed: {exc.message}")
            return ConnectFailed(alive=self.ops.alive(self))

    async def _spawn(self) -> bool:
        """Start a worker and connect to it (the caller bounds it)."""
        try:
            await self.ops.spawn(self)
            self._adopt_link(await self.ops.connect(self))
        except AgentdError as exc:
            self._note(f"spawn failed: {exc.message}")
            if exc.code == ErrorCode.AGENT_FAILED:
                log.error("session %s: %s", self.session_id, exc.message)
                self._spawn_failure = exc.message
            return False
        self._note(f"spawned pid {self.pid}")
        return True

    def _adopt_link(self, link: WorkerLink) -> None:
        """Make ``link`` current; its reader runs in the handle's nursery for the link's life."""
        self.link = link
        # a worker of the session ran: its start recorded the creating client's environment
        # in the session's metadata, which every later start reads; a few KB less a session
        self.env = None
        self.worker_version = link.hello.app_version
        self.worker_protocol = link.hello.protocol
        self.unresponsive = None
        link.on_notice = self._on_notice
        assert self._readers is not None
        self._readers.start_soon(link.run_reader)
        self._readers.start_soon(functools.partial(
            link.watch_liveness, interval=self.timing.link_ping_interval,
            ping_timeout=self.timing.link_ping_timeout,
            idle_interval=self.timing.link_idle_ping_interval,
        ))

    def _on_notice(self, notice: Notice) -> None:
        """The worker ran a turn for a client on a direct route: keep count and activity."""
        self.turns = max(self.turns, notice.turn)
        self.busy = notice.kind == "turn_started"
        if notice.kind == "turn_done" and notice.failure != self.agent_failure:
            self.agent_failure = notice.failure
            self._persist()  # a successor supervisor shows it too
        self.last_prompt = trio.current_time()  # idle counts from the end of the last turn
        self.evicted = False

    async def _busy_declines_eviction(self, link: WorkerLink) -> bool:
        """Ask the worker to stop only if no turn is running or queued (one request: the
        worker decides, so a prompt that just reached it on a direct route is never cut).
        ``True``: it declined and keeps serving."""
        with trio.move_on_after(self.timing.status_timeout):
            with contextlib.suppress(WorkerDropped, AgentdError):
                response = await link.call(
                    "stop", {"reason": str(StopReason.EVICT), "if_idle": True},
                    client_id="supervisor",
                )
                result = response.result if response.ok else None
                if isinstance(result, dict) and result.get("stopping") is False:
                    # activity now: the next sweep asks again no sooner than idle_eviction
                    # (``busy`` stays the notices' to set: a lost notice never pins it)
                    self.last_prompt = trio.current_time()
                    return True
        return False

    async def _graceful_stop(self, link: WorkerLink, batch: StopBatch | None) -> None:
        deadline = (batch.deadline if batch is not None
                    else trio.current_time() + self.timing.stop_grace)
        with trio.move_on_at(deadline):
            try:
                with contextlib.suppress(WorkerDropped, AgentdError):
                    # a kill: the worker ends its turns at once, each answered session_killed
                    await link.call("stop", {"reason": str(self.state.stop_reason)},
                                    client_id="supervisor")
            finally:
                if batch is not None:
                    batch.told(self)
            if batch is not None:
                await batch.wait_all_told()  # every worker of the batch told before any wait
            await self.ops.wait_exit(self)

    async def _stop(self, *, graceful: bool) -> Stopped:
        """TERM the worker's group, ``stop_grace``, KILL, confirm exit; identity-checked.

        Cancellation: shielded (each wait inside is bounded): a stop always completes.
        """
        with trio.CancelScope(shield=True):
            return await self._stop_now(graceful=graceful)
        raise AssertionError("unreachable: a shielded scope swallows nothing")

    async def _stop_now(self, *, graceful: bool) -> Stopped:
        batch, self._stop_batch = self._stop_batch, None
        try:
            return await self._stop_told(graceful=graceful, batch=batch)
        finally:
            if batch is not None:
                batch.told(self)  # nothing (more) to tell: never hold the others up

    async def _stop_told(self, *, graceful: bool, batch: StopBatch | None) -> Stopped:
        # the stop's intent (descriptor ``stopping``) is on disk before anything acts on it
        await self.ops.durable()
        if self.link is not None:
            if graceful:
                await self._graceful_stop(self.link, batch)
            with trio.move_on_after(LINK_CLOSE_TIMEOUT):
                await self.link.aclose()
            self.link = None
        if self.pid is None or not self.ops.alive(self):
            self._note("stopped")
            return Stopped(confirmed=True)
        self._note("term")
        self.ops.signal(self, signal.SIGTERM)
        if batch is not None:
            batch.told(self)
            await batch.wait_all_told()
        with trio.move_on_after(self.timing.stop_grace):
            await self.ops.wait_exit(self)
        if not self.ops.alive(self):
            self._note("stopped")
            return Stopped(confirmed=True)
        self._note("kill")
        self.ops.signal(self, signal.SIGKILL)
        with trio.move_on_after(self.timing.kill_confirm_timeout):
            await self.ops.wait_exit(self)
        confirmed = not self.ops.alive(self)
        self._note("stopped" if confirmed else "survived kill")
        return Stopped(confirmed=confirmed)

