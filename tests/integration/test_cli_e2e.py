"""The ``trio-agentd`` console script as agents and pipelines run it, against a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trio_agentd._cli_exit import EXIT_OWN

from .harness import DaemonEnv

CLI = str(Path(sys.executable).parent / "trio-agentd")


def cli(env: DaemonEnv, *args: str, stdin: bytes | None = None,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [CLI, *args], env={**env.env, **(extra_env or {})}, capture_output=True, timeout=60,
        input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def ok(cp: subprocess.CompletedProcess[bytes]) -> str:
    assert cp.returncode == 0, (cp.returncode, cp.stderr)
    assert cp.stderr == b""
    return cp.stdout.decode()


def test_prompt_from_stdin_when_no_text(denv: DaemonEnv) -> None:
    assert ok(cli(denv, "-p", stdin=b"hello\n")) == "[echo turn 1] hello\n"
    # several lines stay as they are; only the one trailing newline goes
    assert ok(cli(denv, "-p", "-s", "m", stdin=b"one\ntwo\n")) == "[echo turn 1] one\ntwo\n"


def test_dash_reads_the_prompt_from_stdin(denv: DaemonEnv) -> None:
    assert ok(cli(denv, "-p", "-s", "s1", "-", stdin=b"from stdin\n")) == (
        "[echo turn 1] from stdin\n")


def test_empty_stdin_and_no_text_is_a_usage_error(denv: DaemonEnv) -> None:
    cp = cli(denv, "-p")  # stdin is /dev/null
    assert cp.returncode == 2
    assert b"prompt needs TEXT: none given and stdin was empty" in cp.stderr
    assert not os.path.exists(denv.socket)


def test_options_after_text_apply(denv: DaemonEnv) -> None:
    assert ok(cli(denv, "-p", "hello", "-s", "other")) == "[echo turn 1] hello\n"
    got = json.loads(ok(cli(denv, "-p", "again", "--session=other", "--json")))
    assert (got["session"], got["turn"], got["stdout"]) == ("other", 2, "[echo turn 2] again\n")
    assert (denv.home / "sessions" / "other").is_dir()
    assert not (denv.home / "sessions" / "default").exists()


def test_double_dash_makes_the_rest_text(denv: DaemonEnv) -> None:
    out = ok(cli(denv, "-p", "-s", "sh", "--agent", "shell", "--", "echo", "-s", "x", "--json"))
    assert out == "-s x --json\n"
    assert ok(cli(denv, "-p", "-s", "e", "--", "-s", "other")) == "[echo turn 1] -s other\n"
    # options before the -- still count, wherever they are; after it, nothing is an option
    got = json.loads(ok(cli(denv, "-p", "-s", "e", "hello", "--json", "--", "--json", "-")))
    assert (got["session"], got["turn"]) == ("e", 2)
    assert got["stdout"] == "[echo turn 2] hello --json -\n"
    assert not (denv.home / "sessions" / "other").exists()


@pytest.mark.parametrize("bad", ["", "a b", "abc\n", "../x"])
def test_bad_session_id_is_a_usage_error_and_contacts_no_daemon(
        denv: DaemonEnv, bad: str) -> None:
    cp = cli(denv, "-p", "-s", bad, "hello")
    assert cp.returncode == 2
    assert cp.stdout == b""
    err = cp.stderr.decode()
    assert f"invalid session id {bad!r}" in err
    assert "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit" in err
    assert "Traceback" not in err
    # nothing was started: no socket, no state, no process of ours
    assert not os.path.exists(denv.socket)
    assert not denv.home.exists()
    assert denv.our_pids() == []


def test_closed_stdout_ends_quietly_with_status_141(denv: DaemonEnv) -> None:
    ok(cli(denv, "-p", "-s", "sh", "--agent", "shell", "--", "true"))
    p = subprocess.Popen(
        [CLI, "-p", "-s", "sh", "--", "seq 1 100000"], env=denv.env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    denv.procs.append(p)  # type: ignore[arg-type]  # teardown kills it if it hangs
    assert p.stdout is not None
    assert p.stderr is not None
    assert p.stdout.readline() == b"1\n"
    p.stdout.close()  # as `head -1` does: far more than a pipe buffer is still to come
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141
    assert err == b""


def test_a_stdout_closed_from_the_start_gets_one_line_and_runs_nothing(denv: DaemonEnv) -> None:
    """``trio-agentd -p … >&-``: no traceback; the prompt is never sent (the answer would have
    nowhere to go), so the session's next turn is still turn 1. A closed stderr only loses
    the agent's diagnostics: the answer comes."""
    err_r, err_w = os.pipe()
    cp = subprocess.run(
        [CLI, "-p", "-s", "closed", "hi"], env=denv.env, stdin=subprocess.DEVNULL,
        stderr=err_w, timeout=60, preexec_fn=lambda: os.close(1),
    )
    os.close(err_w)
    with os.fdopen(err_r, "rb") as f:
        err = f.read().decode()
    assert cp.returncode == EXIT_OWN, err
    assert err.startswith("trio-agentd: error: stdout is closed (descriptor 1)"), err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1
    cp = subprocess.run(
        [CLI, "-p", "-s", "closed", "--agent", "shell", "--", "echo out; echo diag >&2"],
        env=denv.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, timeout=60,
        preexec_fn=lambda: os.close(2),
    )
    assert cp.returncode == 0
    assert cp.stdout == b"out\n"  # (the session was made by this prompt: nothing ran before)
    assert ok(cli(denv, "-p", "-s", "closed2", "x")) == "[echo turn 1] x\n"
    # the other commands too: whatever they print goes nowhere, and no traceback
    cp = subprocess.run([CLI, "sessions"], env=denv.env, stdin=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, timeout=60,
                        preexec_fn=lambda: os.close(1))
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr == b""


