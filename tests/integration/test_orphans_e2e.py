"""No orphans: a worker killed mid-turn leaves its turn's process group running; the respawned
worker finds it in the journal and stops it (real processes, kill -9)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from trio_agentd import _journal

from .harness import DaemonEnv, wait_for


def _state(pid: int) -> str | None:
    """The state letter of ``pid`` from /proc/PID/stat, ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :][:1].decode()


def _not_running(pid: int) -> bool:
    """Gone, or dead and waiting for a reaper. (An orphan's parent is whatever adopted it when
    its worker died; where that is an init that never reaps, as in some containers, a killed
    orphan stays a zombie for good: nothing the worker does can change that.)"""
    return _state(pid) in (None, "Z", "X")


def _first_line(p: subprocess.Popen[str], timeout: float) -> str:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    fd = p.stdout.fileno()
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for the turn's first line (got {buf!r})"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"the prompt ended before its first line (got {buf!r})"
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def _worker_pid(env: DaemonEnv, session: str) -> int:
    return int(next(d["pid"] for d in env.descriptors() if d["session"] == session))


def _worker_log(env: DaemonEnv, session: str) -> str:
    path = env.home / "sessions" / session / "worker.log"
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this test's own, in its own group, that no journal names."""
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


@pytest.mark.parametrize(
    ("agent", "text"),
    [
        ("shell", "sleep 1000 & echo $!; wait"),
        # the prompt comes on stdin: only "orphan" forks the child (the other prompts end)
        ("exec:sh -c 'read -r l; [ \"$l\" = orphan ] || exit 0; sleep 1000 & echo $!; wait'",
         "orphan"),
    ],
    ids=["shell", "exec"],
)
def test_worker_kill9_mid_turn_next_prompt_stops_the_orphaned_group(
    denv: DaemonEnv, bystander: subprocess.Popen[bytes], agent: str, text: str,
) -> None:
    session = "o"
    cp = denv.run("-p", "-s", session, "--agent", agent, "--", "true")
    assert cp.returncode == 0, cp.stderr
    worker = _worker_pid(denv, session)
    p = denv.popen("-p", "-s", session, "--agent", agent, "--", text)
    sleeper = int(_first_line(p, timeout=30))
    assert not _not_running(sleeper)
    # the sleep's parent is the turn's leader, in the group the worker started
    with open(f"/proc/{sleeper}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    leader, pgid = int(fields[1]), int(fields[2])
    assert pgid == leader

    # the client is frozen (not killed: a client that goes away cancels its turn, which then
    # stops its own group), so that no retry of its own respawns the worker: the next prompt
    # below does
    os.kill(p.pid, signal.SIGSTOP)
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: _state(worker) in (None, "Z", "X"), timeout=10, what="the worker to die")
    # That the orphan outlived its worker (so that this test means something) is not checked
    # here: the supervisor may already have respawned the worker, which stops the group at once.
    # The new worker's log below proves it, naming the sleeper among the members it found alive.

    # the next prompt (or the supervisor itself, which may restart a worker that died with a
    # command in flight) respawns the worker, which stops the orphaned group first
    cp = denv.run("-p", "-s", session, "--agent", agent, "--", "true")
    assert cp.returncode == 0, cp.stderr
    assert _worker_pid(denv, session) != worker
    wait_for(lambda: _not_running(sleeper) and _not_running(leader), timeout=10,
             what="the orphaned group to be stopped")

    def logged() -> str:
        log = _worker_log(denv, session)
        return next((ln for ln in log.splitlines() if "orphaned process group" in ln), "")

    line = wait_for(logged, timeout=10, what="the worker to log the orphaned group")
    assert f"group {pgid}" in line, line
    assert str(sleeper) in re.findall(r"\d+", line.split("members", 1)[1]), line
    assert bystander.poll() is None
    assert not _not_running(bystander.pid)
    p.kill()
    p.communicate(timeout=10)

    # handled once: the journal says so, and the next restart does not try it again
    journal = denv.state_dir() / "journal" / f"{session}.jsonl"

    def stopped_records() -> list[dict[str, object]]:
        data = _journal.written(journal.read_bytes())
        records = [json.loads(ln) for ln in data.splitlines() if ln.strip()]
        return [r for r in records if r.get("kind") == "group_stopped"]

    stopped = wait_for(stopped_records, timeout=10, what="the stop to be journaled")
    assert [(r["pgid"], r["outcome"]) for r in stopped] == [(pgid, "stopped")]
    os.kill(_worker_pid(denv, session), signal.SIGKILL)
    cp = denv.run("-p", "-s", session, "--agent", agent, "--", "true")
    assert cp.returncode == 0, cp.stderr
    assert len(stopped_records()) == 1
