"""Durable stop intents in the pure planner: reasons, a successor finishing a stop, a killed
session never restarted, an eviction declined by a busy worker. No event loop."""

from __future__ import annotations

import pytest

from trio_agentd._recovery import (
    Demand,
    Idle,
    LinkLost,
    Mode,
    RecoveryState,
    Retry,
    Serve,
    Spawn,
    Start,
    Stop,
    StopDeclined,
    Stopped,
    StopReason,
    StopRequested,
    decide,
    descriptor_lifecycle,
    idle_victims,
)
from trio_agentd.timing import DEFAULT_TIMING

T = DEFAULT_TIMING
READY = RecoveryState(mode=Mode.READY)
OPERATOR_STOPS = [StopReason.KILL, StopReason.EVICT, StopReason.SHUTDOWN]


@pytest.mark.parametrize("reason", OPERATOR_STOPS)
def test_a_recorded_stop_of_a_live_worker_is_finished_never_adopted(reason: StopReason) -> None:
    # the successor of a supervisor that died mid-stop: TERM the recorded worker, no connect
    state, action = decide(RecoveryState(), Start(alive=True, wanted=True, stop_reason=reason),
                           7.0, T)
    assert action == Stop(graceful=False)
    assert (state.mode, state.stop_wanted, state.stop_reason) == (Mode.STOPPING, True, reason)
    state, action = decide(state, Stopped(confirmed=True), 9.0, T)
    assert action == Idle()
    assert (state.mode, state.stop_wanted, state.stop_reason) == (Mode.STOPPED, False, reason)
    assert state.restarts_total == 0
    assert state.respawns == ()


@pytest.mark.parametrize("reason", OPERATOR_STOPS)
def test_a_recorded_stop_whose_worker_is_gone_is_stopped_not_respawned(
    reason: StopReason,
) -> None:
    state, action = decide(RecoveryState(), Start(alive=False, wanted=True, stop_reason=reason),
                           7.0, T)
    assert action == Idle()
    assert (state.mode, state.stop_reason, state.restarts_total) == (Mode.STOPPED, reason, 0)


def test_a_recorded_stop_is_finished_even_while_a_shutdown_admission_is_held() -> None:
    _, action = decide(RecoveryState(), Start(alive=True, wanted=True,
                                              stop_reason=StopReason.KILL), 0.0, T,
                       admission_held=True)
    assert action == Stop(graceful=False)


def test_a_stopping_descriptor_without_a_reason_is_recoverys_own_and_adopted() -> None:
    state, _ = decide(RecoveryState(), Start(alive=True, wanted=True), 0.0, T)
    assert state.mode is Mode.ADOPTING


def test_a_killed_session_is_never_started_again_by_a_demand() -> None:
    state, _ = decide(READY, StopRequested(reason=StopReason.KILL), 1.0, T)
    state, _ = decide(state, Stopped(confirmed=True), 1.0, T)
    assert (state.mode, state.stop_reason) == (Mode.STOPPED, StopReason.KILL)
    again, action = decide(state, Demand(), 2.0, T)
    assert (again, action) == (state, Idle())
    again, action = decide(state, Retry(), 2.0, T)
    assert again.mode is Mode.STOPPED
    assert action == Idle()


@pytest.mark.parametrize("reason", [StopReason.EVICT, StopReason.SHUTDOWN])
def test_an_evicted_or_shut_down_session_starts_on_demand_uncounted(reason: StopReason) -> None:
    state, _ = decide(READY, StopRequested(reason=reason), 1.0, T)
    state, _ = decide(state, Stopped(confirmed=True), 1.0, T)
    state, action = decide(state, Demand(), 2.0, T)
    assert action == Spawn(T.worker_connect_timeout)
    assert (state.mode, state.stop_reason, state.restarts_total) == (
        Mode.STARTING, StopReason.NONE, 0)


def test_a_kill_is_never_weakened_by_a_later_stop() -> None:
    state, _ = decide(READY, StopRequested(reason=StopReason.KILL), 1.0, T)
    state, _ = decide(state, StopRequested(reason=StopReason.SHUTDOWN), 1.0, T)
    assert state.stop_reason is StopReason.KILL


def test_a_kill_of_a_stopped_session_marks_it_killed() -> None:
    state, action = decide(RecoveryState(), StopRequested(reason=StopReason.KILL), 1.0, T)
    assert (state.mode, state.stop_reason, action) == (Mode.STOPPED, StopReason.KILL, Idle())


def test_an_eviction_declined_by_a_busy_worker_keeps_it_ready() -> None:
    state, action = decide(READY, StopRequested(reason=StopReason.EVICT), 5400.0, T)
    assert action == Stop(graceful=True)
    assert state.mode is Mode.STOPPING
    state, action = decide(state, StopDeclined(), 5400.0, T)
    assert action == Serve()
    assert (state.mode, state.stop_wanted, state.stop_reason) == (
        Mode.READY, False, StopReason.NONE)


def test_a_decline_does_not_undo_a_kill() -> None:
    state, _ = decide(READY, StopRequested(reason=StopReason.KILL), 1.0, T)
    # (the worker declined an eviction; the kill arrived meanwhile: it stops all the same)
    after, action = decide(state, StopDeclined(), 1.0, T)
    assert action == Stop(graceful=True)
    assert (after.mode, after.stop_wanted, after.stop_reason) == (
        Mode.STOPPING, True, StopReason.KILL)


def test_a_stopped_worker_dying_under_a_stop_is_not_a_crash() -> None:
    state, _ = decide(READY, StopRequested(reason=StopReason.KILL), 1.0, T)
    state, action = decide(state, LinkLost(alive=False), 1.0, T)
    assert isinstance(action, Stop)
    state, action = decide(state, Stopped(confirmed=True), 1.0, T)
    assert (state.mode, state.restarts_total, action) == (Mode.STOPPED, 0, Idle())


@pytest.mark.parametrize(("mode", "reason", "written"), [
    (Mode.READY, StopReason.KILL, Mode.STOPPING),
    (Mode.STARTING, StopReason.EVICT, Mode.STOPPING),
    (Mode.RECOVERING, StopReason.SHUTDOWN, Mode.STOPPING),
    (Mode.STOPPED, StopReason.EVICT, Mode.STOPPED),
    (Mode.READY, StopReason.NONE, Mode.READY),
])
def test_the_descriptor_says_stopping_while_a_stop_is_wanted(
    mode: Mode, reason: StopReason, written: Mode
) -> None:
    assert descriptor_lifecycle(mode, reason) is written


def test_a_busy_session_is_never_an_idle_victim() -> None:
    # idle seconds are 0 while busy (WorkerHandle.idle_for): never evicted mid-turn
    sessions = [("busy", Mode.READY, 0.0), ("idle", Mode.READY, 5400.0)]
    assert idle_victims(sessions, now=9999.0, idle_eviction=5400.0) == ["idle"]