def test_answers_are_utf8_whatever_the_terminal_encoding(denv: DaemonEnv) -> None:
    cp = cli(denv, "-p", "héllo ✓ 日本", extra_env={"PYTHONIOENCODING": "ascii"})
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr == b""
    assert cp.stdout == "[echo turn 1] héllo ✓ 日本\n".encode()


def test_stdin_that_is_not_utf8_fails_or_succeeds_cleanly(denv: DaemonEnv) -> None:
    cp = cli(denv, "-p", stdin=b"bad \xff\xfe bytes\n")
    assert b"Traceback" not in cp.stderr
    if cp.returncode == 0:  # the bytes went through and came back as they were
        assert cp.stdout == b"[echo turn 1] bad \xff\xfe bytes\n"
    else:
        assert cp.returncode == EXIT_OWN
        assert cp.stderr.startswith(b"trio-agentd: error: ")
        assert cp.stderr.count(b"\n") == 1
    # the daemon is still fine
    assert ok(cli(denv, "-p", "after")).endswith("after\n")


WARM_PATH_PROBE = """
import sys
before = set(sys.modules)
from trio_agentd import cli
code = cli.run(sys.argv[1:])
sys.stdout.flush()
print(" ".join(sorted(set(sys.modules) - before)), file=sys.stderr)
sys.exit(code)
"""


def test_warm_prompt_builds_no_argparse_parser_and_imports_no_heavy_module(
        denv: DaemonEnv) -> None:
    ok(cli(denv, "-p", "warm up"))
    cp = subprocess.run(
        [sys.executable, "-c", WARM_PATH_PROBE, "--socket", denv.socket, "-v", "-p", "hi",
         "-s", "default"],
        env=denv.env, capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == b"[echo turn 2] hi\n"
    loaded = set(cp.stderr.decode().split())
    assert "trio_agentd._syncclient" in loaded
    heavy = {"argparse", "shutil", "trio", "dataclasses", "typing", "pathlib", "datetime",
             "trio_agentd._session"}
    assert not loaded & heavy, loaded & heavy
