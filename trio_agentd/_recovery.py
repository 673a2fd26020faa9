"""The recovery planner: what the supervisor does next for one session's worker. Pure.

Theory of operation
-------------------
Each session is supervised by one task that alternates between *doing* an :data:`Action` and
*observing* its outcome as an :data:`Observation`. :func:`decide` maps ``(state, observation,
now)`` to ``(state, action)``; it reads no clock and does no I/O, so the recovery schedule is
tested with plain asserts and, through the shell, on MockClock.

:func:`decide` is a transition table: one column per kind of observation (``ON_START``,
``ON_LINK_LOST``, ...) that names, for each mode the observation can arrive in, the
:class:`Rule` that applies; a pair without a rule raises :class:`IllegalObservation`. Each rule
declares the (mode, action) pairs it may return, and docs/design.md prints the whole table
(:func:`transition_table_markdown`).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar, assert_never, get_args

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


class IllegalObservation(Exception):
    """The shell fed the planner an observation its current mode cannot produce.

    No action of the table yields it in that mode (a ``TimerFired`` while ``ready``, a
    ``Connected`` while ``stopped``): the shell and the table disagree, which is a bug, never
    a runtime condition to paper over with a guess.
    """

    def __init__(self, mode: Mode, obs: Observation, why: str = "") -> None:
        self.mode, self.observation = mode, obs
        super().__init__(f"recovery planner: {type(obs).__name__} is illegal in mode"
                         f" {mode.value!r}{': ' + why if why else ''}")


@dataclass(frozen=True, slots=True)
class _Ctx:
    now: float
    timing: Timing
    admission_held: bool


Outcome = tuple[RecoveryState, Action]
O = TypeVar("O", bound=Observation)  # noqa: E741
O_contra = TypeVar("O_contra", bound=Observation, contravariant=True)


@dataclass(frozen=True, slots=True)
class Rule(Generic[O_contra]):
    """One cell of the transition table: how an observation moves a state, and what can follow.

    ``outcomes`` are the (mode, action) pairs :attr:`apply` may return; the docs print them
    and the tests hold :func:`decide` to them.
    """

    name: str
    summary: str
    outcomes: frozenset[tuple[Mode, type[Action]]]
    apply: Callable[[RecoveryState, O_contra, _Ctx], Outcome]


def _rule(
    summary: str, *outcomes: tuple[Mode, type[Action]]
) -> Callable[[Callable[[RecoveryState, O, _Ctx], Outcome]], Rule[O]]:
    def make(fn: Callable[[RecoveryState, O, _Ctx], Outcome]) -> Rule[O]:
        return Rule(name=fn.__name__.strip("_"), summary=summary,
                    outcomes=frozenset(outcomes), apply=fn)
    return make


_RESPAWN_OUTCOMES = ((Mode.STARTING, Spawn), (Mode.RECOVERING, Wait), (Mode.FAILED, Fail))
_STOP_OUTCOMES = ((Mode.STOPPING, Stop), (Mode.RECOVERING, Wait))


@_rule("fail, finish a recorded stop, adopt a live worker, start a wanted one, or idle",
       (Mode.FAILED, Fail), (Mode.STOPPING, Stop), (Mode.STOPPED, Idle),
       (Mode.ADOPTING, Connect), *_RESPAWN_OUTCOMES)
def _start(state: RecoveryState, obs: Start, c: _Ctx) -> Outcome:
    if obs.failed:
        return replace(state, mode=Mode.FAILED), Fail()
    if obs.stop_reason is not StopReason.NONE:
        # a predecessor wrote this stop and died before it was done: finish it; the
        # worker is never adopted, respawned or counted as a crash
        if obs.alive:
            return _stop(replace(state, stop_wanted=True, stop_reason=obs.stop_reason),
                         c.timing, c.admission_held, graceful=False)
        return replace(state, mode=Mode.STOPPED, stop_reason=obs.stop_reason), Idle()
    if obs.alive:
        return replace(state, mode=Mode.ADOPTING), Connect(c.timing.adopt_connect_timeout)
    if obs.wanted:
        return _respawn(state, c.now, c.timing, c.admission_held)
    return replace(state, mode=Mode.STOPPED), Idle()


@_rule("serve, with the episode's counters reset (a stop wanted meanwhile: stop)",
       (Mode.READY, Serve), *_STOP_OUTCOMES)
def _ready(state: RecoveryState, obs: Connected | Spawned, c: _Ctx) -> Outcome:
    if state.stop_wanted:
        # a stop arrived while this action ran: honour it before anything else
        return _stop(state, c.timing, c.admission_held, graceful=state.graceful)
    return (
        replace(state, mode=Mode.READY, attempts=0, rounds=0, deferred=Pending.NONE),
        Serve(),
    )


@_rule("a stop wanted or a clean stop: stop; dead: respawn; alive: the reconnect schedule",
       *_STOP_OUTCOMES, *_RESPAWN_OUTCOMES)
def _link_lost(state: RecoveryState, obs: LinkLost, c: _Ctx) -> Outcome:
    if state.stop_wanted:
        return _stop(state, c.timing, c.admission_held, graceful=False)
    if obs.clean_stop:
        # stopped by an operator's signal, and said so: make sure it is gone, then the
        # session is stopped (restarts unchanged); the next prompt starts it again
        return _stop(replace(state, stop_wanted=True, stop_reason=StopReason.NONE),
                     c.timing, c.admission_held, graceful=False)
    if not obs.alive:
        return _respawn(state, c.now, c.timing, c.admission_held)
    return _next_reconnect(replace(state, attempts=0, rounds=0), c.timing, c.admission_held)


@_rule("a stop wanted: stop; dead: respawn; alive: the next step of the reconnect schedule",
       *_STOP_OUTCOMES, *_RESPAWN_OUTCOMES)
def _connect_failed(state: RecoveryState, obs: ConnectFailed, c: _Ctx) -> Outcome:
    if state.stop_wanted:
        return _stop(state, c.timing, c.admission_held, graceful=False)
    if not obs.alive:
        return _respawn(state, c.now, c.timing, c.admission_held)
    if state.mode is Mode.ADOPTING:
        return _next_reconnect(replace(state, attempts=0, rounds=0), c.timing, c.admission_held)
    return _next_reconnect(state, c.timing, c.admission_held)


@_rule("run the deferred stop or respawn, else the next reconnect attempt or deferred round",
       (Mode.RECOVERING, Connect), *_STOP_OUTCOMES, *_RESPAWN_OUTCOMES)
def _timer(state: RecoveryState, obs: TimerFired, c: _Ctx) -> Outcome:
    if state.stop_wanted:
        return _stop(state, c.timing, c.admission_held, graceful=state.graceful)
    if state.deferred is Pending.STOP:
        return _stop(state, c.timing, c.admission_held, graceful=state.graceful)
    if state.deferred is not Pending.NONE:
        return _respawn(state, c.now, c.timing, c.admission_held,
                        count=state.deferred is Pending.RESPAWN)
    if state.attempts < len(c.timing.worker_retry_delays):
        return replace(state, attempts=state.attempts + 1), Connect(
            c.timing.adopt_connect_timeout)
    return replace(state, rounds=state.rounds + 1), Connect(c.timing.adopt_connect_timeout)


@_rule("unconfirmed: failed (never a second worker beside it); a stop wanted: stopped;"
       " else respawn", (Mode.FAILED, Fail), (Mode.STOPPED, Idle), *_RESPAWN_OUTCOMES)
def _stopped(state: RecoveryState, obs: Stopped, c: _Ctx) -> Outcome:
    if not obs.confirmed:
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
    return _respawn(state, c.now, c.timing, c.admission_held)


@_rule("a stop wanted: stopped; the agent cannot load: failed with its cause; else respawn",
       (Mode.STOPPED, Idle), *_RESPAWN_OUTCOMES)
def _spawn_failed(state: RecoveryState, obs: SpawnFailed, c: _Ctx) -> Outcome:
    if state.stop_wanted:
        return replace(state, mode=Mode.STOPPED, stop_wanted=False), Idle()
    if obs.cause:
        return replace(state, mode=Mode.FAILED, deferred=Pending.NONE, failure=obs.cause,
                       agent_failed=True), Fail()
    return _respawn(state, c.now, c.timing, c.admission_held)


@_rule("start it, uncounted (a killed session stays stopped: it is forgotten)",
       (Mode.STOPPED, Idle), (Mode.STARTING, Spawn), (Mode.RECOVERING, Wait))
def _demand(state: RecoveryState, obs: Demand, c: _Ctx) -> Outcome:
    if state.stop_reason is StopReason.KILL:
        # (a killed session is never started again: it is forgotten, and a prompt
        # for it creates a new one)
        return state, Idle()
    return _respawn(state, c.now, c.timing, c.admission_held, count=False)


@_rule("nothing changes: keep serving, or the verdict stands",
       (Mode.READY, Serve), (Mode.FAILED, Fail))
def _unchanged(state: RecoveryState, obs: Demand | TimerFired, c: _Ctx) -> Outcome:
    return state, _current_action(state)


@_rule("an eviction declined: ready again; a kill or shutdown meanwhile: stop",
       (Mode.READY, Serve), (Mode.STOPPING, Stop))
def _declined(state: RecoveryState, obs: StopDeclined, c: _Ctx) -> Outcome:
    if state.stop_reason is StopReason.EVICT:
        return replace(state, mode=Mode.READY, stop_wanted=False,
                       stop_reason=StopReason.NONE, deferred=Pending.NONE), Serve()
    if state.stop_wanted:
        # a kill or shutdown arrived while the worker declined the eviction
        return _stop(state, c.timing, c.admission_held, graceful=state.graceful)
    raise IllegalObservation(state.mode, obs, "a worker declines only an eviction")


@_rule("re-arm with the window cleared: stop a survivor first, else start it, uncounted",
       (Mode.STOPPING, Stop), (Mode.STARTING, Spawn), (Mode.RECOVERING, Wait))
def _retry(state: RecoveryState, obs: Retry, c: _Ctx) -> Outcome:
    state = replace(state, respawns=(), failure="", agent_failed=False)
    if state.unconfirmed:
        # try to stop the survivor first; a respawn follows a confirmed stop
        return _stop(state, c.timing, False, graceful=False)
    return _respawn(state, c.now, c.timing, c.admission_held, count=False)


@_rule("the restart window is cleared; nothing runs", (Mode.STOPPED, Idle))
def _rearm(state: RecoveryState, obs: Retry, c: _Ctx) -> Outcome:
    return replace(state, respawns=()), Idle()


@_rule("stop it and do not respawn (nothing runs: stopped; a kill marks it, an eviction is moot)",
       (Mode.STOPPING, Stop), (Mode.STOPPED, Idle), (Mode.FAILED, Fail))
def _stop_requested(state: RecoveryState, obs: StopRequested, c: _Ctx) -> Outcome:
    reason = obs.reason
    if state.mode is Mode.STOPPED or (state.mode is Mode.FAILED and not state.unconfirmed):
        if reason is StopReason.EVICT:
            return state, _current_action(state)  # nothing runs: nothing to evict
        # (nothing to stop; a kill still marks it: it is forgotten, never restarted)
        kept = reason if reason is StopReason.KILL else state.stop_reason
        return replace(state, mode=Mode.STOPPED, stop_wanted=False, failure="",
                       agent_failed=False, stop_reason=kept), Idle()
    if state.stop_wanted and state.stop_reason is StopReason.KILL:
        reason = StopReason.KILL  # a kill is never weakened by a later stop
    return _stop(replace(state, stop_wanted=True, graceful=obs.graceful, stop_reason=reason),
                 c.timing, c.admission_held, graceful=obs.graceful)


# --- the transition table --------------------------------------------------------------------
# One column per observation: the modes in which the shell can observe it, and the rule that
# applies. A (mode, observation) pair absent from its column is illegal. Which observations an
# action yields: Connect → Connected | ConnectFailed; Wait → TimerFired | StopRequested;
# Serve → LinkLost | StopRequested; Stop → Stopped | StopDeclined; Spawn → Spawned |
# SpawnFailed | Stopped (an unconfirmed stop of a spawn that failed); Idle → Demand |
# StopRequested; Fail → Retry | StopRequested. A stop that arrives during an action that cannot
# be interrupted is folded into the state (``stop_wanted``), which is why STOPPING also takes the
# outcomes of the actions a stop may overtake.

_M = Mode
ON_START: Mapping[Mode, Rule[Start]] = {_M.STOPPED: _start}
ON_CONNECTED: Mapping[Mode, Rule[Connected]] = {
    _M.ADOPTING: _ready, _M.RECOVERING: _ready, _M.STARTING: _ready}
ON_CONNECT_FAILED: Mapping[Mode, Rule[ConnectFailed]] = {
    _M.ADOPTING: _connect_failed, _M.RECOVERING: _connect_failed, _M.STOPPING: _connect_failed}
ON_LINK_LOST: Mapping[Mode, Rule[LinkLost]] = {_M.READY: _link_lost, _M.STOPPING: _link_lost}
ON_TIMER_FIRED: Mapping[Mode, Rule[TimerFired]] = {
    _M.RECOVERING: _timer, _M.FAILED: _unchanged}
ON_STOPPED: Mapping[Mode, Rule[Stopped]] = {_M.STOPPING: _stopped, _M.STARTING: _stopped}
ON_SPAWNED: Mapping[Mode, Rule[Spawned]] = {
    _M.STARTING: _ready, _M.ADOPTING: _ready, _M.RECOVERING: _ready}
ON_SPAWN_FAILED: Mapping[Mode, Rule[SpawnFailed]] = {
    _M.STARTING: _spawn_failed, _M.STOPPING: _spawn_failed}
ON_DEMAND: Mapping[Mode, Rule[Demand]] = {
    _M.STOPPED: _demand, _M.READY: _unchanged, _M.FAILED: _unchanged}
ON_RETRY: Mapping[Mode, Rule[Retry]] = {_M.FAILED: _retry, _M.STOPPED: _rearm}
ON_STOP_REQUESTED: Mapping[Mode, Rule[StopRequested]] = dict.fromkeys(Mode, _stop_requested)
ON_STOP_DECLINED: Mapping[Mode, Rule[StopDeclined]] = {_M.STOPPING: _declined}


def column(kind: type[Observation]) -> Mapping[Mode, Rule[Any]]:
    """The table's column for one kind of observation (for the docs and the tests)."""
    columns: dict[type[Observation], Mapping[Mode, Rule[Any]]] = {
        Start: ON_START, Connected: ON_CONNECTED, ConnectFailed: ON_CONNECT_FAILED,
        LinkLost: ON_LINK_LOST, TimerFired: ON_TIMER_FIRED, Stopped: ON_STOPPED,
        Spawned: ON_SPAWNED, SpawnFailed: ON_SPAWN_FAILED, Demand: ON_DEMAND, Retry: ON_RETRY,
        StopRequested: ON_STOP_REQUESTED, StopDeclined: ON_STOP_DECLINED,
    }
    return columns[kind]


