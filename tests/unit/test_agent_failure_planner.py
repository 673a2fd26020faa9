"""A session whose agent cannot be loaded fails at once with the cause, and ``retry`` re-arms it.

Pure planner steps (:func:`trio_agentd._recovery.decide`) at exact times.
"""

from __future__ import annotations

from trio_agentd._recovery import (
    Demand,
    Fail,
    Mode,
    RecoveryState,
    Retry,
    Spawn,
    SpawnFailed,
    Start,
    StopRequested,
    TimerFired,
    decide,
)
from trio_agentd.timing import DEFAULT_TIMING as T

CAUSE = "agent 'm:make' cannot be loaded: ModuleNotFoundError: No module named 'm'"


def test_an_agent_that_cannot_load_fails_the_session_without_a_respawn() -> None:
    state, action = decide(RecoveryState(), Start(alive=False, wanted=False), 0.0, T)
    state, action = decide(state, Demand(), 1.0, T)
    assert action == Spawn(T.worker_connect_timeout)
    state, action = decide(state, SpawnFailed(CAUSE), 1.5, T)
    assert action == Fail()
    assert (state.mode, state.failure, state.agent_failed) == (Mode.FAILED, CAUSE, True)
    assert (state.respawns, state.restarts_total) == ((), 0)  # no restart loop, none counted
    # nothing on its own moves it: a timer or a demand only repeats the verdict
    assert decide(state, TimerFired(), 100.0, T) == (state, Fail())
    assert decide(state, Demand(), 100.0, T) == (state, Fail())


def test_retry_after_a_load_failure_spawns_again_and_forgets_the_cause() -> None:
    failed = RecoveryState(mode=Mode.FAILED, failure=CAUSE, agent_failed=True)
    state, action = decide(failed, Retry(), 5.0, T)
    assert action == Spawn(T.worker_connect_timeout)
    assert (state.mode, state.failure, state.agent_failed) == (Mode.STARTING, "", False)
    assert state.restarts_total == 0  # a start the user asked for, not a crash


def test_a_stop_of_a_session_failed_to_load_clears_the_cause() -> None:
    failed = RecoveryState(mode=Mode.FAILED, failure=CAUSE, agent_failed=True)
    state, _ = decide(failed, StopRequested(), 5.0, T)
    assert (state.mode, state.failure, state.agent_failed) == (Mode.STOPPED, "", False)


def test_a_spawn_failure_without_a_cause_is_still_a_crash_respawn() -> None:
    starting = RecoveryState(mode=Mode.STARTING)
    state, action = decide(starting, SpawnFailed(), 1.0, T)
    assert action == Spawn(T.worker_connect_timeout)
    assert (state.mode, state.restarts_total, state.agent_failed) == (Mode.STARTING, 1, False)
