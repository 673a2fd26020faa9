"""``-v`` on client commands and the config file, against real supervisors and workers."""

from __future__ import annotations

import json
import re
from pathlib import Path

from trio_agentd._paths import Layout

from .harness import DaemonEnv, wait_for

_STEP = re.compile(r"^trio-agentd: \[ *\d+\.\d ms\] ")


def _config_file(denv: DaemonEnv) -> Path:
    path = denv.root / "userhome" / ".config" / "trio-agentd" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _steps(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    assert lines, "no trace"
    assert all(_STEP.match(line) for line in lines), lines
    return [_STEP.sub("", line) for line in lines]


def test_verbose_prints_each_connection_step_with_timings(denv: DaemonEnv) -> None:
    first = denv.run("-v", "-p", "hi")
    assert (first.returncode, first.stdout) == (0, "[echo turn 1] hi\n")
    steps = _steps(first.stderr)
    hello = denv.hello()
    assert hello is not None
    sock_dir = str(Path(denv.socket).parent)
    assert f"socket {denv.socket}" in steps
    assert f"nobody listens on {denv.socket} (No such file or directory)" in steps
    assert f"autostart: spawned supervisor pid {hello['pid']}; waiting for its hello" in steps
    assert any(s.startswith(f"socket dir {sock_dir}: proven ours") for s in steps)
    assert any(s.startswith(f"connected to {denv.socket}; its peer proven ours") for s in steps)
    assert "route: granted by the supervisor for session default" in steps
    direct = [s for s in steps if s.startswith("route: direct to worker pid ")]
    assert len(direct) == 1
    assert steps[-1] == "prompt: answered"

    # the next prompt: the cached route, the supervisor not contacted, nothing started
    again = denv.run("-p", "again", "-v")
    assert (again.returncode, again.stdout) == (0, "[echo turn 2] again\n")
    steps = _steps(again.stderr)
    assert steps[0] == "route: cached grant for session default (supervisor not contacted)"
    assert not any("autostart" in s or s.startswith("socket ") for s in steps)

    # a command for the supervisor: found running, the request and its answer
    listed = denv.run("-v", "sessions", "--json")
    assert listed.returncode == 0
    assert [r["session"] for r in json.loads(listed.stdout)] == ["default"]
    steps = _steps(listed.stderr)
    assert f"autostart: not needed, supervisor pid {hello['pid']} found running" in steps
    assert steps[-2:] == [f"sessions: sent to the supervisor (pid {hello['pid']})",
                          "sessions: answered"]

    # without -v: not a word on stderr
    quiet = denv.run("sessions")
    assert (quiet.returncode, quiet.stderr) == (0, "")


def test_an_invalid_config_file_stops_the_supervisor_with_one_line(denv: DaemonEnv) -> None:
    path = _config_file(denv)
    path.write_text("[timing]\nidle_eviction = nan\n")
    line = (f"{path}: timing.idle_eviction must be a finite number of seconds >= 0.01"
            " (or 0: off) (got NaN)")
    shown = denv.run("config")
    assert (shown.returncode, shown.stderr) == (1, f"trio-agentd: error: {line}\n")

    foreground = denv.run("daemon", timeout=30)
    assert foreground.returncode == 2
    assert foreground.stderr == (f"trio-agentd: error: {line} — the supervisor does not start"
                                 " on an invalid config\n")
    assert "Traceback" not in foreground.stderr

    # an autostarting prompt: the supervisor it started exits 2; the client shows its cause
    # first, in one line, never the older lines of the daemon log
    log = Layout(home=denv.home, socket=denv.socket, registry=denv.registry).log_path
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with log.open("a") as f:  # what an earlier supervisor wrote
        f.write("2026-01-01 00:00:00,000 supervisor[1] ERROR an old cause\n"
                "trio-agentd: error: an older cause\n")
    prompt = denv.run("-p", "hi")
    assert prompt.returncode == 125
    assert prompt.stderr.count("\n") == 1, prompt.stderr
    assert prompt.stderr.startswith(f"trio-agentd: error: {line}"), prompt.stderr
    assert "the supervisor exited during startup with code 2" in prompt.stderr
    assert "Traceback" not in prompt.stderr
    assert "old" not in prompt.stderr
    assert denv.hello() is None


def test_the_config_file_sets_the_supervisors_default_agent_and_caps(denv: DaemonEnv) -> None:
    path = _config_file(denv)
    path.write_text('default_agent = "shell"\n[limits]\nmax_sessions = 2\n'
                    "[timing]\nidle_eviction = 0\n")
    shell = denv.run("-p", "echo $((40 + 2))")
    assert (shell.returncode, shell.stdout, shell.stderr) == (0, "42\n", "")
    # the flag wins over the file
    echo = denv.run("-p", "-s", "e", "--agent", "echo", "hi")
    assert (echo.returncode, echo.stdout) == (0, "[echo turn 1] hi\n")
    rows = {r["session"]: r["agent"] for r in json.loads(denv.run("sessions", "--json").stdout)}
    assert rows == {"default": "shell", "e": "echo"}
    third = denv.run("-p", "-s", "third", "hi")
    assert third.returncode == 125
    assert "already keeps the most sessions it may (2, stopped ones included)" in third.stderr

    # a change applies from the next supervisor on (restart)
    path.write_text('default_agent = "echo"\n')
    assert denv.run("restart").returncode == 0
    wait_for(lambda: denv.hello() is not None, timeout=30, what="the new supervisor")
    third = denv.run("-p", "-s", "third", "hi")
    assert (third.returncode, third.stdout) == (0, "[echo turn 1] hi\n")
