"""``trio-agentd logs`` / ``logs -f`` / ``logs --daemon`` / ``rm`` and log rotation, through the
CLI against real supervisors and workers."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

from trio_agentd._cli_exit import EXIT_OWN

from .harness import DaemonEnv, failure_status, wait_for


def gated_agent(gate: Path) -> str:
    """An exec agent that prints a line, waits until ``gate`` exists, then prints another."""
    return (f"exec:sh -c 'read p; echo \"first $p\"; while [ ! -e {gate} ]; do sleep 0.02;"
            " done; echo \"second $p\"'")


class Reader:
    """Collects a process's stdout in a thread, so a test can wait for a piece of it."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.text = ""
        self._lock = threading.Lock()
        assert proc.stdout is not None
        stream = proc.stdout
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: object) -> None:
        fd = stream.fileno()  # type: ignore[attr-defined]
        while True:
            data = os.read(fd, 4096)
            if not data:
                return
            with self._lock:
                self.text += data.decode(errors="replace")

    def has(self, piece: str) -> bool:
        with self._lock:
            return piece in self.text


def test_logs_prints_turns_and_events(denv: DaemonEnv) -> None:
    denv.prompt("hello")
    denv.prompt("second one")
    cp = denv.run("logs", "default")
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert lines[0].startswith("==> worker started, pid ")
    assert lines[1].startswith("==> turn 1 · ")
    assert lines[1].endswith(" · prompt:")
    assert lines[2:5] == ["hello", "==> output (20 bytes):", "[echo turn 1] hello"]
    assert lines[6:9] == ["second one", "==> output (25 bytes):", "[echo turn 2] second one"]
    assert len(lines) == 9

    last = denv.run("logs", "default", "-n", "1", "--json")
    recs = [json.loads(line) for line in last.stdout.splitlines()]
    assert [(r["kind"], r["turn"], r["reply"]) for r in recs] == [
        ("turn", 2, "[echo turn 2] second one\n")]


def test_logs_of_an_unknown_or_invalid_session(denv: DaemonEnv) -> None:
    cp = denv.run("logs", "nosuch")
    assert cp.returncode == failure_status(cp)
    assert cp.stderr.count("\n") == 1
    assert "no session 'nosuch'" in cp.stderr
    bad = denv.run("logs", "-bad/")
    assert bad.returncode == 2
    bad = denv.run("logs", "a/b")
    assert bad.returncode == 2
    assert "invalid session id 'a/b'" in bad.stderr
    assert not os.path.exists(denv.socket)  # nothing needed a daemon


def test_logs_follow_streams_a_turn_from_another_client(denv: DaemonEnv) -> None:
    gate = denv.root / "gate"
    gate.touch()
    assert denv.run("-p", "-s", "g", "--agent", gated_agent(gate), "setup").returncode == 0
    gate.unlink()
    follower = denv.popen("logs", "g", "-f")
    out = Reader(follower)
    wait_for(lambda: out.has("second setup\n"), timeout=20, what="the history")

    prompter = denv.popen("-p", "-s", "g", "live")
    # streamed while the turn still runs: the gate is closed
    wait_for(lambda: out.has("first live\n"), timeout=20, what="the live chunk")
    assert not out.has("second live")
    assert prompter.poll() is None
    gate.touch()
    assert prompter.wait(timeout=20) == 0
    wait_for(lambda: out.has("second live\n"), timeout=20, what="the end of the turn")
    assert out.text.count("first live") == 1  # once, not again from the transcript
    assert follower.poll() is None
    follower.send_signal(signal.SIGINT)
    assert follower.wait(timeout=10) == 130


