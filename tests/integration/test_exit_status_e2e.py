"""A turn's exit status and stderr, through the CLI as a user types it, and the async client.

The CLI exits with the agent's status (128 + N for a death by signal N, 126/127 for a program
that cannot be run / is not found); the agent's stderr streams to the CLI's stderr as it comes,
apart from the reply; ``--json`` and the transcript keep both streams and the status.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import trio

from trio_agentd import open_client
from trio_agentd._cli_exit import EXIT_OWN

from .harness import DaemonEnv

CLI = str(Path(sys.executable).parent / "trio-agentd")
FAILING = "exec:sh -c 'echo out; echo err >&2; exit 7'"


def cli(env: DaemonEnv, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([CLI, *args], env=env.env, capture_output=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def transcript(env: DaemonEnv, session: str) -> list[dict[str, object]]:
    path = env.home / "sessions" / session / "transcript.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [rec for rec in lines if rec.get("kind") == "turn"]


def test_the_cli_exits_with_the_agents_status_and_streams_its_stderr_apart(
    denv: DaemonEnv,
) -> None:
    cp = cli(denv, "-p", "-s", "f", "--agent", FAILING, "go")
    assert (cp.returncode, cp.stdout, cp.stderr) == (7, b"out\n", b"err\n")
    ok = cli(denv, "-p", "-s", "sh", "--agent", "shell", "--", "echo fine; true")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, b"fine\n", b"")
    [turn] = transcript(denv, "f")
    assert (turn["reply"], turn["stderr"], turn["exit_status"]) == ("out\n", "err\n", 7)


def test_a_death_by_signal_exits_128_plus_the_signal_and_says_so(denv: DaemonEnv) -> None:
    agent = "exec:sh -c 'echo before; kill -TERM $$'"
    cp = cli(denv, "-p", "-s", "k", "--agent", agent, "go")
    assert cp.returncode == 128 + 15
    assert cp.stdout == b"before\n"
    assert cp.stderr == b"trio-agentd: error: the agent was killed by SIGTERM\n"
    # in a shell session a command killed by a signal is $? = 128 + N, as a shell reports it
    cp = cli(denv, "-p", "-s", "k2", "--agent", "shell", "--", "echo before; sh -c 'kill -TERM $$'")
    assert (cp.returncode, cp.stdout) == (128 + 15, b"before\n")


def test_a_program_that_is_missing_or_not_executable_exits_127_or_126(
    denv: DaemonEnv, tmp_path: Path
) -> None:
    cp = cli(denv, "-p", "-s", "m", "--agent", "exec:no-such-program-xyz", "hi")
    assert cp.returncode == 127, cp.stderr
    assert b"no-such-program-xyz" in cp.stderr
    assert cp.stderr.count(b"\n") == 1
    script = tmp_path / "not-exec.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    cp = cli(denv, "-p", "-s", "n", "--agent", f"exec:{script}", "hi")
    assert cp.returncode == 126, cp.stderr


def test_trio_agentds_own_failure_is_125_never_an_agent_status(denv: DaemonEnv) -> None:
    # a socket path the kernel cannot bind: nothing reaches an agent
    long_sock = str(denv.root / ("x" * 120 + ".sock"))
    cp = cli(denv, "--socket", long_sock, "-p", "hi")
    assert cp.returncode == EXIT_OWN == 125
    assert cp.stdout == b""


def test_json_carries_the_exit_status_and_both_streams(denv: DaemonEnv) -> None:
    cp = cli(denv, "-p", "-s", "j", "--agent", FAILING, "--json", "go")
    assert cp.returncode == 7
    got = json.loads(cp.stdout)
    assert (got["exit_status"], got["stdout"], got["stderr"]) == (7, "out\n", "err\n")
    # bytes that are not UTF-8 come base64-encoded, exactly
    binary = "exec:sh -c 'printf \"\\377ok\"; printf \"\\376\" >&2'"
    got = json.loads(cli(denv, "-p", "-s", "b", "--agent", binary, "--json", "x").stdout)
    assert base64.b64decode(got["stdout_base64"]) == b"\xffok"
    assert base64.b64decode(got["stderr_base64"]) == b"\xfe"
    assert got["exit_status"] == 0
    # an agent that reports no status (echo) is null, and the CLI exits 0
    echo = cli(denv, "-p", "-s", "e", "--json", "hi")
    assert echo.returncode == 0
    assert json.loads(echo.stdout)["exit_status"] is None


def test_stderr_reaches_the_cli_while_the_turn_still_runs(denv: DaemonEnv) -> None:
    go = denv.root / "go"
    script = f"echo started >&2; while [ ! -e {go} ]; do sleep 0.01; done; echo done"
    p = subprocess.Popen([CLI, "-p", "-s", "live", "--agent", "shell", "--", script],
                         env=denv.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        assert p.stderr is not None
        ready, _, _ = select.select([p.stderr], [], [], 30)
        assert ready, "no stderr within 30 s"
        assert os.read(p.stderr.fileno(), 100) == b"started\n"
        assert p.poll() is None  # the turn still waits for the go file
        go.touch()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert (p.returncode, out, err) == (0, b"done\n", b"")


async def test_big_stderr_and_stdout_arrive_byte_exact_through_the_async_client(
    denv: DaemonEnv,
) -> None:
    # both streams past the inline limit: kept in files, sent as chunks, each exactly once
    script = ("head -c 300000 /dev/zero | tr '\\0' o; head -c 200000 /dev/zero | tr '\\0' e >&2;"
              " exit 3")
    with trio.fail_after(60):
        async with open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry)
        ) as client:
            got = await client.prompt_turn("big", script, agent="shell")
    assert got.stdout == b"o" * 300000
    assert got.stderr == b"e" * 200000
    assert got.exit_status == 3
    [turn] = transcript(denv, "big")
    assert (turn["bytes"], turn["stderr_bytes"], turn["exit_status"]) == (300000, 200000, 3)
    assert Path(str(turn["stderr_output"])).read_bytes() == b"e" * 200000
