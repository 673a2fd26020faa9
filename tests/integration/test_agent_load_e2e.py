"""Agents load as a user expects, and an agent that cannot load or start is the answer: through
the ``trio-agentd`` console script, against a real daemon, from the user's own directories.

- a ``module:attribute`` agent that cannot be loaded answers the prompt with the exception's
  last line and where its traceback is; the session is ``failed`` with that cause (``sessions``,
  ``--json``), no worker is started again by itself, and ``retry`` after the fix works;
- an ``exec:`` program that is missing or not executable fails the prompt with the cause and the
  session is shown ``failed`` with it until a turn succeeds (or ``retry``);
- ``--cwd DIR`` for a new session, refused before anything starts when DIR is unusable, and
  refused for an existing session that works elsewhere;
- a cwd and a prompt that are not valid UTF-8 travel intact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import DaemonEnv, wait_for

CLI = str(Path(sys.executable).parent / "trio-agentd")

GOOD_AGENT = '''
class Agent:
    replayable = True

    async def turn(self, prompt, ctx):
        yield f"[fixed turn {ctx.turn}] {prompt}\\n"


def make():
    return Agent()
'''


def cli(env: DaemonEnv, *args: str | bytes, cwd: Path | str | bytes | None = None
        ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [CLI, *args], env=env.env, capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
        cwd=cwd,
    )


def sessions(env: DaemonEnv) -> dict[str, dict[str, object]]:
    cp = cli(env, "sessions", "--json")
    assert cp.returncode == 0, cp.stderr
    return {row["session"]: row for row in json.loads(cp.stdout)}


def one_line_error(cp: subprocess.CompletedProcess[bytes], status: int) -> str:
    assert cp.returncode == status, (cp.returncode, cp.stdout, cp.stderr)
    assert cp.stdout == b""
    err = cp.stderr.decode()
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def project(env: DaemonEnv, source: str) -> Path:
    """The user's project dir with ``myagent.py`` in it (imported from there, the session's
    cwd: the daemon and its worker run elsewhere)."""
    proj = env.root / "proj"
    proj.mkdir(exist_ok=True)
    (proj / "myagent.py").write_text(source)
    return proj


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("import nosuchmodule_xyz\n", "ModuleNotFoundError: No module named 'nosuchmodule_xyz'"),
        ("def make(:\n", "SyntaxError: invalid syntax (myagent.py, line 1)"),
        ("def make():\n    raise RuntimeError('set API_KEY first')\n",
         "RuntimeError: set API_KEY first"),
        ("def make():\n    return None\n", "its factory returned NoneType, which has no"
         " turn()/replayable"),
    ],
    ids=["import", "syntax", "factory-raises", "factory-returns-none"],
)
def test_an_agent_that_cannot_load_is_the_answer_and_retry_after_the_fix_works(
        denv: DaemonEnv, source: str, says: str) -> None:
    proj = project(denv, source)
    log = denv.home / "sessions" / "m1" / "worker.log"
    # 126: the agent cannot be run (as for an exec: program that is not executable)
    err = one_line_error(
        cli(denv, "-p", "-s", "m1", "--agent", "myagent:make", "hi", cwd=proj), 126)
    assert f"session m1 failed: agent 'myagent:make' cannot be loaded: {says}" in err
    assert f"(full traceback in {log})" in err
    assert "fix it, then run `trio-agentd retry m1`" in err
    if "returned" not in says:
        assert "Traceback (most recent call last)" in log.read_text()

    row = sessions(denv)["m1"]
    assert row["state"] == "failed"
    assert row["pid"] is None
    assert row["restarts"] == 0
    assert isinstance(row["cause"], str)
    assert says in row["cause"]
    assert str(log) in row["cause"]
    table = cli(denv, "sessions").stdout.decode().splitlines()
    assert table[0].split()[-1] == "CAUSE"
    assert says in table[1]
    assert " failed " in table[1]

    # no restart loop: the next prompt gets the same answer and starts no worker
    spawns = log.read_text().count("cannot be loaded")
    assert one_line_error(cli(denv, "-p", "-s", "m1", "again", cwd=proj), 126) == err
    assert log.read_text().count("cannot be loaded") == spawns == 1
    assert sessions(denv)["m1"]["restarts"] == 0

    (proj / "myagent.py").write_text(GOOD_AGENT)
    assert cli(denv, "retry", "m1").returncode == 0
    cp = cli(denv, "-p", "-s", "m1", "hello", cwd=denv.root)  # any cwd: the session's counts
    assert (cp.returncode, cp.stdout, cp.stderr) == (0, b"[fixed turn 1] hello\n", b"")
    row = sessions(denv)["m1"]
    assert (row["state"], row["cause"]) == ("ready", None)


def test_the_cause_survives_a_supervisor_restart(denv: DaemonEnv) -> None:
    proj = project(denv, "import nosuchmodule_xyz\n")
    one_line_error(cli(denv, "-p", "-s", "m1", "--agent", "myagent:make", "hi", cwd=proj), 126)
    old_pid = denv.owner()["pid"]
    assert cli(denv, "restart").returncode == 0
    wait_for(lambda: (h := denv.hello()) is not None and h["pid"] != old_pid, timeout=30,
             what="the successor supervisor")
    row = sessions(denv)["m1"]
    assert row["state"] == "failed"
    assert "No module named 'nosuchmodule_xyz'" in str(row["cause"])


@pytest.mark.parametrize("kind", ["missing", "not-executable"])
def test_an_exec_program_that_cannot_run_leaves_the_session_failed_until_a_turn_runs(
        denv: DaemonEnv, kind: str) -> None:
    proj = denv.root / "proj"
    proj.mkdir()
    tool = proj / "tool"
    if kind == "not-executable":
        tool.write_text("#!/bin/sh\necho tool ran\n")
    err = one_line_error(cli(denv, "-p", "-s", "x1", "--agent", "exec:./tool", "hi", cwd=proj),
                         127 if kind == "missing" else 126)
    says = ("no executable at './tool'" if kind == "missing"
            else "'./tool' is not executable (Permission denied) — make it executable")
    assert says in err
    row = sessions(denv)["x1"]
    assert row["state"] == "failed"
    assert says in str(row["cause"])
    assert isinstance(row["pid"], int)  # the worker is fine: the next prompt tries again

    tool.write_text("#!/bin/sh\necho tool ran\n")
    tool.chmod(0o755)
    cp = cli(denv, "-p", "-s", "x1", "again")
    assert (cp.returncode, cp.stdout) == (0, b"tool ran\n"), cp.stderr
    row = sessions(denv)["x1"]
    assert (row["state"], row["cause"]) == ("ready", None)


def test_retry_clears_an_exec_start_failure(denv: DaemonEnv) -> None:
    one_line_error(cli(denv, "-p", "-s", "x1", "--agent", "exec:trio-agentd-no-such-tool", "hi"),
                   127)
    assert sessions(denv)["x1"]["state"] == "failed"
    cp = cli(denv, "retry", "x1")
    assert cp.returncode == 0, cp.stderr
    assert (sessions(denv)["x1"]["state"], sessions(denv)["x1"]["cause"]) == ("ready", None)


def test_cwd_sets_a_new_sessions_directory(denv: DaemonEnv) -> None:
    work = denv.root / "work"
    work.mkdir()
    cp = cli(denv, "-p", "-s", "c1", "--agent", "shell", "--cwd", str(work), "pwd",
             cwd=denv.root)
    assert (cp.returncode, cp.stdout) == (0, f"{work}\n".encode()), cp.stderr
    # the same directory by another spelling is the same
    cp = cli(denv, "-p", "-s", "c1", "--cwd", "work/", "pwd", cwd=denv.root)
    assert (cp.returncode, cp.stdout) == (0, f"{work}\n".encode()), cp.stderr
    # without --cwd the session keeps its own, wherever the client is
    cp = cli(denv, "-p", "-s", "c1", "pwd", cwd="/")
    assert (cp.returncode, cp.stdout) == (0, f"{work}\n".encode()), cp.stderr


def test_cwd_of_another_directory_for_an_existing_session_names_its_own(
        denv: DaemonEnv) -> None:
    work = denv.root / "work"
    work.mkdir()
    assert cli(denv, "-p", "-s", "c1", "--agent", "shell", "pwd", cwd=work).returncode == 0
    err = one_line_error(cli(denv, "-p", "-s", "c1", "--cwd", str(denv.root), "pwd"), 125)
    assert f"session 'c1' works in {work}, not {denv.root} — drop --cwd" in err
    assert sessions(denv)["c1"]["turns"] == 1  # nothing ran


@pytest.mark.parametrize(("make", "says"), [
    (None, "does not exist"),
    ("file", "is not a directory"),
])
def test_an_unusable_cwd_is_a_usage_error_before_anything_starts(
        denv: DaemonEnv, make: str | None, says: str) -> None:
    target = denv.root / "target"
    if make == "file":
        target.write_text("")
    cp = cli(denv, "-p", "-s", "c1", "--cwd", str(target), "hi")
    assert cp.returncode == 2
    assert cp.stdout == b""
    assert cp.stderr.decode() == (
        f"trio-agentd: error: --cwd '{target}' {says} — create it, or give an existing"
        " directory\n")
    assert not os.path.exists(denv.socket)
    assert not denv.home.exists()
    assert denv.our_pids() == []


def test_a_cwd_and_a_prompt_that_are_not_utf8_travel_intact(denv: DaemonEnv) -> None:
    odd = os.fsencode(denv.root) + b"/caf\xe9-\xff"
    os.mkdir(odd)
    prompt = b"na\xefve \xff\xfe text"
    # the client's own cwd, and the shell there
    cp = cli(denv, "-p", "-s", "u1", "--agent", "shell", "pwd", cwd=odd)
    assert (cp.returncode, cp.stdout) == (0, odd + b"\n"), cp.stderr
    # a prompt argument, to a program that writes back what it got on stdin
    cp = cli(denv, "-p", "-s", "u2", "--agent", "exec:cat", prompt, cwd=odd)
    assert (cp.returncode, cp.stdout) == (0, prompt), cp.stderr
    cp = cli(denv, "-p", "-s", "u3", prompt, cwd=odd)  # echo: the bytes come back exactly
    assert (cp.returncode, cp.stdout) == (0, b"[echo turn 1] " + prompt + b"\n"), cp.stderr
    # --cwd naming it
    cp = cli(denv, "-p", "-s", "u4", "--agent", "shell", b"--cwd", odd, "pwd")
    assert (cp.returncode, cp.stdout) == (0, odd + b"\n"), cp.stderr
    # and an error naming it shows its bytes escaped, on one line
    err = one_line_error(cli(denv, "-p", "-s", "u4", "--cwd", "/", "pwd"), 125)
    assert "works in " + os.fsdecode(odd).encode("utf-8", "surrogateescape").decode(
        "utf-8", "backslashreplace") in err
