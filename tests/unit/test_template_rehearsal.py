"""The fork template's rehearsal schedule (pure: the run, the clock and the log line are
fakes) and where its scratch directories go."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._forktemplate import HEADER, _Rehearsal, _serve
from trio_agentd._protocol import Response
from trio_agentd._rehearsal import RehearsalFailed
from trio_agentd._scratch import SCRATCH_PREFIX, clear_stale, scratch_root
from trio_agentd._stream import MessageStream


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_run_counts_down_to_done() -> None:
    runs: list[int] = []
    r = _Rehearsal(3, run=lambda: runs.append(1), clock=Clock(), say=lambda line: runs.append(0))
    for left in (2, 1, 0):
        r.run_one()
        assert r.left == left
    assert runs == [1, 1, 1]  # three runs, no line


def test_a_failed_run_ends_the_rehearsal_with_one_line() -> None:
    said: list[str] = []

    def fail() -> None:
        raise OSError(28, "No space left on device")

    r = _Rehearsal(10, run=fail, clock=Clock(), say=said.append)
    r.run_one()
    assert r.left == 0
    assert said == ["rehearsal failed (OSError: [Errno 28] No space left on device); forking"
                    " without the rest of it (the workers are as good, they only share less"
                    " memory with the template); its scratch directory goes under $TMPDIR, else"
                    " /dev/shm: point TMPDIR at a private directory with room to fix it"]


def test_a_run_failing_inside_its_event_loop_is_told_by_its_first_exception() -> None:
    said: list[str] = []

    def fail() -> None:
        raise ExceptionGroup("Exceptions from Trio nursery (1 sub-exception)",
                             [RehearsalFailed("the rehearsed worker refused: busy")])

    _Rehearsal(10, run=fail, clock=Clock(), say=said.append).run_one()
    assert said[0].startswith("rehearsal failed (RehearsalFailed: the rehearsed worker refused:"
                              " busy); ")
    assert "TMPDIR" not in said[0]  # not a matter of its scratch directory


def test_a_run_longer_than_run_max_ends_the_rehearsal_a_run_at_the_limit_does_not() -> None:
    clock = Clock()
    said: list[str] = []
    took = [0.25, 0.2501]

    def run() -> None:
        clock.now += took.pop(0)

    r = _Rehearsal(10, run_max=0.25, run=run, clock=clock, say=said.append)
    r.run_one()
    assert (r.left, said) == (9, [])
    r.run_one()
    assert r.left == 0
    assert said == ["a rehearsal run took 0.250 s (more than 0.25 s: a loaded machine or a slow"
                    " scratch directory); forking without the rest"]


def test_a_slow_last_run_says_nothing() -> None:
    clock = Clock()
    said: list[str] = []

    def run() -> None:
        clock.now += 5.0

    r = _Rehearsal(1, run_max=0.25, run=run, clock=clock, say=said.append)
    r.run_one()
    assert (r.left, said) == (0, [])


def test_scratch_goes_to_tmpdir_if_set_else_to_dev_shm_if_writable() -> None:
    assert scratch_root({"TMPDIR": "/x/y"}) == "/x/y"
    shm_ok = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)
    assert scratch_root({}) == ("/dev/shm" if shm_ok else None)
    assert scratch_root({"TMPDIR": ""}) == scratch_root({})


class FakeRehearsal:
    """Counts its runs; ``quiet`` long enough that a request sent at once always comes first."""

    def __init__(self, runs: int, quiet: float) -> None:
        self.left = runs
        self.quiet = quiet
        self.steps: list[float] = []

    def step(self) -> None:
        self.steps.append(time.monotonic())
        self.left -= 1


def test_the_template_rehearses_only_after_a_quiet_spell_and_answers_requests_first() -> None:
    ours, theirs = socket.socketpair()
    ours.settimeout(30)
    rehearsal = FakeRehearsal(3, quiet=2.0)
    result: list[object] = []
    server = threading.Thread(target=lambda: result.append(_serve(theirs, rehearsal)))
    server.start()
    try:
        # requests closer together than the quiet: each answered, no run between them
        for _ in range(3):
            assert _status(ours) == 3
        asked = time.monotonic()
        # then none: the runs follow, back to back, and the template says so
        while rehearsal.left:
            time.sleep(0.05)
        assert len(rehearsal.steps) == 3
        assert rehearsal.steps[0] >= asked + 2.0
        assert _status(ours) == 0
    finally:
        ours.close()  # end of file: the loop returns
        server.join(timeout=30)
        theirs.close()
    assert result == [None]


def _status(sock: socket.socket) -> int:
    body = json.dumps({"status": True}).encode()
    sock.sendall(HEADER.pack(len(body)) + body)
    head = sock.recv(HEADER.size, socket.MSG_WAITALL)
    (size,) = HEADER.unpack(head)
    reply = json.loads(sock.recv(size, socket.MSG_WAITALL))
    left = reply["rehearsal_left"]
    assert isinstance(left, int)
    return left


def test_scratch_left_by_a_killed_template_is_cleared_and_a_live_ones_kept(
    tmp_path: Path,
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process (until reused: then it is kept, harmlessly)
    stale = tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-abc"
    (stale / "session").mkdir(parents=True)
    (stale / "journal.jsonl").write_bytes(b"{}\n")
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-def"
    live.mkdir()
    other = tmp_path / "trio-agentd-other-1-x"
    other.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-lnk"
    link.symlink_to(elsewhere)
    assert clear_stale(str(tmp_path)) == [stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, other.name, elsewhere.name, link.name])
    assert clear_stale(str(tmp_path / "missing")) == []


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


def test_a_run_that_hangs_is_cancelled_at_its_deadline_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stuck run (here: one that waits forever) cannot hold the template: it is cancelled at
    its deadline, exactly (virtual time), and its scratch directory goes."""
    from trio_agentd import _rehearsal

    ended: list[float] = []

    async def hang(scratch: Path) -> None:
        try:
            await trio.sleep_forever()
        finally:
            ended.append(trio.current_time())

    monkeypatch.setattr(_rehearsal, "_session", hang)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    clock = trio.testing.MockClock(autojump_threshold=0)
    with pytest.raises(RehearsalFailed, match=r"a run went on past 0\.25 s .* was cancelled"):
        _rehearsal.rehearse(1, 0.25, clock=clock)
    assert ended == [0.25]
    assert os.listdir(tmp_path) == []