def test_logs_follow_survives_a_worker_restart(denv: DaemonEnv) -> None:
    denv.prompt("one", session="r")
    follower = denv.popen("logs", "r", "-f")
    out = Reader(follower)
    wait_for(lambda: out.has("[echo turn 1] one"), timeout=20, what="the history")
    pid = json.loads(denv.run("sessions", "--json").stdout)[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    denv.prompt("two", session="r")
    wait_for(lambda: out.has("[echo turn 2] two"), timeout=20, what="the turn after")
    assert out.has("(the one before it ended without stopping: killed or crashed)")
    follower.send_signal(signal.SIGINT)
    assert follower.wait(timeout=10) == 130


def test_rm_refuses_a_running_turn_then_force_removes_and_the_id_is_new(
    denv: DaemonEnv,
) -> None:
    gate = denv.root / "gate"
    prompter = denv.popen("-p", "-s", "b", "--agent", gated_agent(gate), "work")
    session_dir = denv.home / "sessions" / "b"
    wait_for(lambda: (session_dir / "transcript.jsonl").exists()
             and b"worker_started" in (session_dir / "transcript.jsonl").read_bytes(),
             timeout=20, what="the worker")
    wait_for(lambda: json.loads(denv.run("sessions", "--json").stdout)[0]["state"] == "ready",
             timeout=20, what="ready")
    # the turn runs (it printed its first line, then waits on the gate)
    follower = denv.popen("logs", "b", "-f")
    out = Reader(follower)
    wait_for(lambda: out.has("first work"), timeout=20, what="the turn to run")

    refused = denv.run("rm", "b")
    assert refused.returncode == 1
    assert refused.stderr == (
        "trio-agentd: error: session b is running a turn — wait for it, `trio-agentd cancel b`,"
        " or `trio-agentd rm --force b`\n")
    assert session_dir.is_dir()

    forced = denv.run("rm", "--force", "b")
    assert (forced.returncode, forced.stdout, forced.stderr) == (0, "removed session b\n", "")
    assert prompter.wait(timeout=20) == EXIT_OWN
    assert "session b was killed" in (prompter.stderr.read() if prompter.stderr else "")
    assert not session_dir.exists()
    assert not list(denv.home.glob("daemons/*/journal/b.jsonl"))
    assert not list(denv.home.glob("daemons/*/workers/b.*"))
    assert follower.wait(timeout=20) == 1  # the followed session is gone
    assert json.loads(denv.run("sessions", "--json").stdout) == []

    # the id is a brand-new session: turn 1, the default agent
    assert denv.prompt("again", session="b") == "[echo turn 1] again"
    assert denv.run("logs", "b").stdout.count("==> turn ") == 1
    gone = denv.run("rm", "nosuch")
    assert gone.returncode == 1
    assert "no session 'nosuch'" in gone.stderr


def test_rm_of_an_idle_and_of_a_stopped_session(denv: DaemonEnv) -> None:
    denv.prompt("x", session="i")
    denv.prompt("y", session="k")
    assert denv.run("kill", "k").returncode == 0  # forgotten, its data stays
    assert (denv.home / "sessions" / "k").is_dir()
    for sid in ("i", "k"):
        cp = denv.run("rm", sid)
        assert (cp.returncode, cp.stderr) == (0, ""), sid
        assert not (denv.home / "sessions" / sid).exists()
    assert denv.prompt("z", session="i") == "[echo turn 1] z"


def test_logs_and_transcripts_rotate_with_small_limits(denv: DaemonEnv) -> None:
    limits = {"TRIO_AGENTD_LOG_MAX_BYTES": "700", "TRIO_AGENTD_LOG_BACKUPS": "2"}
    denv.env.update(limits)
    for i in range(12):
        denv.prompt(f"prompt number {i} with some padding", session="rot")
    session_dir = denv.home / "sessions" / "rot"
    names = sorted(p.name for p in session_dir.iterdir())
    assert [n for n in names if n.startswith("transcript")] == [
        "transcript.jsonl", "transcript.jsonl.1", "transcript.jsonl.2"]
    for n in ("transcript.jsonl", "transcript.jsonl.1", "transcript.jsonl.2"):
        assert (session_dir / n).stat().st_size <= 700
    # turn numbers go on across rotations and after a worker restart
    pid = json.loads(denv.run("sessions", "--json").stdout)[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert denv.prompt("after", session="rot") == "[echo turn 13] after"
    last = denv.run("logs", "rot", "-n", "2", "--json").stdout.splitlines()
    turns = [json.loads(line)["turn"] for line in last if json.loads(line)["kind"] == "turn"]
    assert turns == [12, 13]

    # worker.log: each ignored signal is a line; it rotates, stderr follows it
    pid = json.loads(denv.run("sessions", "--json").stdout)[0]["pid"]

    def newest() -> tuple[int, int]:
        """worker.log's inode and its SIGUSR1 lines (0, 0 while a rotation has none yet)."""
        try:
            with open(session_dir / "worker.log") as f:
                return os.fstat(f.fileno()).st_ino, f.read().count("signal SIGUSR1")
        except FileNotFoundError:
            return 0, 0

    def logged_since(before: tuple[int, int]) -> bool:
        now = newest()
        return now[0] not in (0, before[0]) or now[1] > before[1]

    for _ in range(12):
        # one at a time, each logged before the next is sent: pending signals of one kind
        # merge (a loaded machine may not run the worker between two kills), and older lines
        # go with the oldest file, so the newest file is what shows this one was logged
        before = newest()
        os.kill(pid, signal.SIGUSR1)
        wait_for(functools.partial(logged_since, before), timeout=20, what="the log line")
    assert (session_dir / "worker.log.2").exists()
    assert not (session_dir / "worker.log.3").exists()
    for name in ("worker.log", "worker.log.1", "worker.log.2"):
        assert (session_dir / name).stat().st_size <= 700

    # daemon.log: each session the supervisor kills is a line
    for i in range(10):
        denv.prompt("x", session=f"d{i}")
        assert denv.run("kill", f"d{i}").returncode == 0
    state = denv.state_dir()
    assert (state / "daemon.log.1").exists()
    assert not (state / "daemon.log.3").exists()
    for p in state.glob("daemon.log*"):
        assert p.stat().st_size <= 700
    tail = denv.run("logs", "--daemon", "-n", "1")
    assert tail.returncode == 0
    assert tail.stdout.count("\n") == 1
    assert "session d9 killed" in tail.stdout


def test_a_stopped_follower_never_slows_a_turn_and_catches_up(denv: DaemonEnv) -> None:
    script, gate = denv.root / "big.sh", denv.root / "gate"
    script.write_text(f"#!/bin/sh\nread n\necho first\nwhile [ ! -e {gate} ]; do sleep 0.02;"
                      " done\nhead -c \"$n\" /dev/zero | tr '\\0' x\n")
    script.chmod(0o700)
    gate.touch()
    assert denv.run("-p", "-s", "big", "--agent", f"exec:{script}", "1").stdout == "first\nx"
    gate.unlink()
    follower = denv.popen("logs", "big", "-f")
    out = Reader(follower)
    size = 9_000_000  # over the 4 MiB a follower may be behind, and every socket buffer
    prompter = denv.popen("-p", "-s", "big", str(size))
    wait_for(lambda: out.text.count("first\n") == 2, timeout=20, what="the turn streaming")
    os.kill(follower.pid, signal.SIGSTOP)  # it reads nothing from here on
    gate.touch()
    assert prompter.stdout is not None
    assert len(prompter.stdout.read()) == len("first\n") + size
    assert prompter.wait(timeout=20) == 0  # the turn ended without waiting for it
    os.kill(follower.pid, signal.SIGCONT)
    def xs() -> int:  # the output's x's (each turn's "==> exit status" line has one too)
        return out.text.count("x") - out.text.count("exit status")

    wait_for(lambda: xs() == 1 + size, timeout=30, what="the follower")
    follower.send_signal(signal.SIGINT)
    assert follower.wait(timeout=10) == 130
    assert xs() == 1 + size  # every byte once
    assert out.text.count("first") == 2
    err = follower.stderr.read() if follower.stderr else ""
    assert err == (
        "trio-agentd: fell more than 4194304 bytes behind the output of session big; the turn"
        " went on without us — `trio-agentd logs big` shows it; catching up\n")


def test_a_prompt_racing_rm_is_killed_or_served_by_a_brand_new_session(
    denv: DaemonEnv,
) -> None:
    gate = denv.root / "gate"
    busy = denv.popen("-p", "-s", "race", "--agent", gated_agent(gate), "old")
    session_dir = denv.home / "sessions" / "race"
    wait_for(lambda: (session_dir / "transcript.jsonl").exists(), timeout=20, what="a worker")
    remover = denv.popen("rm", "--force", "race")
    racer = denv.popen("-p", "-s", "race", "new")
    assert remover.wait(timeout=30) == 0
    assert busy.wait(timeout=30) == EXIT_OWN
    out, err = racer.communicate(timeout=30)
    if racer.returncode == 0:  # it came after the rm: a new session, turn 1, the echo agent
        assert out == "[echo turn 1] new\n"
        history = denv.run("logs", "race", "--json").stdout.splitlines()
        turns = [json.loads(line) for line in history if '"kind": "turn"' in line]
        assert [t["prompt"] for t in turns] == ["new"]
    else:  # it reached the old worker first: cut with the session
        assert racer.returncode == EXIT_OWN
        assert "session race was killed" in err
        assert not session_dir.exists()
