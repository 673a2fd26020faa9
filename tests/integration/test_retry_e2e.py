"""``trio-agentd retry`` says what it did: re-armed a failed session, or nothing to retry."""

from __future__ import annotations

from .harness import DaemonEnv


def test_retry_on_a_healthy_session_says_there_was_nothing_to_retry(denv: DaemonEnv) -> None:
    assert denv.prompt("hi", session="ok") == "[echo turn 1] hi"
    cp = denv.run("retry", "ok")
    assert (cp.returncode, cp.stdout, cp.stderr) == (
        0, "session ok is ready: nothing to retry (it has not failed)\n", "")
