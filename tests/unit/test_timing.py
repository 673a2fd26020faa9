"""The timing constants and their environment overrides (trio_agentd.timing)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agentd._errors import AgentdError
from trio_agentd.timing import DEFAULT_TIMING, FLOORS, Timing, floor_of, timing_from_env

ENV = "TRIO_AGENTD_TIMING"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(ENV, raising=False)
    return monkeypatch


def test_defaults_are_the_values_of_the_spec() -> None:
    t = DEFAULT_TIMING
    assert (t.refence_interval, t.self_check_interval) == (0.25, 0.25)
    assert t.worker_connect_timeout == 30.0
    assert t.adopt_connect_timeout == 2.0
    assert t.worker_retry_delays == (0.25, 1.0, 5.0)
    assert (t.deferred_recovery_recheck, t.max_deferred_recovery_rounds) == (5.0, 10)
    assert (t.stop_grace, t.kill_confirm_timeout) == (5.0, 2.0)
    assert (t.restart_intensity, t.restart_window) == (5, 60.0)
    assert (t.idle_eviction, t.idle_sweep_period) == (5400.0, 60.0)
    assert (t.startup_timeout, t.probe_interval, t.hello_timeout, t.connect_timeout) == (
        30.0,
        0.025,
        1.5,
        0.3,
    )
    assert Timing() == DEFAULT_TIMING


def test_timing_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TIMING.stop_grace = 1.0  # type: ignore[misc]


def test_no_variable_gives_the_base(env: pytest.MonkeyPatch) -> None:
    assert timing_from_env() is DEFAULT_TIMING
    base = Timing(stop_grace=1.0)
    assert timing_from_env(base) is base


def test_empty_variable_gives_the_base(env: pytest.MonkeyPatch) -> None:
    env.setenv(ENV, "")
    assert timing_from_env() is DEFAULT_TIMING


def test_overrides_apply_on_top_of_the_base(env: pytest.MonkeyPatch) -> None:
    env.setenv(ENV, '{"self_check_interval": 60, "max_deferred_recovery_rounds": 3}')
    base = Timing(stop_grace=1.5)
    got = timing_from_env(base)
    assert got == Timing(stop_grace=1.5, self_check_interval=60, max_deferred_recovery_rounds=3)


def test_retry_delays_list_becomes_a_tuple(env: pytest.MonkeyPatch) -> None:
    env.setenv(ENV, '{"worker_retry_delays": [0.1, 0.2]}')
    got = timing_from_env()
    assert got.worker_retry_delays == (0.1, 0.2)
    assert type(got.worker_retry_delays) is tuple


def test_empty_object_gives_the_defaults(env: pytest.MonkeyPatch) -> None:
    env.setenv(ENV, "{}")
    assert timing_from_env() == DEFAULT_TIMING


@pytest.mark.parametrize("raw", ["{", "fast", "{'stop_grace': 1}", '{"stop_grace": 1,}'])
def test_non_json_is_refused(env: pytest.MonkeyPatch, raw: str) -> None:
    env.setenv(ENV, raw)
    with pytest.raises(ValueError, match=r"^TRIO_AGENTD_TIMING is not JSON: "):
        timing_from_env()


@pytest.mark.parametrize("raw", ["[]", "null", "5", '"stop_grace"', "[1, 2]"])
def test_non_object_is_refused(env: pytest.MonkeyPatch, raw: str) -> None:
    env.setenv(ENV, raw)
    with pytest.raises(ValueError, match=r"^TRIO_AGENTD_TIMING must be a JSON object$"):
        timing_from_env()


def test_unknown_fields_are_refused_by_name(env: pytest.MonkeyPatch) -> None:
    env.setenv(ENV, '{"zzz": 1, "stop_grace": 1, "self_check_intervall": 2}')
    with pytest.raises(ValueError, match="unknown fields") as info:
        timing_from_env()
    assert str(info.value) == (
        "TRIO_AGENTD_TIMING has unknown fields: ['self_check_intervall', 'zzz']"
    )


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"self_check_interval": "fast"}', "self_check_interval"),
        ('{"stop_grace": null}', "stop_grace"),
        ('{"worker_retry_delays": 5}', "worker_retry_delays"),
        ('{"worker_retry_delays": "abc"}', "worker_retry_delays"),
        ('{"max_deferred_recovery_rounds": [1]}', "max_deferred_recovery_rounds"),
    ],
)
def test_bad_values_are_refused_by_name(env: pytest.MonkeyPatch, raw: str, field: str) -> None:
    env.setenv(ENV, raw)
    with pytest.raises(ValueError, match=field):
        timing_from_env()


float_fields = [
    f.name for f in dataclasses.fields(Timing) if isinstance(getattr(DEFAULT_TIMING, f.name), float)
]


@given(
    st.dictionaries(
        st.sampled_from(float_fields),
        st.floats(min_value=0.01, max_value=1e6, allow_nan=False),
        max_size=len(float_fields),
    )
)
def test_any_float_overrides_round_trip(overrides: dict[str, float]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, json.dumps(overrides))
        got = timing_from_env()
    expected: dict[str, Any] = dict(overrides)
    assert got == dataclasses.replace(DEFAULT_TIMING, **expected)
    for name in float_fields:
        assert getattr(got, name) == overrides.get(name, getattr(DEFAULT_TIMING, name))


def test_idle_victims_only_ready_sessions_idle_long_enough() -> None:
    from trio_agentd._recovery import Mode, idle_victims

    sessions = [
        ("ready-idle", Mode.READY, 5400.0),
        ("ready-busy", Mode.READY, 5399.9),
        ("recovering", Mode.RECOVERING, 9999.0),
        ("stopped", Mode.STOPPED, 9999.0),
    ]
    assert idle_victims(sessions, now=0.0, idle_eviction=5400.0) == ["ready-idle"]
    assert idle_victims(sessions, now=0.0, idle_eviction=0.0) == []


# --- floors: no NaN, no infinity, nothing that makes a loop spin --------------------------


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        ('{"self_check_interval": NaN}',
         "TRIO_AGENTD_TIMING: self_check_interval must be a finite number of seconds >= 0.01"
         " (got NaN)"),
        ('{"self_check_interval": 0}',
         "TRIO_AGENTD_TIMING: self_check_interval must be a finite number of seconds >= 0.01"
         " (got 0)"),
        ('{"refence_interval": 0.001}',
         "TRIO_AGENTD_TIMING: refence_interval must be a finite number of seconds >= 0.01"
         " (got 0.001)"),
        ('{"stop_grace": Infinity}',
         "TRIO_AGENTD_TIMING: stop_grace must be a finite number of seconds >= 0 (got Infinity)"),
        ('{"worker_connect_timeout": -Infinity}',
         "TRIO_AGENTD_TIMING: worker_connect_timeout must be a finite number of seconds >= 0.01"
         " (got -Infinity)"),
        ('{"kill_confirm_timeout": -1}',
         "TRIO_AGENTD_TIMING: kill_confirm_timeout must be a finite number of seconds >= 0"
         " (got -1)"),
        ('{"lock_poll": 1e-9}',
         "TRIO_AGENTD_TIMING: lock_poll must be a finite number of seconds >= 0.001 (got 1e-09)"),
        ('{"idle_sweep_period": 1e999}',
         "TRIO_AGENTD_TIMING: idle_sweep_period must be a finite number of seconds >= 0.01"
         " (got Infinity)"),
        ('{"idle_eviction": 0.001}',
         "TRIO_AGENTD_TIMING: idle_eviction must be a finite number of seconds >= 0.01"
         " (or 0: off) (got 0.001)"),
        ('{"worker_retry_delays": [0.25, NaN]}',
         "TRIO_AGENTD_TIMING: worker_retry_delays must be a list of finite seconds, each >= 0"
         " (got [0.25, NaN])"),
        ('{"storage_retry_delays": [-0.5]}',
         "TRIO_AGENTD_TIMING: storage_retry_delays must be a list of finite seconds, each >= 0"
         " (got [-0.5])"),
        ('{"restart_intensity": -1}',
         "TRIO_AGENTD_TIMING: restart_intensity must be a whole number >= 0 (got -1)"),
    ],
)
def test_nan_infinities_negatives_and_values_below_the_floor_are_refused(
    env: pytest.MonkeyPatch, raw: str, line: str
) -> None:
    env.setenv(ENV, raw)
    with pytest.raises(AgentdError) as info:
        timing_from_env()
    assert info.value.code == "config"
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do
    assert str(info.value) == line
    assert "\n" not in str(info.value)


def test_values_at_the_floor_and_zero_where_allowed_are_accepted(
    env: pytest.MonkeyPatch,
) -> None:
    env.setenv(ENV, '{"self_check_interval": 0.01, "lock_poll": 0.001, "stop_grace": 0,'
                    ' "idle_eviction": 0, "worker_retry_delays": [0, 0.5],'
                    ' "storage_retry_delays": []}')
    got = timing_from_env()
    assert (got.self_check_interval, got.lock_poll, got.stop_grace) == (0.01, 0.001, 0.0)
    assert got.idle_eviction == 0.0
    assert (got.worker_retry_delays, got.storage_retry_delays) == ((0.0, 0.5), ())


def test_every_default_is_at_or_above_its_floor() -> None:
    assert set(FLOORS) <= {f.name for f in dataclasses.fields(Timing)}
    for f in dataclasses.fields(Timing):
        value = getattr(DEFAULT_TIMING, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            assert v >= floor_of(f.name), f.name


def test_daemon_refuses_a_busy_loop_override_in_one_line() -> None:
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, ENV: '{"self_check_interval": 0}'}
        cp = subprocess.run(
            [sys.executable, "-m", "trio_agentd", "--socket", f"{d}/s.sock", "--home",
             f"{d}/home", "daemon"],
            capture_output=True, text=True, timeout=60, env=env,
        )
    assert cp.returncode == 2
    assert "Traceback" not in cp.stderr
    assert "self_check_interval must be a finite number of seconds >= 0.01" in cp.stderr
