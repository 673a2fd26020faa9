"""The recovery planner (trio_agentd._recovery.decide): pure, no event loop.

Each test feeds observations to :func:`decide` at explicit ``now`` values and asserts the exact
state and action; the Hypothesis properties drive the planner with a small model of the world
(a process that answers, dies, survives a kill) and check the invariants of the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agentd._recovery import (
    Action,
    Connect,
    Connected,
    ConnectFailed,
    Demand,
    Fail,
    Idle,
    LinkLost,
    Mode,
    Observation,
    Pending,
    RecoveryState,
    Retry,
    Serve,
    Spawn,
    Spawned,
    SpawnFailed,
    Start,
    Stop,
    Stopped,
    StopRequested,
    TimerFired,
    Wait,
    decide,
)
from trio_agentd.timing import DEFAULT_TIMING, Timing

T = DEFAULT_TIMING
READY = RecoveryState(mode=Mode.READY)
SPAWN = Spawn(30.0)
ADOPT_CONNECT = Connect(2.0)
POLL = Wait(0.05)


def step(
    state: RecoveryState, obs: Observation, now: float = 0.0, *, held: bool = False,
    timing: Timing = T,
) -> tuple[RecoveryState, Action]:
    return decide(state, obs, now, timing, admission_held=held)


def feed(
    state: RecoveryState, observations: Sequence[tuple[Observation, float]], *, held: bool = False
) -> tuple[RecoveryState, list[tuple[Mode, int, int, Action]]]:
    """Apply ``(observation, now)`` in turn; ``(mode, attempts, rounds, action)`` after each."""
    trace: list[tuple[Mode, int, int, Action]] = []
    for obs, now in observations:
        state, action = step(state, obs, now, held=held)
        trace.append((state.mode, state.attempts, state.rounds, action))
    return state, trace


def crash_and_respawn(state: RecoveryState, now: float) -> tuple[RecoveryState, Action]:
    """The worker of a READY session dies at ``now``: the planner's answer, then (if it spawned)
    the fresh worker becomes ready at the same instant."""
    assert state.mode is Mode.READY
    state, action = step(state, LinkLost(alive=False), now)
    if isinstance(action, Spawn):
        state, served = step(state, Spawned(), now)
        assert served == Serve()
    return state, action


# --- Start -----------------------------------------------------------------------------------


@pytest.mark.parametrize("wanted", [True, False])
def test_start_with_a_live_worker_adopts_it_within_the_adopt_timeout(wanted: bool) -> None:
    state, action = step(RecoveryState(), Start(alive=True, wanted=wanted), 7.0)
    assert action == Connect(timeout=T.adopt_connect_timeout) == ADOPT_CONNECT
    assert state == RecoveryState(mode=Mode.ADOPTING)


def test_start_of_a_wanted_dead_worker_respawns_it_and_counts_the_respawn() -> None:
    state, action = step(RecoveryState(), Start(alive=False, wanted=True), 7.0)
    assert action == Spawn(timeout=T.worker_connect_timeout) == SPAWN
    assert state == RecoveryState(mode=Mode.STARTING, respawns=(7.0,), restarts_total=1)


def test_start_of_an_unwanted_dead_worker_idles() -> None:
    state, action = step(RecoveryState(), Start(alive=False, wanted=False), 7.0)
    assert action == Idle()
    assert state == RecoveryState(mode=Mode.STOPPED)


def test_start_of_a_failed_session_stays_failed() -> None:
    state, action = step(RecoveryState(), Start(alive=False, wanted=True, failed=True), 7.0)
    assert action == Fail()
    assert state == RecoveryState(mode=Mode.FAILED)


def test_start_of_a_wanted_dead_worker_defers_while_admission_is_held() -> None:
    state, action = step(RecoveryState(), Start(alive=False, wanted=True), 7.0, held=True)
    assert action == POLL
    assert state == RecoveryState(mode=Mode.RECOVERING, deferred=Pending.RESPAWN)


# --- ready -----------------------------------------------------------------------------------


@pytest.mark.parametrize("obs", [Connected(), Spawned()])
@pytest.mark.parametrize("mode", [Mode.ADOPTING, Mode.RECOVERING, Mode.STARTING])
def test_connected_or_spawned_is_ready_with_the_episode_counters_reset(
    obs: Observation, mode: Mode
) -> None:
    before = RecoveryState(mode=mode, attempts=3, rounds=4, respawns=(1.0, 2.0),
                           restarts_total=9, deferred=Pending.RESPAWN)
    state, action = step(before, obs, 3.0)
    assert action == Serve()
    assert state == RecoveryState(mode=Mode.READY, respawns=(1.0, 2.0), restarts_total=9)


# --- link lost, reconnect, deferred recovery -------------------------------------------------


def test_dead_worker_is_respawned_at_once_and_counted() -> None:
    state, action = step(READY, LinkLost(alive=False), 12.0)
    assert action == SPAWN
    assert state == RecoveryState(mode=Mode.STARTING, respawns=(12.0,), restarts_total=1)


def test_unreachable_live_worker_reconnects_then_defers_then_is_stopped_and_respawned() -> None:
    # the times of a worker that refuses every connection at once
    observations: list[tuple[Observation, float]] = [
        (LinkLost(alive=True), 0.0),
        (TimerFired(), 0.25), (ConnectFailed(alive=True), 0.25),
        (TimerFired(), 1.25), (ConnectFailed(alive=True), 1.25),
        (TimerFired(), 6.25), (ConnectFailed(alive=True), 6.25),
    ]
    for r in range(1, 11):
        t = 6.25 + 5.0 * r
        observations += [(TimerFired(), t), (ConnectFailed(alive=True), t)]
    state, trace = feed(READY, observations)
    rec = Mode.RECOVERING
    expected: list[tuple[Mode, int, int, Action]] = [
        (rec, 0, 0, Wait(0.25)),
        (rec, 1, 0, ADOPT_CONNECT), (rec, 1, 0, Wait(1.0)),
        (rec, 2, 0, ADOPT_CONNECT), (rec, 2, 0, Wait(5.0)),
        (rec, 3, 0, ADOPT_CONNECT), (rec, 3, 0, Wait(5.0)),
    ]
    for r in range(1, 10):
        expected += [(rec, 3, r, ADOPT_CONNECT), (rec, 3, r, Wait(5.0))]
    # the tenth deferred round fails too: stop it, without asking it (it does not answer)
    expected += [(rec, 3, 10, ADOPT_CONNECT), (Mode.STOPPING, 3, 10, Stop(graceful=False))]
    assert trace == expected
    assert state.restarts_total == 0
    assert state.stop_wanted is False

    state, action = step(state, Stopped(confirmed=True), 56.25)
    assert action == SPAWN
    assert (state.mode, state.attempts, state.rounds) == (Mode.STARTING, 0, 0)
    assert (state.respawns, state.restarts_total) == ((56.25,), 1)


def test_a_reconnect_that_succeeds_ends_the_episode_and_the_next_drop_starts_over() -> None:
    state, trace = feed(READY, [
        (LinkLost(alive=True), 0.0),
        (TimerFired(), 0.25), (ConnectFailed(alive=True), 0.25),
        (TimerFired(), 1.25), (Connected(), 1.25),
        (LinkLost(alive=True), 9.0),
    ])
    assert [action for *_, action in trace] == [
        Wait(0.25), ADOPT_CONNECT, Wait(1.0), ADOPT_CONNECT, Serve(), Wait(0.25)
    ]
    assert trace[4][:3] == (Mode.READY, 0, 0)
    assert (state.mode, state.attempts, state.rounds) == (Mode.RECOVERING, 0, 0)


def test_a_new_drop_during_deferred_rounds_resets_them() -> None:
    mid = RecoveryState(mode=Mode.READY, attempts=3, rounds=7)
    state, action = step(mid, LinkLost(alive=True), 1.0)
    assert action == Wait(0.25)
    assert (state.attempts, state.rounds) == (0, 0)


@pytest.mark.parametrize("mode", [Mode.RECOVERING, Mode.ADOPTING])
def test_a_worker_found_dead_on_connect_is_respawned_and_counted(mode: Mode) -> None:
    state, action = step(RecoveryState(mode=mode, attempts=2), ConnectFailed(alive=False), 4.0)
    assert action == SPAWN
    assert (state.mode, state.respawns, state.restarts_total) == (Mode.STARTING, (4.0,), 1)


def test_a_failed_adoption_starts_the_reconnect_schedule() -> None:
    adopting, _ = step(RecoveryState(), Start(alive=True, wanted=True), 0.0)
    state, trace = feed(adopting, [
        (ConnectFailed(alive=True), 2.0),
        (TimerFired(), 2.25), (ConnectFailed(alive=True), 4.25),
        (TimerFired(), 5.25), (ConnectFailed(alive=True), 7.25),
        (TimerFired(), 12.25), (ConnectFailed(alive=True), 14.25),
        (TimerFired(), 19.25),
    ])
    rec = Mode.RECOVERING
    assert trace == [
        (rec, 0, 0, Wait(0.25)),
        (rec, 1, 0, ADOPT_CONNECT), (rec, 1, 0, Wait(1.0)),
        (rec, 2, 0, ADOPT_CONNECT), (rec, 2, 0, Wait(5.0)),
        (rec, 3, 0, ADOPT_CONNECT), (rec, 3, 0, Wait(5.0)),
        (rec, 3, 1, ADOPT_CONNECT),
    ]
    assert state.restarts_total == 0


# --- stop and respawn ------------------------------------------------------------------------


def test_a_confirmed_stop_of_recovery_respawns() -> None:
    stopping = RecoveryState(mode=Mode.STOPPING, attempts=3, rounds=10)
    state, action = step(stopping, Stopped(confirmed=True), 80.0)
    assert action == SPAWN
    assert state == RecoveryState(mode=Mode.STARTING, respawns=(80.0,), restarts_total=1)


@pytest.mark.parametrize("stop_wanted", [False, True])
def test_an_unconfirmed_stop_fails_the_session_and_never_spawns_beside_it(
    stop_wanted: bool,
) -> None:
    stopping = RecoveryState(mode=Mode.STOPPING, stop_wanted=stop_wanted, rounds=10)
    state, action = step(stopping, Stopped(confirmed=False), 80.0)
    assert action == Fail()
    assert state.mode is Mode.FAILED
    assert (state.respawns, state.restarts_total) == ((), 0)
    # nothing the schedule does on its own wakes it: a timer only repeats the verdict
    assert step(state, TimerFired(), 200.0) == (state, Fail())


def test_a_failed_spawn_is_respawned_and_counted() -> None:
    starting = RecoveryState(mode=Mode.STARTING, respawns=(0.0,), restarts_total=1)
    state, action = step(starting, SpawnFailed(), 30.0)
    assert action == SPAWN
    assert (state.mode, state.respawns, state.restarts_total) == (Mode.STARTING, (0.0, 30.0), 2)


# --- restart intensity -----------------------------------------------------------------------


def _crash_at(times: Sequence[float]) -> tuple[RecoveryState, list[Action]]:
    state, actions = READY, []
    for t in times:
        state, action = crash_and_respawn(state, t)
        actions.append(action)
    return state, actions


def test_the_sixth_counted_respawn_within_the_window_fails_the_session() -> None:
    state, actions = _crash_at([0.0, 10.0, 20.0, 30.0, 40.0])
    assert actions == [SPAWN] * 5
    assert (state.respawns, state.restarts_total) == ((0.0, 10.0, 20.0, 30.0, 40.0), 5)
    state, action = step(state, LinkLost(alive=False), 59.75)
    assert action == Fail()
    assert state.mode is Mode.FAILED
    assert state.restarts_total == 5  # the refused respawn is not a restart


def test_respawns_older_than_the_window_drop_out() -> None:
    state, _ = _crash_at([0.0, 10.0, 20.0, 30.0, 40.0])
    # exactly 60 s after the first one: it has left the window, so this one is allowed
    state, action = crash_and_respawn(state, 60.0)
    assert action == SPAWN
    assert (state.respawns, state.restarts_total) == ((10.0, 20.0, 30.0, 40.0, 60.0), 6)
    # ... but five are inside (10, 70): the next one before 70 fails
    failed, action = step(state, LinkLost(alive=False), 69.5)
    assert action == Fail()
    assert failed.mode is Mode.FAILED
    # at 70 the one at 10 has left
    state, action = crash_and_respawn(state, 70.0)
    assert action == SPAWN
    assert (state.respawns, state.restarts_total) == ((20.0, 30.0, 40.0, 60.0, 70.0), 7)


def test_restarts_total_counts_every_counted_respawn_while_the_window_stays_short() -> None:
    state, actions = _crash_at([15.0 * k for k in range(12)])
    assert actions == [SPAWN] * 12
    assert state.restarts_total == 12
    assert state.respawns == (120.0, 135.0, 150.0, 165.0)


@pytest.mark.parametrize(
    ("mode", "obs"),
    [
        (Mode.READY, LinkLost(alive=False)),
        (Mode.RECOVERING, ConnectFailed(alive=False)),
        (Mode.STARTING, SpawnFailed()),
        (Mode.STOPPING, Stopped(confirmed=True)),
    ],
)
def test_every_kind_of_respawn_counts_toward_the_intensity(mode: Mode, obs: Observation) -> None:
    full = RecoveryState(mode=mode, respawns=(1.0, 2.0, 3.0, 4.0, 5.0), restarts_total=5)
    state, action = step(full, obs, 6.0)
    assert action == Fail()
    assert (state.mode, state.respawns, state.restarts_total) == (
        Mode.FAILED, (1.0, 2.0, 3.0, 4.0, 5.0), 5
    )


# --- demand, retry ---------------------------------------------------------------------------


def test_demand_starts_a_stopped_session_without_counting() -> None:
    state, action = step(RecoveryState(mode=Mode.STOPPED, respawns=(1.0,), restarts_total=3),
                         Demand(), 5.0)
    assert action == SPAWN
    assert state == RecoveryState(mode=Mode.STARTING, respawns=(1.0,), restarts_total=3)


def test_demand_on_a_ready_session_keeps_serving() -> None:
    assert step(READY, Demand(), 5.0) == (READY, Serve())


def test_retry_rearms_a_failed_session_with_the_window_cleared() -> None:
    state, _ = _crash_at([0.0, 1.0, 2.0, 3.0, 4.0])
    state, action = step(state, LinkLost(alive=False), 5.0)
    assert (state.mode, action) == (Mode.FAILED, Fail())
    state, action = step(state, Retry(), 6.0)
    assert action == SPAWN
    assert state == RecoveryState(mode=Mode.STARTING, respawns=(), restarts_total=5)
    state, _ = step(state, Spawned(), 6.0)
    # a full new allowance: five more counted respawns, the sixth fails
    for k, t in enumerate([7.0, 8.0, 9.0, 10.0, 11.0]):
        state, action = crash_and_respawn(state, t)
        assert action == SPAWN
        assert state.restarts_total == 6 + k
    state, action = step(state, LinkLost(alive=False), 12.0)
    assert (state.mode, action, state.restarts_total) == (Mode.FAILED, Fail(), 10)


# --- operator stop ---------------------------------------------------------------------------


@pytest.mark.parametrize("graceful", [True, False])
@pytest.mark.parametrize("mode", [Mode.READY, Mode.RECOVERING, Mode.STARTING, Mode.ADOPTING])
@pytest.mark.parametrize("held", [False, True])
def test_stop_request_stops_and_does_not_respawn(graceful: bool, mode: Mode, held: bool) -> None:
    before = RecoveryState(mode=mode, attempts=2, respawns=(1.0,), restarts_total=1)
    state, action = step(before, StopRequested(graceful=graceful), 9.0, held=held)
    # an operator's stop is never deferred by a held admission
    assert action == Stop(graceful=graceful)
    assert (state.mode, state.stop_wanted, state.deferred) == (Mode.STOPPING, True, Pending.NONE)
    state, action = step(state, Stopped(confirmed=True), 10.0, held=held)
    assert action == Idle()
    assert state.mode is Mode.STOPPED
    assert state.stop_wanted is False
    assert (state.respawns, state.restarts_total) == ((1.0,), 1)


def test_stop_request_cancels_a_deferred_respawn() -> None:
    deferred, action = step(READY, LinkLost(alive=False), 1.0, held=True)
    assert (deferred.deferred, action) == (Pending.RESPAWN, POLL)
    state, action = step(deferred, StopRequested(graceful=True), 1.05, held=True)
    assert action == Stop(graceful=True)
    assert (state.mode, state.deferred, state.stop_wanted) == (Mode.STOPPING, Pending.NONE, True)
    state, action = step(state, Stopped(confirmed=True), 1.05, held=False)
    assert (state.mode, action, state.restarts_total) == (Mode.STOPPED, Idle(), 0)


@pytest.mark.parametrize("mode", [Mode.STOPPED, Mode.FAILED])
def test_stop_request_on_a_stopped_or_failed_session_is_stopped(mode: Mode) -> None:
    state, action = step(RecoveryState(mode=mode), StopRequested(), 3.0)
    assert action == Idle()
    assert state == RecoveryState(mode=Mode.STOPPED)


@pytest.mark.parametrize("alive", [True, False])
def test_a_link_lost_while_stopping_on_request_finishes_the_stop(alive: bool) -> None:
    stopping = RecoveryState(mode=Mode.STOPPING, stop_wanted=True)
    state, action = step(stopping, LinkLost(alive=alive), 3.0)
    assert action == Stop(graceful=False)
    assert state.restarts_total == 0
    state, action = step(stopping, ConnectFailed(alive=alive), 3.0)
    assert action == Stop(graceful=False)


def test_a_failed_spawn_after_a_stop_request_is_stopped() -> None:
    state, action = step(RecoveryState(mode=Mode.STOPPING, stop_wanted=True), SpawnFailed(), 30.0)
    assert action == Idle()
    assert (state.mode, state.stop_wanted, state.restarts_total) == (Mode.STOPPED, False, 0)


def test_a_worker_that_survived_the_kill_is_not_forgotten_by_a_stop_request() -> None:
    stopping = RecoveryState(mode=Mode.STOPPING, rounds=10)
    state, action = step(stopping, Stopped(confirmed=False), 80.0)
    assert (state.mode, action) == (Mode.FAILED, Fail())
    state, action = step(state, StopRequested(graceful=True), 90.0)
    # acceptable answers: try the stop again, or stay failed; never forget the process
    if isinstance(action, Stop):
        state, action = step(state, Stopped(confirmed=False), 97.0)
    if action == Idle():  # stopped: the next prompt asks for the session
        state, action = step(state, Demand(), 100.0)
    assert not isinstance(action, Spawn)


# --- shutdown admission ----------------------------------------------------------------------


def test_a_held_admission_defers_a_crash_respawn_and_keeps_it_counted() -> None:
    state, action = step(READY, LinkLost(alive=False), 2.0, held=True)
    assert action == POLL
    assert state == RecoveryState(mode=Mode.RECOVERING, deferred=Pending.RESPAWN)
    for t in (2.05, 2.1, 2.15):
        state, action = step(state, TimerFired(), t, held=True)
        assert action == POLL
        assert (state.mode, state.deferred, state.restarts_total) == (
            Mode.RECOVERING, Pending.RESPAWN, 0
        )
    state, action = step(state, TimerFired(), 2.2, held=False)
    assert action == SPAWN
    assert state == RecoveryState(mode=Mode.STARTING, respawns=(2.2,), restarts_total=1)


def test_a_deferred_respawn_is_checked_against_the_window_when_it_runs() -> None:
    full = replace(READY, respawns=(1.0, 2.0, 3.0, 4.0, 5.0), restarts_total=5)
    state, action = step(full, LinkLost(alive=False), 6.0, held=True)
    assert action == POLL
    state, action = step(state, TimerFired(), 6.05, held=False)
    assert (state.mode, action, state.restarts_total) == (Mode.FAILED, Fail(), 5)
    # the same, released after the first respawn left the window
    state, _ = step(full, LinkLost(alive=False), 6.0, held=True)
    state, action = step(state, TimerFired(), 61.0, held=False)
    assert action == SPAWN
    assert (state.respawns, state.restarts_total) == ((2.0, 3.0, 4.0, 5.0, 61.0), 6)


@pytest.mark.parametrize("before", [RecoveryState(mode=Mode.STOPPED),
                                    RecoveryState(mode=Mode.FAILED, respawns=(1.0,) * 5)])
def test_a_held_admission_defers_a_start_and_keeps_it_uncounted(before: RecoveryState) -> None:
    obs: Observation = Demand() if before.mode is Mode.STOPPED else Retry()
    state, action = step(before, obs, 3.0, held=True)
    assert action == POLL
    assert (state.mode, state.deferred) == (Mode.RECOVERING, Pending.START)
    state, action = step(state, TimerFired(), 3.05, held=True)
    assert (action, state.deferred) == (POLL, Pending.START)
    state, action = step(state, TimerFired(), 3.1, held=False)
    assert action == SPAWN
    assert (state.mode, state.deferred, state.restarts_total) == (Mode.STARTING, Pending.NONE, 0)
    # a retry cleared the window; a start on demand adds nothing to it
    assert state.respawns == ()


@pytest.mark.parametrize("obs", [Stopped(confirmed=True), SpawnFailed(),
                                 ConnectFailed(alive=False)])
def test_a_held_admission_defers_every_respawn(obs: Observation) -> None:
    mode = {Stopped: Mode.STOPPING, SpawnFailed: Mode.STARTING}.get(type(obs), Mode.RECOVERING)
    state, action = step(RecoveryState(mode=mode), obs, 1.0, held=True)
    assert action == POLL
    assert (state.mode, state.deferred, state.restarts_total) == (
        Mode.RECOVERING, Pending.RESPAWN, 0
    )


@pytest.mark.parametrize("graceful", [True, False])
def test_a_deferred_recovery_stop_waits_for_the_admission(graceful: bool) -> None:
    deferred = RecoveryState(mode=Mode.RECOVERING, attempts=3, rounds=10,
                             deferred=Pending.STOP, graceful=graceful)
    state, action = step(deferred, TimerFired(), 60.0, held=True)
    assert (state, action) == (deferred, POLL)
    state, action = step(state, TimerFired(), 60.05, held=False)
    assert action == Stop(graceful=graceful)
    assert (state.mode, state.deferred, state.stop_wanted) == (
        Mode.STOPPING, Pending.NONE, False
    )


def test_the_stop_after_the_last_deferred_round_waits_for_a_held_admission() -> None:
    last = RecoveryState(mode=Mode.RECOVERING, attempts=3, rounds=10)
    state, action = step(last, ConnectFailed(alive=True), 56.25, held=True)
    assert action == POLL
    assert (state.mode, state.deferred) == (Mode.RECOVERING, Pending.STOP)


# --- properties ------------------------------------------------------------------------------

EXPECTED_MODES: dict[type, tuple[Mode, ...]] = {
    Serve: (Mode.READY,),
    Spawn: (Mode.STARTING,),
    Stop: (Mode.STOPPING,),
    Fail: (Mode.FAILED,),
    Idle: (Mode.STOPPED,),
    Wait: (Mode.RECOVERING,),
    Connect: (Mode.ADOPTING, Mode.RECOVERING),
}


@dataclass
class World:
    """What the shell would observe: one worker process that may answer, die or survive."""

    alive: bool
    survivor: bool = False  # a process that outlived SIGKILL


def respond(world: World, action: Action, pick: int) -> Observation | None:
    """A plausible observation for ``action`` (``pick`` chooses among them), updating ``world``.

    ``None`` ends the run: a failed session with a surviving process is left to the operator
    (test_a_worker_that_survived_the_kill_is_not_forgotten_by_a_stop_request covers a stop
    request in that state).
    """
    match action:
        case Connect():
            if not world.alive:
                return ConnectFailed(alive=False)
            if pick % 3 == 0:
                return Connected()
            world.alive = pick % 3 == 1
            return ConnectFailed(alive=world.alive)
        case Wait():
            return StopRequested(graceful=pick % 2 == 0) if pick % 4 == 3 else TimerFired()
        case Serve():
            if pick % 4 == 3:
                return StopRequested(graceful=pick % 2 == 0)
            world.alive = pick % 2 == 0
            return LinkLost(alive=world.alive)
        case Stop():
            confirmed = not world.alive or pick % 3 != 0
            world.alive = not confirmed
            world.survivor = not confirmed
            return Stopped(confirmed=confirmed)
        case Spawn():
            world.alive = pick % 3 != 0
            return Spawned() if world.alive else SpawnFailed()
        case Idle():
            return Demand() if pick % 3 else StopRequested(graceful=True)
        case Fail():
            if world.survivor:
                return None
            return Retry() if pick % 2 else StopRequested(graceful=True)
    raise AssertionError(action)


steps = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.0, 0.05, 0.25, 1.0, 2.0, 5.0, 15.0, 30.0, 59.0, 61.0]),
        st.sampled_from([False, False, False, True]),
        st.integers(min_value=0, max_value=11),
    ),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(alive=st.booleans(), wanted=st.booleans(), failed=st.booleans(), walk=steps)
def test_the_schedule_keeps_its_invariants_in_any_run(
    alive: bool, wanted: bool, failed: bool, walk: list[tuple[float, bool, int]]
) -> None:
    """Along any run the shell could observe:

    * the action matches the mode (Spawn only in STARTING, Serve only in READY, ...);
    * no Spawn while a worker process is alive, nor while the admission is held, nor after an
      operator's stop until a prompt (Demand) or a retry asks for the session again;
    * restarts_total grows by one exactly when a Spawn is returned for a crash (not for a
      Demand or a Retry, however long a held admission deferred it), else stays;
    * counted respawns since the last Retry never exceed restart_intensity in any window.
    """
    now = 0.0
    world = World(alive=alive)
    held = walk[0][1] if walk else False  # the admission when the last decision was made
    cause: Observation = Start(alive=alive, wanted=wanted, failed=failed and not alive)
    operator_stop = False  # a StopRequested not yet followed by a Demand or a Retry
    counted: list[float] = []
    state = RecoveryState()
    obs: Observation | None = cause
    for dt, held_next, pick in [(0.0, held, 0), *walk]:
        assert obs is not None
        before = state.restarts_total
        state, action = step(state, obs, now, held=held)
        assert state.mode in EXPECTED_MODES[type(action)], (state, action)
        if isinstance(action, Spawn):
            assert not world.alive, (state, action)
            assert not held, (state, action)
            assert not operator_stop, (state, action)
            crash = not isinstance(cause, Demand | Retry)
            assert state.restarts_total == before + crash
            if crash:
                counted.append(now)
                inside = [t for t in counted if now - t < T.restart_window]
                assert len(inside) <= T.restart_intensity, counted
        else:
            assert state.restarts_total == before
        held = held_next
        obs = respond(world, action, pick)
        if obs is None:
            break
        now += dt
        if not isinstance(obs, TimerFired):
            cause = obs
        if isinstance(obs, StopRequested):
            operator_stop = True
        if isinstance(obs, Demand | Retry):
            operator_stop = False
        if isinstance(obs, Retry):
            counted = []


@settings(max_examples=300, deadline=None)
@given(gaps=st.lists(st.floats(min_value=0.0, max_value=90.0, allow_nan=False), max_size=40))
def test_a_crash_loop_fails_exactly_when_a_sixth_respawn_would_fall_in_the_window(
    gaps: list[float],
) -> None:
    state, now = READY, 0.0
    accepted: list[float] = []
    for gap in gaps:
        now += gap
        state, action = crash_and_respawn(state, now)
        recent = [t for t in accepted if now - t < T.restart_window]
        if len(recent) >= T.restart_intensity:
            assert (state.mode, action) == (Mode.FAILED, Fail())
            break
        assert action == SPAWN
        accepted.append(now)
        assert state.restarts_total == len(accepted)
        assert state.respawns == (*recent, now)


@pytest.mark.parametrize("alive", [False, True])
@pytest.mark.parametrize("held", [False, True])
def test_a_worker_that_stopped_cleanly_on_a_signal_is_stopped_not_respawned(
    alive: bool, held: bool
) -> None:
    # an operator's TERM/INT/HUP/QUIT: the worker says so before its link closes; it is made
    # sure gone (never deferred by a shutdown admission), then the session is stopped with its
    # restarts unchanged, however often it happens; the next prompt starts it, uncounted
    state = replace(READY, restarts_total=2, respawns=(0.5,))
    for i in range(T.restart_intensity + 2):
        state, action = step(state, LinkLost(alive=alive, clean_stop=True), 1.0 + i, held=held)
        assert action == Stop(graceful=False)
        assert state.mode is Mode.STOPPING
        state, action = step(state, Stopped(confirmed=True), 1.0 + i, held=held)
        assert action == Idle()
        assert state.mode is Mode.STOPPED
        assert (state.restarts_total, state.respawns) == (2, (0.5,))
        state, action = step(state, Demand(), 1.5 + i)
        assert action == SPAWN
        assert state.restarts_total == 2
        state, _ = step(state, Spawned(), 1.5 + i)
    # without the worker's word, the same exit is a crash: respawned and counted
    state, action = step(state, LinkLost(alive=False), 10.0)
    assert action == SPAWN
    assert state.restarts_total == 3
