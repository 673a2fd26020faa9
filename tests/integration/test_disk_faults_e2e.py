"""End to end: a worker whose files hit RLIMIT_FSIZE (EFBIG, as ENOSPC or EDQUOT would) answers
``storage_error``, leaves no torn journal record, and takes prompts again once the limit is
raised: the real supervisor and worker processes, the real CLI."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess

from trio_agentd import _journal

from .harness import DaemonEnv, failure_status, wait_for

LIMIT = 160 * 1024  # bytes a file of the daemon's may grow to (soft limit; hard: unlimited)
TEXT = "x" * 16 * 1024  # each prompt adds ~32 KiB to the journal (prompt and reply)


def _limited() -> None:
    # soft limit only: the test (same user, no privilege) can raise it again with prlimit
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


def test_full_disk_answers_storage_error_and_the_session_recovers_when_space_returns(
    denv: DaemonEnv,
) -> None:
    daemon = subprocess.Popen(
        denv.argv("daemon"), env=denv.env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_limited,
    )
    denv.procs.append(daemon)
    wait_for(lambda: denv.hello() is not None, timeout=30, what="the daemon to listen")

    failed = None
    for i in range(1, 30):
        cp = denv.run("-p", "-s", "disk", f"{i} {TEXT}")
        if cp.returncode != 0:
            failed = (i, cp)
            break
        assert cp.stdout.startswith(f"[echo turn {i}] {i} "), cp.stderr
    assert failed is not None, "the file size limit was never reached"
    n, cp = failed
    assert n > 1
    journal = denv.home / "journal" / "disk.jsonl"
    if not journal.exists():
        (journal,) = denv.home.rglob("disk.jsonl")
    assert str(journal) in cp.stderr
    assert "EFBIG" in cp.stderr
    assert "free space on that filesystem" in cp.stderr
    assert "Traceback" not in cp.stderr
    # either its acceptance could not be written (it never ran), or its result could not
    # (it ran and streamed its reply; the result is kept and written once there is room)
    ran = "the turn ran" in cp.stderr
    assert (cp.stdout != "") is ran, (cp.stdout[:40], cp.stderr)

    # no torn tail: every line parses
    data = _journal.written(journal.read_bytes())
    assert data.endswith(b"\n")
    records = [json.loads(line) for line in data.splitlines()]
    assert [r["kind"] for r in records].count("completed") == n - 1
    assert len(data) <= LIMIT

    # not wedged: asking again while the disk is still full is answered the same way
    again = denv.run("-p", "-s", "disk", f"{n} {TEXT}")
    assert again.returncode != 0
    assert str(journal) in again.stderr
    assert "Traceback" not in again.stderr

    # space returns (the limit is raised on the running processes): the next prompt is run
    (desc,) = [d for d in denv.descriptors() if d.get("session") == "disk"]
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    for pid in (daemon.pid, int(desc["pid"])):
        resource.prlimit(pid, resource.RLIMIT_FSIZE, unlimited)
    turn = n + 1 if ran else n
    cp = denv.run("-p", "-s", "disk", f"{n} {TEXT}")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.startswith(f"[echo turn {turn}] {n} ")
    assert denv.prompt("small", session="disk") == f"[echo turn {turn + 1}] small"
    records = [json.loads(line) for line in _journal.written(journal.read_bytes()).splitlines()]
    assert [r["kind"] for r in records].count("completed") == turn + 1
    assert _journal.parse(journal.read_bytes()).pending() == []


def test_a_worker_start_on_a_full_disk_answers_storage_error_and_needs_no_retry_after(
    denv: DaemonEnv,
) -> None:
    """Starting a worker writes its files first (token, descriptor, session metadata): when
    those writes fail, the prompt gets ``storage_error`` naming the file, not "failed … run
    `trio-agentd retry`", and the first prompt once there is room runs."""
    daemon = subprocess.Popen(
        denv.argv("daemon"), env=denv.env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )
    denv.procs.append(daemon)
    wait_for(lambda: denv.hello() is not None, timeout=30, what="the daemon to listen")
    assert denv.prompt("hi", session="old") == "[echo turn 1] hi"
    (desc,) = [d for d in denv.descriptors() if d.get("session") == "old"]

    # the disk fills up (RLIMIT_FSIZE 0: EFBIG, as ENOSPC would be); the old session's worker
    # dies meanwhile, and a new session is asked for
    resource.prlimit(daemon.pid, resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
    os.kill(int(desc["pid"]), signal.SIGKILL)
    for session in ("new", "old", "new"):
        cp = denv.run("-p", "-s", session, "hello")
        assert cp.returncode == failure_status(cp), (session, cp.stdout, cp.stderr)
        assert "EFBIG" in cp.stderr, cp.stderr
        assert "free space on that filesystem" in cp.stderr, cp.stderr
        assert "retry" not in cp.stderr, cp.stderr
        assert "failed (restarted" not in cp.stderr, cp.stderr
        assert len(cp.stderr.strip().splitlines()) == 1, cp.stderr

    # space returns: both sessions take prompts, no `retry` needed
    resource.prlimit(daemon.pid, resource.RLIMIT_FSIZE,
                     (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert denv.prompt("again", session="old") == "[echo turn 2] again"
    assert denv.prompt("first", session="new") == "[echo turn 1] first"
    assert daemon.poll() is None
    assert "Traceback" not in denv.log_text()
