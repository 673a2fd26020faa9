"""The recovery planner's transition table (trio_agentd._recovery): complete, closed, and printed.

Every (mode, observation) pair either has a rule or raises :class:`IllegalObservation`; every
rule returns only the (mode, action) pairs it declares; docs/design.md prints the same table.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agentd._recovery import (
    Connected,
    ConnectFailed,
    Demand,
    IllegalObservation,
    LinkLost,
    Mode,
    Observation,
    Pending,
    RecoveryState,
    Retry,
    Spawned,
    SpawnFailed,
    Start,
    StopDeclined,
    Stopped,
    StopReason,
    StopRequested,
    TimerFired,
    column,
    decide,
    transition_table_markdown,
)
from trio_agentd.timing import DEFAULT_TIMING as T

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
KINDS: tuple[type[Observation], ...] = get_args(Observation)

observations: dict[type[Observation], st.SearchStrategy[Observation]] = {
    Start: st.builds(Start, alive=st.booleans(), wanted=st.booleans(), failed=st.booleans(),
                     stop_reason=st.sampled_from(StopReason)),
    Connected: st.just(Connected()),
    ConnectFailed: st.builds(ConnectFailed, alive=st.booleans()),
    LinkLost: st.builds(LinkLost, alive=st.booleans(), clean_stop=st.booleans()),
    TimerFired: st.just(TimerFired()),
    Stopped: st.builds(Stopped, confirmed=st.booleans()),
    Spawned: st.just(Spawned()),
    SpawnFailed: st.builds(SpawnFailed, cause=st.sampled_from(["", "agent cannot load"])),
    Demand: st.just(Demand()),
    Retry: st.just(Retry()),
    StopRequested: st.builds(StopRequested, graceful=st.booleans(),
                             reason=st.sampled_from(StopReason)),
    StopDeclined: st.just(StopDeclined()),
}


def states(mode: Mode) -> st.SearchStrategy[RecoveryState]:
    return st.builds(
        RecoveryState, mode=st.just(mode), attempts=st.integers(0, 4), rounds=st.integers(0, 11),
        respawns=st.lists(st.sampled_from([0.0, 10.0, 50.0, 59.0]), max_size=6).map(tuple),
        restarts_total=st.integers(0, 9), stop_wanted=st.booleans(),
        deferred=st.sampled_from(Pending), graceful=st.booleans(), unconfirmed=st.booleans(),
        stop_reason=st.sampled_from(StopReason),
    )


LEGAL = [(mode, kind) for mode in Mode for kind in KINDS if mode in column(kind)]
ILLEGAL = [(mode, kind) for mode in Mode for kind in KINDS if mode not in column(kind)]


def test_every_observation_has_a_column_and_every_mode_a_way_out() -> None:
    assert set(observations) == set(KINDS)
    for mode in Mode:
        assert any(m is mode for m, _ in LEGAL), mode
    # the pairs that make no sense are closed, as the shell never produces them
    assert (Mode.READY, TimerFired) in ILLEGAL
    assert (Mode.STOPPED, Connected) in ILLEGAL
    assert (Mode.READY, Start) in ILLEGAL


@pytest.mark.parametrize(("mode", "kind"), ILLEGAL, ids=lambda v: getattr(v, "__name__", v))
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_an_illegal_observation_raises_a_named_error_whatever_the_state(
    mode: Mode, kind: type[Observation], data: st.DataObject
) -> None:
    state, obs = data.draw(states(mode)), data.draw(observations[kind])
    with pytest.raises(IllegalObservation) as caught:
        decide(state, obs, 1.0, T, admission_held=data.draw(st.booleans()))
    assert (caught.value.mode, caught.value.observation) == (mode, obs)
    assert f"{kind.__name__} is illegal in mode {mode.value!r}" in str(caught.value)


def test_a_stray_timer_on_a_ready_session_is_refused_not_answered_with_fail() -> None:
    with pytest.raises(IllegalObservation, match="TimerFired is illegal in mode 'ready'"):
        decide(RecoveryState(mode=Mode.READY), TimerFired(), 5.0, T)


def test_a_decline_of_a_stop_that_was_no_eviction_is_illegal() -> None:
    stopping = RecoveryState(mode=Mode.STOPPING, stop_reason=StopReason.NONE)
    with pytest.raises(IllegalObservation, match="declines only an eviction"):
        decide(stopping, StopDeclined(), 5.0, T)


@pytest.mark.parametrize(("mode", "kind"), LEGAL, ids=lambda v: getattr(v, "__name__", v))
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_every_rule_returns_only_the_outcomes_it_declares(
    mode: Mode, kind: type[Observation], data: st.DataObject
) -> None:
    state, obs = data.draw(states(mode)), data.draw(observations[kind])
    held = data.draw(st.booleans())
    rule = column(kind)[mode]
    try:
        after, action = decide(state, obs, data.draw(st.sampled_from([0.0, 30.0, 61.0])), T,
                               admission_held=held)
    except IllegalObservation:
        # the one guard inside a rule: a worker declines only an eviction
        assert kind is StopDeclined
        assert state.stop_reason is not StopReason.EVICT
        assert not state.stop_wanted
        return
    assert (after.mode, type(action)) in rule.outcomes, (rule.name, state, obs, after, action)


def test_docs_design_prints_the_table_of_the_code() -> None:
    text = DESIGN.read_text()
    start, end = "<!-- recovery-table -->", "<!-- /recovery-table -->"
    assert start in text, f"docs/design.md has no {start} block"
    documented = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert documented == transition_table_markdown(), (
        "docs/design.md's recovery table differs from the code: paste the output of"
        " `python -c 'from trio_agentd._recovery import transition_table_markdown as t;"
        " print(t())'` between its recovery-table markers")
