"""The recovery planner: what the supervisor does next for one session's worker. Pure.

Theory of operation
-------------------
Each session is supervised by one task that alternates between *doing* an :data:`Action` and
*observing* its outcome as an :data:`Observation`. :func:`decide` maps ``(state, observation,
now)`` to ``(state, action)``; it reads no clock and does no I/O, so the recovery schedule is
tested with plain asserts and, through the shell, on MockClock.

The schedule, when a worker connection drops:

* process dead → respawn at once (subject to the restart intensity);
* process alive → reconnect after ``worker_retry_delays`` (0.25 s, 1 s, 5 s), each attempt
  bounded by ``adopt_connect_timeout``;
* still unreachable → deferred recovery: probe every ``deferred_recovery_recheck`` for at most
  ``max_deferred_recovery_rounds``;
* then stop it (TERM to its group, ``stop_grace``, KILL, confirm exit) and respawn; a fresh
  worker has ``worker_connect_timeout`` to become ready.

More than ``restart_intensity`` respawns within ``restart_window`` marks the session ``failed``
until ``retry``. Respawns and stops defer while a shutdown admission is held.

Stops are intents, and intents are durable. An operator's stop carries its
:class:`StopReason` (``kill``, ``evict``, ``shutdown``); the shell writes it into the
descriptor (lifecycle ``stopping``) before the worker is told or signalled. A successor that
loads such a descriptor starts with ``Start(stop_reason=...)``: it finishes the stop (a live
worker is stopped, identity-checked) and never adopts, respawns or counts it as a crash. A
``stopping`` descriptor without a reason is recovery's own stop (or an older version's) and is
adopted as before. A killed session stays stopped whatever asks for it: the supervisor forgets
it, and a later prompt creates the session anew. An eviction is conditional: a worker with a
turn running or queued declines it (:class:`StopDeclined`) and the session stays ready.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from .timing import Timing


class Mode(enum.StrEnum):
    """What the session's worker is doing; also the descriptor lifecycle and `sessions` state."""

    STOPPED = "stopped"  # no worker wanted now; the next prompt starts one
    STARTING = "starting"  # spawning a fresh worker
    ADOPTING = "adopting"  # reconnecting to a live worker found at supervisor start
    READY = "ready"
    RECOVERING = "recovering"  # reconnect attempts, then deferred rounds
    STOPPING = "stopping"
    FAILED = "failed"


class StopReason(enum.StrEnum):
    """Why an operator's stop was asked for; written to the descriptor with ``stopping``."""

    NONE = ""  # no operator's stop (recovery's own stop has none)
    KILL = "kill"  # `trio-agentd kill SESSION`: the session is forgotten once stopped
    EVICT = "evict"  # the idle sweep: the session stays, evicted; its next prompt respawns it
    SHUTDOWN = "shutdown"  # `trio-agentd shutdown` stopping every worker


# --- observations ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """The supervisor found this session (descriptor) or created it."""

    alive: bool  # a worker process with the recorded identity is running
    wanted: bool  # it should run now (not stopped / evicted / failed)
    failed: bool = False
    # the descriptor recorded an operator's stop in progress (lifecycle stopping): finish it
    stop_reason: StopReason = StopReason.NONE


@dataclass(frozen=True, slots=True)
class Connected:
    pass


@dataclass(frozen=True, slots=True)
class ConnectFailed:
    alive: bool


@dataclass(frozen=True, slots=True)
class LinkLost:
    alive: bool
    # the worker said it stopped cleanly (an operator's signal): a stop, never a crash
    clean_stop: bool = False


@dataclass(frozen=True, slots=True)
class TimerFired:
    pass


@dataclass(frozen=True, slots=True)
class Stopped:
    confirmed: bool  # the process is gone (exit confirmed after SIGKILL at the latest)


@dataclass(frozen=True, slots=True)
class Spawned:
    pass


@dataclass(frozen=True, slots=True)
class SpawnFailed:
    # the worker said its agent cannot be loaded (one line): the session fails with it at
    # once, without a respawn, until a Retry (a respawn would fail the same way)
    cause: str = ""


