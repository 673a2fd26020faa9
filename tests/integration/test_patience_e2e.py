"""A slow supervisor is not a wedged one: clients wait for a live one, with progress lines,
and doctor --fix repairs only what stays unresponsive across its re-probe window."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from trio_agentd import _doctor_repair
from trio_agentd._doctor_plan import Status, Verdict
from trio_agentd._paths import Layout

from .harness import DaemonEnv


def test_a_paused_supervisor_gets_patience_and_a_progress_line(denv: DaemonEnv) -> None:
    assert denv.prompt("warm") == "[echo turn 1] warm"
    sup = int(denv.owner()["pid"])
    os.kill(sup, signal.SIGSTOP)
    try:
        # another session: no cached route, so the CLI must ask the paused supervisor
        p = denv.popen("-p", "-s", "other", "again")
        assert p.stderr is not None
        line = p.stderr.readline()  # after the hello timeout: the first progress line
        assert line == f"trio-agentd: supervisor pid {sup} not answering for 1.5 s…\n"
    finally:
        os.kill(sup, signal.SIGCONT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out == "[echo turn 1] again\n"
    assert "doctor" not in err  # never advised to repair a supervisor that was only paused


def test_a_dead_lease_holder_gets_no_patience(denv: DaemonEnv) -> None:
    # nothing alive holds the lease: no waiting, no progress line (nothing listens either)
    layout = Layout(home=denv.home, socket=denv.socket, registry=denv.registry)
    from trio_agentd._syncclient import _lease_holder

    assert _lease_holder(layout) is None
    assert denv.prompt("hi") == "[echo turn 1] hi"
    assert _lease_holder(layout) == int(denv.owner()["pid"])


def test_doctor_reprobe_returns_a_verdict_that_recovers_within_its_window(
    denv: DaemonEnv, monkeypatch: Any
) -> None:
    verdicts = [Verdict(status=Status.UNREACHABLE, cause="accepts connections but sends no"
                        " hello", generation="g", pid=1, start_id="s"),
                Verdict(status=Status.CURRENT, generation="g", pid=1, start_id="s")]
    calls: list[float] = []

    def fake_classify(obs: Any, **kw: Any) -> Verdict:
        calls.append(time.monotonic())
        return verdicts[min(len(calls) - 1, 1)]

    monkeypatch.setattr(_doctor_repair, "observe", lambda *a, **k: (None, None))
    monkeypatch.setattr(_doctor_repair, "classify", fake_classify)
    hooks = _doctor_repair.RealHooks(Layout(home=denv.home, socket=denv.socket,
                                     registry=denv.registry))
    verdict = hooks.reprobe(denv.socket)
    assert verdict is not None
    assert verdict.status is Status.CURRENT  # slow for a moment, then answering: not repaired
    assert len(calls) == 2


def test_doctor_reprobe_gives_up_after_its_window(denv: DaemonEnv, monkeypatch: Any) -> None:
    stuck = Verdict(status=Status.UNREACHABLE, cause="x", generation="g", pid=1, start_id="s")
    calls: list[int] = []

    def fake_classify(obs: Any, **kw: Any) -> Verdict:
        calls.append(len(calls))
        return stuck

    monkeypatch.setattr(_doctor_repair, "observe", lambda *a, **k: (None, None))
    monkeypatch.setattr(_doctor_repair, "classify", fake_classify)
    hooks = _doctor_repair.RealHooks(Layout(home=denv.home, socket=denv.socket,
                                     registry=denv.registry))
    clock = iter([0.0, 0.0, 1.0, 2.0, 3.0])  # time.monotonic as the window sees it
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))  # as _doctor_repair sees it
    monkeypatch.setattr(time, "sleep", lambda _s: None)
    assert hooks.reprobe(denv.socket) == stuck
    assert len(calls) == 4  # at 0, 1, 2 and 3 s: still stuck at the end of the 3 s window


def test_cli_prints_no_progress_for_a_healthy_supervisor(denv: DaemonEnv) -> None:
    cp = denv.run("-p", "hi")
    assert cp.returncode == 0
    assert cp.stderr == ""


async def test_the_trio_client_waits_for_a_paused_supervisor_too(denv: DaemonEnv) -> None:
    import trio

    import trio_agentd

    assert denv.prompt("warm") == "[echo turn 1] warm"
    sup = int(denv.owner()["pid"])
    os.kill(sup, signal.SIGSTOP)
    try:
        async with trio.open_nursery() as nursery:
            answers: list[str] = []

            async def prompt() -> None:
                async with trio_agentd.open_client(
                    denv.socket, home=str(denv.home), registry=str(denv.registry),
                    autostart=False,
                ) as client:
                    answers.append(await client.prompt("default", "again"))

            nursery.start_soon(prompt)
            # past the hello timeout the client is still waiting, not failing
            await trio.sleep(2.0)  # the pause under test, not a wait for an event
            assert answers == []
            os.kill(sup, signal.SIGCONT)
    finally:
        os.kill(sup, signal.SIGCONT)
    assert answers == ["[echo turn 2] again\n"]
