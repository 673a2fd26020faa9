"""Bounds that nest (computed from the constants), and no bare number for a duration."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

import trio_agentd
from trio_agentd import _defaults, timing
from trio_agentd.timing import (
    DEFAULT_TIMING,
    IN_PROCESS_EXIT_MARGIN,
    LINK_CLOSE_TIMEOUT,
    OWNERSHIP_RELEASE_TIMEOUT,
    SHUTDOWN_MARGIN,
    kill_answer_bound,
    shutdown_bound,
    shutdown_shield,
    worker_stop_bound,
    workers_stop_bound,
)

seconds = st.floats(min_value=0.0, max_value=3600.0, allow_nan=False, allow_infinity=False)


@given(stop_grace=seconds, kill_confirm=seconds)
def test_the_stop_bounds_nest_for_any_grace(stop_grace: float, kill_confirm: float) -> None:
    t = dataclasses.replace(DEFAULT_TIMING, stop_grace=stop_grace,
                            kill_confirm_timeout=kill_confirm)
    # one worker: the stop command's grace, its link closed, TERM + grace, KILL + confirm
    assert worker_stop_bound(t) > 2 * t.stop_grace + t.kill_confirm_timeout
    assert worker_stop_bound(t) >= 2 * t.stop_grace + LINK_CLOSE_TIMEOUT + t.kill_confirm_timeout
    # `kill` and `rm` wait for the victim's whole stop before they answer anyway
    assert kill_answer_bound(t) > worker_stop_bound(t)
    # a shutdown: the batch of stops inside the shield, the shield inside the whole shutdown
    assert workers_stop_bound(t) > worker_stop_bound(t)
    assert shutdown_shield(t) > workers_stop_bound(t)
    assert shutdown_bound(t) > t.stop_grace + shutdown_shield(t)
    # open_supervisor waits longer than the supervisor it runs takes to stop
    assert shutdown_bound(t) + IN_PROCESS_EXIT_MARGIN > shutdown_bound(t)


def test_the_default_shutdown_bounds() -> None:
    t = DEFAULT_TIMING
    assert worker_stop_bound(t) == 13.0  # 5 + 1 + 5 + 2
    assert workers_stop_bound(t) == 14.0
    assert kill_answer_bound(t) == 14.0
    assert shutdown_shield(t) == 16.0  # was 12: shorter than the 14 s stop inside it
    assert shutdown_bound(t) == 24.0  # drain 5, shield 16, release 3


def test_the_clients_wait_longer_than_the_supervisor_takes() -> None:
    t = DEFAULT_TIMING
    # `trio-agentd shutdown` outwaits a supervisor's whole shutdown at the default timing
    assert shutdown_bound(t) < _defaults.SHUTDOWN_EXIT_WAIT
    # a handover (and a restart) stops no worker: drain, durable writes, the record released
    drain_only = t.stop_grace + SHUTDOWN_MARGIN + OWNERSHIP_RELEASE_TIMEOUT
    assert drain_only < _defaults.HANDOVER_EXIT_GRACE
    assert drain_only < _defaults.RESTART_WAIT
    # a command is resent across a whole shutdown and the next supervisor's start
    assert shutdown_bound(t) + t.startup_timeout < _defaults.RETRY_FOR
    # a client's patience with a silent supervisor spans several of its self-checks and the
    # restart of a self-check that crashed
    assert t.self_check_interval + timing.SERVICE_RESTART_DELAY < t.patience_tick < t.patience
    assert t.connect_timeout < t.hello_timeout < t.patience
    # systemd's watchdog is pinged every half of it, from the self-check loop
    assert t.self_check_interval < timing.SERVICE_WATCHDOG_SEC / 2
    # a grant is renewed before it expires; idle links are pinged less often than busy ones
    assert 0 < _defaults.GRANT_MARGIN < t.grant_ttl
    assert t.link_ping_interval <= t.link_idle_ping_interval
    assert _defaults.RESEND_DELAY < _defaults.RESEND_DELAY_MAX < _defaults.RETRY_FOR
    assert t.lock_poll < timing.LOCK_POLL_MAX


def test_the_test_fixtures_outwait_the_commands_they_run() -> None:
    assert _defaults.SHUTDOWN_EXIT_WAIT < timing.TEST_SHUTDOWN_TIMEOUT
    longest = max(_defaults.SHUTDOWN_EXIT_WAIT, _defaults.RESTART_WAIT,
                  _defaults.STARTUP_TIMEOUT + _defaults.AUTOSTART_HELPER_MARGIN,
                  _defaults.PATIENCE)
    assert longest < timing.TEST_CLI_TIMEOUT


# --- no bare number for a duration -----------------------------------------------------------

_WAITS = frozenset({"sleep", "sleep_until", "fail_after", "move_on_after", "fail_at",
                    "move_on_at", "wait_gone"})
_CLOCKS = frozenset({"monotonic", "current_time", "time"})


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _literals(node: ast.AST) -> list[ast.Constant]:
    """Non-zero numbers in ``node`` that are durations (not the factor of a product)."""
    found: list[ast.Constant] = []
    if isinstance(node, ast.Constant):
        if isinstance(node.value, int | float) and not isinstance(node.value, bool) and node.value:
            found.append(node)
        return found
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return [c for side in (node.left, node.right) if not isinstance(side, ast.Constant)
                for c in _literals(side)]
    for child in ast.iter_child_nodes(node):
        found += _literals(child)
    return found


def _bare_numbers(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    hits: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) in _WAITS:
            args = [*node.args, *(k.value for k in node.keywords)]
            hits += [f"{path.name}:{c.lineno}: {_name(node.func)}({c.value!r})"
                     for a in args for c in _literals(a)]
        elif isinstance(node, ast.keyword) and node.arg in ("timeout", "deadline"):
            if isinstance(node.value, ast.Constant) and node.value.value:
                hits.append(f"{path.name}:{node.value.lineno}: {node.arg}={node.value.value!r}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for clock, other in ((node.left, node.right), (node.right, node.left)):
                if (isinstance(clock, ast.Call) and _name(clock.func) in _CLOCKS
                        and isinstance(other, ast.Constant) and other.value):
                    hits.append(f"{path.name}:{other.lineno}: clock + {other.value!r}")
    return hits


def test_no_code_waits_on_a_bare_number() -> None:
    package = Path(trio_agentd.__file__).parent
    hits = [hit for path in sorted(package.rglob("*.py"))
            for hit in _bare_numbers(path)]
    assert hits == [], "name these durations in timing.py or _defaults.py: " + "; ".join(hits)


def test_the_scan_finds_a_bare_number(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import time, trio\n"
        "async def f(t):\n"
        "    await trio.sleep(0)\n"  # a checkpoint, not a duration
        "    with trio.move_on_after(2 * t.stop_grace):\n"
        "        await trio.sleep(max(t.wake, 0.01))\n"
        "    deadline = time.monotonic() + 20\n"
        "    g(timeout=3)\n"
    )
    assert sorted(_bare_numbers(sample)) == [
        "sample.py:5: sleep(0.01)", "sample.py:6: clock + 20", "sample.py:7: timeout=3",
    ]
