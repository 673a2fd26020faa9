"""The ``shell`` agent through the CLI, against a real daemon: one shell per session.

What is asserted works whichever way the worker passes the shell's stderr on (with the reply,
or apart from it): the notice of a new shell is looked for in both streams.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from .harness import DaemonEnv, wait_for


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1][1:2]
    except OSError:
        return True
    return state in (b"Z", b"X")


def _worker_pid(env: DaemonEnv, session: str) -> int:
    return int(next(d["pid"] for d in env.descriptors() if d["session"] == session))


def shell(env: DaemonEnv, session: str, text: str) -> tuple[str, str]:
    """One prompt to the session's shell: (stdout, stderr) of a CLI that exited 0."""
    cp = env.run("-p", "-s", session, "--agent", "shell", "--", text)
    assert cp.returncode == 0, cp.stderr
    return cp.stdout, cp.stderr


def test_cd_variables_and_functions_carry_over(denv: DaemonEnv, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    shell(denv, "t", f"cd '{tmp_path}/sub'; x=forty-two; greet() {{ echo \"hi $1\"; }}")
    assert shell(denv, "t", "pwd; echo $x; greet you") == (
        f"{tmp_path}/sub\nforty-two\nhi you\n", "")


def test_a_new_worker_starts_its_shell_where_the_last_one_was_and_says_so(
    denv: DaemonEnv, tmp_path: Path,
) -> None:
    (tmp_path / "sub").mkdir()
    out, _ = shell(denv, "w", f"cd '{tmp_path}/sub'; x=1; echo $$")
    first_shell = int(out)
    worker = _worker_pid(denv, "w")
    os.kill(worker, signal.SIGKILL)
    # an idle shell reads EOF on its control socket once its worker is gone, and exits
    wait_for(lambda: _gone(first_shell), timeout=10, what="the shell to exit with its worker")

    out, err = shell(denv, "w", "pwd; echo \"x=$x\"")
    assert _worker_pid(denv, "w") != worker
    both = out + err
    assert f"{tmp_path}/sub\nx=\n" in out
    notice = next(line for line in both.splitlines() if "a new shell started" in line)
    assert f"a new shell started in {tmp_path}/sub" in notice
    assert "ended with its worker" in notice
    # said once: the next answer is the command's alone
    assert shell(denv, "w", "echo again") == ("again\n", "")


def test_cancel_stops_the_command_and_keeps_the_shell(denv: DaemonEnv) -> None:
    out, _ = shell(denv, "c", "x=kept; echo $$")
    shell_pid = int(out)
    p = denv.popen("-p", "-s", "c", "--", "sleep 1000 & echo $!; wait")
    assert p.stdout is not None
    child = int(p.stdout.readline())
    cp = denv.run("cancel", "c")
    assert cp.returncode == 0, cp.stderr
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert _gone(child)
    assert not _gone(shell_pid)
    assert shell(denv, "c", "echo $x $$") == (f"kept {shell_pid}\n", "")


def test_a_worker_killed_mid_turn_leaves_nothing_and_the_next_shell_starts(
    denv: DaemonEnv, tmp_path: Path,
) -> None:
    shell(denv, "o", f"cd '{tmp_path}'")
    p = denv.popen("-p", "-s", "o", "--", "echo $$; sleep 1000")
    assert p.stdout is not None
    first_shell = int(p.stdout.readline())
    os.kill(p.pid, signal.SIGSTOP)  # its own retry must not be what respawns the worker
    os.kill(_worker_pid(denv, "o"), signal.SIGKILL)
    out, err = shell(denv, "o", "pwd")
    # the respawned worker stopped the journaled group: the old shell and its sleep
    wait_for(lambda: _gone(first_shell), timeout=10, what="the orphaned shell to be stopped")
    assert f"{tmp_path}\n" in out
    assert "a new shell started in" in out + err
