"""An LLM-like CLI agent (tests/fake_llm.py) hosted by trio-agentd, driven through the CLI as a
user types it: streamed tokens, progress on stderr, a child tool process, chosen exit status.
"""

from __future__ import annotations

import json
import select
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from .harness import DaemonEnv, wait_for

CLI = str(Path(sys.executable).parent / "trio-agentd")
FAKE_LLM = Path(__file__).resolve().parent.parent / "fake_llm.py"
AGENT = f"exec:{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_LLM))}"


def cli(env: DaemonEnv, *args: str, stdin: bytes | None = None,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [CLI, *args], env={**env.env, **(extra_env or {})}, capture_output=True, timeout=60,
        input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1][1:2]
    except OSError:
        return True
    return state in (b"Z", b"X")


def test_tokens_stderr_tool_and_exit_status_as_a_user_sees_them(denv: DaemonEnv) -> None:
    cp = cli(denv, "-p", "-s", "llm", "--agent", AGENT, "hello there tool=grep exit=3")
    assert cp.returncode == 3, cp.stderr
    assert cp.stdout == b"answer: hello there\ntool grep ran\n"
    assert cp.stderr == b"thinking about 2 words\ncalling tool grep\ndone\n"
    # the same session takes the next prompt; success exits 0
    ok = cli(denv, "-p", "-s", "llm", "again")
    assert (ok.returncode, ok.stdout) == (0, b"answer: again\n"), ok.stderr


def test_the_prompt_comes_from_stdin_like_any_unix_tool(denv: DaemonEnv) -> None:
    cp = cli(denv, "-p", "-s", "in", "--agent", AGENT, stdin=b"piped words exit=4\n")
    assert (cp.returncode, cp.stdout) == (4, b"answer: piped words\n"), cp.stderr
    cp = cli(denv, "-p", "-s", "in", "-", stdin=b"dash too\n")
    assert (cp.returncode, cp.stdout) == (0, b"answer: dash too\n"), cp.stderr


def test_tokens_stream_before_the_agent_ends(denv: DaemonEnv) -> None:
    # the tool sleeps long after the tokens were written: they must arrive before it ends
    pids = denv.root / "tool.pids"
    p = subprocess.Popen(
        [CLI, "-p", "-s", "st", "--agent", AGENT, "early words tool=t tool_sleep=30"],
        env={**denv.env, "FAKE_LLM_PIDS": str(pids)}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    denv.procs.append(p)  # type: ignore[arg-type]  # teardown kills it if the test fails
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 30)
    assert ready, "no tokens within 30 s"
    assert p.stdout.readline() == b"answer: early words\n"
    # the tool runs (its pid is written once it started)
    tool = int(wait_for(lambda: pids.read_text().split() if pids.exists() else [],
                        timeout=30, what="the tool's pid")[0])
    assert p.poll() is None
    p.send_signal(signal.SIGINT)  # Ctrl-C: cancels the turn, tool and all
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert b"Traceback" not in err
    assert _gone(tool)
    # the session serves the next prompt at once
    cp = cli(denv, "-p", "-s", "st", "next")
    assert (cp.returncode, cp.stdout) == (0, b"answer: next\n"), cp.stderr