def _apply(
    col: Mapping[Mode, Rule[O]], state: RecoveryState, obs: O, c: _Ctx
) -> Outcome:
    rule = col.get(state.mode)
    if rule is None:
        raise IllegalObservation(state.mode, obs)
    return rule.apply(state, obs, c)


def decide(
    state: RecoveryState,
    obs: Observation,
    now: float,
    timing: Timing,
    *,
    admission_held: bool = False,
) -> tuple[RecoveryState, Action]:
    """The next state and action after ``obs`` at time ``now``: the table's cell for
    ``(state.mode, obs)``.

    Raises:
        IllegalObservation: the table has no cell for that pair (a bug of the shell).
    """
    c = _Ctx(now=now, timing=timing, admission_held=admission_held)
    match obs:
        case Start():
            return _apply(ON_START, state, obs, c)
        case Connected():
            return _apply(ON_CONNECTED, state, obs, c)
        case ConnectFailed():
            return _apply(ON_CONNECT_FAILED, state, obs, c)
        case LinkLost():
            return _apply(ON_LINK_LOST, state, obs, c)
        case TimerFired():
            return _apply(ON_TIMER_FIRED, state, obs, c)
        case Stopped():
            return _apply(ON_STOPPED, state, obs, c)
        case Spawned():
            return _apply(ON_SPAWNED, state, obs, c)
        case SpawnFailed():
            return _apply(ON_SPAWN_FAILED, state, obs, c)
        case Demand():
            return _apply(ON_DEMAND, state, obs, c)
        case Retry():
            return _apply(ON_RETRY, state, obs, c)
        case StopRequested():
            return _apply(ON_STOP_REQUESTED, state, obs, c)
        case StopDeclined():
            return _apply(ON_STOP_DECLINED, state, obs, c)
        case _:
            assert_never(obs)