def test_a_real_run_cancelled_midway_leaves_no_descriptor_handler_or_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rehearsed worker, up and serving two connections, a prompt journalled, cancelled at
    the deadline (its fake supervisor stops waiting for the answer: the fake clock then jumps
    there), closes everything it opened: its journal, transcript, socket, connections."""
    from trio_agentd import _rehearsal

    answered = _rehearsal._answer
    stuck: list[float] = []

    async def stuck_after_first(ms: MessageStream, rid: int) -> Response:
        if rid == 1 and not stuck:
            await answered(ms, rid)  # the first answer read: the worker is fully up
            stuck.append(trio.current_time())
            await trio.sleep_forever()
        return await answered(ms, rid)

    monkeypatch.setattr(_rehearsal, "_answer", stuck_after_first)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    root = logging.getLogger()
    handlers, fds = list(root.handlers), _fds()
    with pytest.raises(RehearsalFailed, match="was cancelled"):
        _rehearsal.rehearse(1, 0.25, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(stuck) == 1
    assert stuck[0] < 0.25
    assert root.handlers == handlers
    assert _fds() == fds
    assert os.listdir(tmp_path) == []


def test_the_template_gives_each_run_its_run_max_as_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_agentd import _rehearsal

    asked: list[tuple[int, float | None]] = []
    monkeypatch.setattr(_rehearsal, "rehearse",
                        lambda runs=1, deadline=None: asked.append((runs, deadline)))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    r = _Rehearsal(2, run_max=0.3, clock=Clock(), say=lambda line: None)
    r.run_one()
    r.run_one()
    assert asked == [(1, 0.3), (1, 0.3)]
    assert r.left == 0