def test_a_closed_stdout_ends_the_cli_quietly(denv: DaemonEnv) -> None:
    p = subprocess.Popen(
        [CLI, "-p", "-s", "big", "--agent", AGENT, "many tokens=400000 delay=0"],
        env=denv.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    denv.procs.append(p)  # type: ignore[arg-type]
    assert p.stdout is not None
    assert p.stderr is not None
    assert p.stdout.read(8) == b"answer: "  # (the tokens come a few bytes at a time)
    p.stdout.close()  # as `| head -c 8` does, with megabytes still to come
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141
    # the agent's own progress still reaches stderr; trio-agentd adds nothing
    assert b"trio-agentd" not in err
    assert b"Traceback" not in err


def test_cwd_sets_where_a_new_session_runs_and_a_missing_one_is_a_usage_error(
    denv: DaemonEnv, tmp_path: Path
) -> None:
    work = tmp_path / "project"
    work.mkdir()
    cp = cli(denv, "-p", "-s", "w", "--cwd", str(work), "--agent", AGENT, "where cwd=1")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == f"answer: where\ncwd: {work}\n".encode()
    missing = cli(denv, "-p", "-s", "w2", "--cwd", str(tmp_path / "nope"), "--agent", AGENT, "x")
    assert missing.returncode == 2
    assert str(tmp_path / "nope").encode() in missing.stderr
    assert b"Traceback" not in missing.stderr


def test_an_agent_program_that_is_gone_fails_the_prompt_and_the_session_is_not_ready(
    denv: DaemonEnv, tmp_path: Path
) -> None:
    copy = tmp_path / "llm.py"
    copy.write_bytes(FAKE_LLM.read_bytes())
    copy.chmod(0o755)
    agent = f"exec:{shlex.quote(sys.executable)} {shlex.quote(str(copy))}"
    assert cli(denv, "-p", "-s", "g", "--agent", agent, "first").returncode == 0
    # the agent is uninstalled under the running session: its interpreter is, here
    gone = f"exec:{tmp_path / 'no-such-llm'}"
    cp = cli(denv, "-p", "-s", "g2", "--agent", gone, "hello")
    assert cp.returncode == 127, cp.stderr
    assert cp.stderr.count(b"\n") == 1
    rows = {r["session"]: r for r in json.loads(cli(denv, "sessions", "--json").stdout)}
    assert rows["g"]["state"] == "ready"
    assert rows["g2"]["state"] != "ready"
    assert "no-such-llm" in str(rows["g2"].get("cause"))


def test_as_a_python_agent_it_loads_from_the_sessions_directory(
    denv: DaemonEnv, tmp_path: Path
) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "fake_llm.py").write_bytes(FAKE_LLM.read_bytes())
    cp = cli(denv, "-p", "-s", "py", "--cwd", str(project), "--agent", "fake_llm:agent",
             "from python exit=5")
    assert (cp.returncode, cp.stdout) == (5, b"answer: from python\n"), cp.stderr
    assert cp.stderr == b"thinking about 2 words\ndone\n"


def test_inside_a_shell_session_state_carries_over_between_prompts(
    denv: DaemonEnv, tmp_path: Path
) -> None:
    (tmp_path / "work").mkdir()
    run = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_LLM))}"
    first = cli(denv, "-p", "-s", "sh", "--agent", "shell", "--",
                f"cd {shlex.quote(str(tmp_path / 'work'))} && LLM={shlex.quote(run)}")
    assert first.returncode == 0, first.stderr
    cp = cli(denv, "-p", "-s", "sh", "--", "echo 'hi there cwd=1 exit=3' | $LLM")
    assert cp.returncode == 3, cp.stderr
    assert cp.stdout == f"answer: hi there\ncwd: {tmp_path / 'work'}\n".encode()
    assert cp.stderr == b"thinking about 2 words\ndone\n"


def test_its_history_shows_prompt_output_stderr_and_status(denv: DaemonEnv) -> None:
    assert cli(denv, "-p", "-s", "h", "--agent", AGENT, "one two exit=4").returncode == 4
    logs = cli(denv, "logs", "h")
    assert logs.returncode == 0, logs.stderr
    text = logs.stdout.decode()
    assert "one two exit=4" in text
    assert "answer: one two\n" in text
    assert "thinking about 2 words" in text
    assert "exit status 4" in text
    [turn] = [json.loads(line) for line in cli(denv, "logs", "h", "--json").stdout.splitlines()
              if json.loads(line).get("kind") == "turn"]
    assert (turn["reply"], turn["exit_status"]) == ("answer: one two\n", 4)
    assert turn["stderr"] == "thinking about 2 words\ndone\n"