def transition_table_markdown() -> str:
    """The transition table as docs/design.md prints it (a unit test keeps the two equal):
    the matrix of rules by mode and observation (``·``: illegal), then what each rule does."""
    kinds: tuple[type[Observation], ...] = get_args(Observation)
    lines = ["| mode | " + " | ".join(f"`{k.__name__}`" for k in kinds) + " |",
             "| --- " * (len(kinds) + 1) + "|"]
    rules: dict[str, Rule[Any]] = {}
    for mode in Mode:
        cells = []
        for kind in kinds:
            rule = column(kind).get(mode)
            if rule is not None:
                rules.setdefault(rule.name, rule)
            cells.append("·" if rule is None else rule.name)
        lines.append(f"| `{mode.value}` | " + " | ".join(cells) + " |")
    lines += ["", "| rule | what it does | next (mode → action) |", "| --- | --- | --- |"]
    for name, rule in rules.items():
        nexts = ", ".join(sorted(f"{m.value} → {a.__name__}" for m, a in rule.outcomes))
        lines.append(f"| `{name}` | {rule.summary} | {nexts} |")
    return "\n".join(lines)


def _current_action(state: RecoveryState) -> Action:
    """The action a mode waits in, for a rule that changes nothing."""
    match state.mode:
        case Mode.READY:
            return Serve()
        case Mode.FAILED:
            return Fail()
        case Mode.STOPPED:
            return Idle()
        case Mode.STARTING | Mode.ADOPTING | Mode.RECOVERING | Mode.STOPPING:
            # no rule keeps these modes unchanged: each waits on an action in flight
            raise AssertionError(f"no action to wait in for mode {state.mode.value!r}")
        case _:
            assert_never(state.mode)


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