@dataclass(frozen=True, slots=True)
class Demand:
    """A prompt wants this session."""


@dataclass(frozen=True, slots=True)
class Retry:
    """`trio-agentd retry SESSION`: re-arm a failed session."""


@dataclass(frozen=True, slots=True)
class StopRequested:
    """kill / eviction / shutdown: stop the worker and do not respawn it."""

    graceful: bool = True
    reason: StopReason = StopReason.SHUTDOWN


@dataclass(frozen=True, slots=True)
class StopDeclined:
    """The worker declined an eviction: a turn is running or queued. It keeps serving."""


Observation = (
    Start | Connected | ConnectFailed | LinkLost | TimerFired | Stopped | Spawned | SpawnFailed
    | Demand | Retry | StopRequested | StopDeclined
)

# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connect:
    timeout: float


@dataclass(frozen=True, slots=True)
class Wait:
    seconds: float


@dataclass(frozen=True, slots=True)
class Serve:
    """Connected: route commands until the link drops (→ LinkLost) or a stop is requested."""


@dataclass(frozen=True, slots=True)
class Stop:
    graceful: bool  # ask the worker to stop over its link before TERM


@dataclass(frozen=True, slots=True)
class Spawn:
    timeout: float  # start gate to authenticated link


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to do until a Demand (or StopRequested)."""


@dataclass(frozen=True, slots=True)
class Fail:
    """Marked failed: nothing to do until a Retry."""


Action = Connect | Wait | Serve | Stop | Spawn | Idle | Fail


class Pending(enum.StrEnum):
    NONE = ""
    STOP = "stop"
    RESPAWN = "respawn"  # a crash respawn: counts toward the restart intensity
    START = "start"  # a start on demand or after retry: does not count


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryState:
    mode: Mode = Mode.STOPPED
    attempts: int = 0  # reconnect attempts made in this recovery episode
    rounds: int = 0  # deferred probe rounds made
    respawns: tuple[float, ...] = ()  # times of recent respawns (within the window)
    restarts_total: int = 0  # every crash respawn since the session was loaded
    stop_wanted: bool = False  # a stop was requested: do not respawn after it
    deferred: Pending = Pending.NONE  # an action postponed by a held shutdown admission
    graceful: bool = False
    unconfirmed: bool = False  # a worker survived our SIGKILL: it may still run
    failure: str = ""  # why the session is FAILED, for humans
    agent_failed: bool = False  # FAILED because its agent cannot be loaded (fix it, retry)
    # the operator's stop wanted or done (kept once STOPPED: evicted, or killed), until the
    # session is started again
    stop_reason: StopReason = StopReason.NONE


def decide(
    state: RecoveryState,
    obs: Observation,
    now: float,
    timing: Timing,
    *,
    admission_held: bool = False,
) -> tuple[RecoveryState, Action]:
    """The next state and action after ``obs`` at time ``now``."""
    if state.stop_wanted and isinstance(obs, Connected | Spawned | TimerFired):
        # a stop arrived while this action ran: honour it before anything else
        return _stop(state, timing, admission_held, graceful=state.graceful)
    match obs:
        case Start(alive=alive, wanted=wanted, failed=failed, stop_reason=reason):
            if failed:
                return replace(state, mode=Mode.FAILED), Fail()
            if reason is not StopReason.NONE:
                # a predecessor wrote this stop and died before it was done: finish it; the
                # worker is never adopted, respawned or counted as a crash
                if alive:
                    return _stop(replace(state, stop_wanted=True, stop_reason=reason),
                                 timing, admission_held, graceful=False)
                return replace(state, mode=Mode.STOPPED, stop_reason=reason), Idle()
            if alive:
                return replace(state, mode=Mode.ADOPTING), Connect(timing.adopt_connect_timeout)
            if wanted:
                return _respawn(state, now, timing, admission_held)
            return replace(state, mode=Mode.STOPPED), Idle()
        case Connected() | Spawned():
            return (
                replace(state, mode=Mode.READY, attempts=0, rounds=0, deferred=Pending.NONE),
                Serve(),
            )
        case LinkLost(alive=alive, clean_stop=clean_stop):
            if state.stop_wanted:
                return _stop(state, timing, admission_held, graceful=False)
            if clean_stop:
                # stopped by an operator's signal, and said so: make sure it is gone, then the
                # session is stopped (restarts unchanged); the next prompt starts it again
                return _stop(replace(state, stop_wanted=True, stop_reason=StopReason.NONE),
                             timing, admission_held, graceful=False)
            if not alive:
                return _respawn(state, now, timing, admission_held)
            return _next_reconnect(replace(state, attempts=0, rounds=0), timing, admission_held)
        case ConnectFailed(alive=alive):
            if state.stop_wanted:
                return _stop(state, timing, admission_held, graceful=False)
            if not alive:
                return _respawn(state, now, timing, admission_held)
            if state.mode is Mode.ADOPTING:
                return _next_reconnect(
                    replace(state, attempts=0, rounds=0), timing, admission_held
                )
            return _next_reconnect(state, timing, admission_held)
        case TimerFired():
            if state.deferred is Pending.STOP:
                return _stop(state, timing, admission_held, graceful=state.graceful)
            if state.deferred is not Pending.NONE:
                return _respawn(state, now, timing, admission_held,
                                count=state.deferred is Pending.RESPAWN)
            if state.mode is Mode.RECOVERING:
                if state.attempts < len(timing.worker_retry_delays):
                    return replace(state, attempts=state.attempts + 1), Connect(
                        timing.adopt_connect_timeout
                    )
                return replace(state, rounds=state.rounds + 1), Connect(
                    timing.adopt_connect_timeout
                )
            return state, Idle() if state.mode is Mode.STOPPED else Fail()
        case Stopped(confirmed=confirmed):
            if not confirmed:
                # never start a second worker beside one we could not stop
                return replace(
                    state, mode=Mode.FAILED, deferred=Pending.NONE, unconfirmed=True,
                    stop_wanted=False,
                    failure="its worker survived SIGKILL; stop it by hand, then retry",
                ), Fail()
            state = replace(state, unconfirmed=False)
            if state.stop_wanted:
                return (
                    replace(state, mode=Mode.STOPPED, stop_wanted=False, deferred=Pending.NONE),
                    Idle(),
                )
            return _respawn(state, now, timing, admission_held)
        case SpawnFailed(cause=cause):
            if state.stop_wanted:
                return replace(state, mode=Mode.STOPPED, stop_wanted=False), Idle()
            if cause:
                return replace(state, mode=Mode.FAILED, deferred=Pending.NONE, failure=cause,
                               agent_failed=True), Fail()
            return _respawn(state, now, timing, admission_held)
        case Demand():
            if state.mode is Mode.STOPPED and state.stop_reason is not StopReason.KILL:
                # (a killed session is never started again: it is forgotten, and a prompt
                # for it creates a new one)
                return _respawn(state, now, timing, admission_held, count=False)
            return state, _current_action(state)
        case StopDeclined():
            if state.mode is Mode.STOPPING and state.stop_reason is StopReason.EVICT:
                return replace(state, mode=Mode.READY, stop_wanted=False,
                               stop_reason=StopReason.NONE, deferred=Pending.NONE), Serve()
            if state.stop_wanted:
                # a kill or shutdown arrived while the worker declined the eviction
                return _stop(state, timing, admission_held, graceful=state.graceful)
            return state, _current_action(state)
        case Retry():
            if state.mode is Mode.FAILED:
                if state.unconfirmed:
                    # try to stop the survivor first; a respawn follows a confirmed stop
                    return _stop(replace(state, respawns=(), failure="", agent_failed=False),
                                 timing, False, graceful=False)
                return _respawn(replace(state, respawns=(), failure="", agent_failed=False),
                                now, timing, admission_held, count=False)
            return replace(state, respawns=()), _current_action(state)
        case StopRequested(graceful=graceful, reason=reason):
            if state.mode is Mode.STOPPED or (state.mode is Mode.FAILED and not state.unconfirmed):
                if reason is StopReason.EVICT:
                    return state, _current_action(state)  # nothing runs: nothing to evict
                # (nothing to stop; a kill still marks it: it is forgotten, never restarted)
                kept = reason if reason is StopReason.KILL else state.stop_reason
                return replace(state, mode=Mode.STOPPED, stop_wanted=False, failure="",
                               agent_failed=False, stop_reason=kept), Idle()
            if state.stop_wanted and state.stop_reason is StopReason.KILL:
                reason = StopReason.KILL  # a kill is never weakened by a later stop
            return _stop(replace(state, stop_wanted=True, graceful=graceful, stop_reason=reason),
                         timing, admission_held, graceful=graceful)


def _current_action(state: RecoveryState) -> Action:
    match state.mode:
        case Mode.READY:
            return Serve()
        case Mode.FAILED:
            return Fail()
        case _:
            return Idle()


def _next_reconnect(
    state: RecoveryState, timing: Timing, admission_held: bool
) -> tuple[RecoveryState, Action]:
    delays = timing.worker_retry_delays
    if state.attempts < len(delays):
        return replace(state, mode=Mode.RECOVERING), Wait(delays[state.attempts])
    if state.rounds < timing.max_deferred_recovery_rounds:
        return replace(state, mode=Mode.RECOVERING), Wait(timing.deferred_recovery_recheck)
    return _stop(state, timing, admission_held, graceful=False)


def _stop(
    state: RecoveryState, timing: Timing, admission_held: bool, *, graceful: bool
) -> tuple[RecoveryState, Action]:
    # an operator's stop (kill, shutdown) is never deferred; recovery's own stop is
    if admission_held and not state.stop_wanted:
        return (
            replace(state, mode=Mode.RECOVERING, deferred=Pending.STOP, graceful=graceful),
            Wait(timing.admission_poll),
        )
    return (
        replace(state, mode=Mode.STOPPING, deferred=Pending.NONE, graceful=graceful),
        Stop(graceful=graceful),
    )


def _respawn(
    state: RecoveryState,
    now: float,
    timing: Timing,
    admission_held: bool,
    *,
    count: bool = True,
) -> tuple[RecoveryState, Action]:
    if admission_held:
        pending = Pending.RESPAWN if count else Pending.START
        return replace(state, mode=Mode.RECOVERING, deferred=pending), Wait(
            timing.admission_poll
        )
    recent = tuple(t for t in state.respawns if now - t < timing.restart_window)
    total = state.restarts_total
    if count:
        if len(recent) >= timing.restart_intensity:
            return replace(
                state, mode=Mode.FAILED, respawns=recent, deferred=Pending.NONE,
                failure=f"restarted more than {timing.restart_intensity} times in"
                f" {timing.restart_window:g}s",
            ), Fail()
        recent = (*recent, now)
        total += 1
    return (
        replace(state, mode=Mode.STARTING, respawns=recent, restarts_total=total, attempts=0,
                rounds=0, deferred=Pending.NONE, stop_reason=StopReason.NONE),
        Spawn(timing.worker_connect_timeout),
    )


def descriptor_lifecycle(mode: Mode, stop_reason: StopReason) -> Mode:
    """The lifecycle a descriptor records: ``stopping`` while an operator's stop is wanted
    (whatever the mode the handle is in until its supervise task acts on it)."""
    if stop_reason is not StopReason.NONE and mode not in (Mode.STOPPED, Mode.FAILED):
        return Mode.STOPPING
    return mode


def idle_victims(
    sessions: list[tuple[str, Mode, float]], *, now: float, idle_eviction: float
) -> list[str]:
    """Sessions whose worker the idle sweep stops: ready and idle for ``idle_eviction``.

    ``sessions`` holds ``(session id, mode, idle seconds)``; ``idle_eviction`` 0 turns it off.
    Only ready workers are evicted: a session in recovery is busy being saved, not idle. Idle
    seconds count from the end of the last turn, and are 0 while a turn runs or is queued
    (:meth:`WorkerHandle.idle_for`); the worker itself declines an eviction that races a turn.
    """
    if idle_eviction <= 0:
        return []
    return [sid for sid, mode, idle in sessions if mode is Mode.READY and idle >= idle_eviction]
