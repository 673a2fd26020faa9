"""Disk faults (ENOSPC, EDQUOT, EFBIG) lose nothing and wedge nothing: WorkerCore on MockClock
with a fault-injecting file layer (``os.write`` / ``os.fdatasync`` fail for chosen files).

A failed journal append leaves no torn record, answers ``storage_error`` and releases the
turn; a failed flush fails every command waiting on it; once space returns the session takes
prompts again, a command that never ran is run by its resend, and one that ran is answered
from its kept result without running twice.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.component.test_worker_refence import (
    GatedAgent,
    SupervisorEnd,
    connect_owner,
    reply,
    responses_to,
)
from trio_agentd import _journal
from trio_agentd._errors import AgentdError
from trio_agentd._handle import WorkerHandle
from trio_agentd._protocol import ErrorBody, Response
from trio_agentd._recovery import Mode
from trio_agentd._session import Transcript
from trio_agentd._workercore import WorkerCore
from trio_agentd._workerjournal import Journal
from trio_agentd._workerturns import interrupted_error
from trio_agentd.testing import FakeWorkerOps, MemoryRegistry, make_worker_core
from trio_agentd.timing import DEFAULT_TIMING, Timing

pytestmark = pytest.mark.timeout(20)

Rule = Callable[[str, bytes], bool]


class Disk:
    """Fault injection: a write for which ``rule(path, data)`` holds is torn (half of it is
    written) and then fails with ``code``; ``sync_failures`` next fdatasyncs of the journal
    fail with EIO. Every failed write attempt is logged with its virtual time."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rule: Rule | None = None
        self.code = errno.ENOSPC
        self.sync_failures = 0
        self.failed_writes: list[tuple[float, str]] = []
        self._owed: set[int] = set()
        real_write, real_fdatasync = os.write, os.fdatasync

        def write(fd: int, data: Any) -> int:
            path = _path_of(fd)
            if fd in self._owed:  # the rest of a torn write: refused
                self._owed.discard(fd)
                self.failed_writes.append((trio.current_time(), os.path.basename(path)))
                raise OSError(self.code, os.strerror(self.code))
            if self.rule is not None and self.rule(path, bytes(data)):
                self._owed.add(fd)  # torn: half of it lands, the rest fails
                return real_write(fd, bytes(data)[: len(data) // 2])
            return real_write(fd, data)

        def fdatasync(fd: int) -> None:
            if self.sync_failures and _path_of(fd).endswith(".jsonl"):
                self.sync_failures -= 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real_fdatasync(fd)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fdatasync", fdatasync)

    def fill(self, rule: Rule) -> None:
        self.rule = rule

    def free(self) -> None:
        self.rule = None


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def journal_file(path: str, _data: bytes) -> bool:
    return path.endswith("s1.jsonl")


def record_kind(kind: str) -> Rule:
    return lambda path, data: path.endswith("s1.jsonl") and f'"kind":"{kind}"'.encode() in data


def transcript_fails(times: int) -> Rule:
    """The first ``times`` writes to a transcript fail."""
    calls = 0

    def rule(path: str, _data: bytes) -> bool:
        nonlocal calls
        if not path.endswith("transcript.jsonl"):
            return False
        calls += 1
        return calls <= times

    return rule


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    return Disk(monkeypatch)


class NonReplayable(GatedAgent):
    replayable = False


@pytest.fixture
def files(tmp_path: Path) -> Iterator[tuple[Journal, Transcript]]:
    journal = Journal(tmp_path / "journal" / "s1.jsonl")
    transcript = Transcript(tmp_path / "sessions" / "s1")
    yield journal, transcript
    journal.close()
    transcript.close()


def make_core(
    agent: GatedAgent, files: tuple[Journal, Transcript], timing: Timing = DEFAULT_TIMING
) -> tuple[WorkerCore, MemoryRegistry]:
    registry = MemoryRegistry()
    core = make_worker_core(registry, agent=agent, timing=timing)
    core.journal, core.transcript = files
    return core, registry


async def start(nursery: trio.Nursery, core: WorkerCore, registry: MemoryRegistry) -> SupervisorEnd:
    rec = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    await nursery.start(core.serve)
    return await connect_owner(nursery, core, rec)


async def ask(sup: SupervisorEnd, request_id: int, text: str, command_id: str) -> Response:
    await sup.prompt(request_id, text, command_id=command_id)
    return (await responses_to(sup, {request_id}))[request_id]


def journal_lines(journal: Journal) -> list[dict[str, Any]]:
    """Every line of the journal file, each of which must parse (no torn record), up to the
    zeros the journal writes ahead of its records."""
    data = records(journal)
    assert data == b"" or data.endswith(b"\n"), data[-80:]
    return [json.loads(line) for line in data.splitlines()]


def records(journal: Journal) -> bytes:
    """The journal file's bytes up to the room written ahead (NUL bytes, never in a record)."""
    written = _journal.written(journal.path.read_bytes())
    assert b"\0" not in written, "a NUL byte among the records"
    return written


def kinds(journal: Journal) -> list[tuple[str, str]]:
    return [(rec["kind"], str(rec["id"])) for rec in journal_lines(journal)]


def assert_released(core: WorkerCore) -> None:
    assert core._running == {}
    assert core._turn.value == 1
    assert core.status()["busy"] is False


def storage_failure(resp: Response, journal: Journal, *, ran: bool) -> str:
    assert resp.ok is False
    assert isinstance(resp.error, ErrorBody)
    assert resp.error.code == "storage_error"
    message = str(resp.error.message)
    assert str(journal.path) in message
    assert "free space on that filesystem" in message
    assert "send the prompt again" in message
    assert ("the turn ran" in message) is ran
    return message


# --- a failed append -------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
async def test_failed_acceptance_is_cut_back_answered_and_the_turn_released(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
    code: int,
) -> None:
    agent = GatedAgent()
    core, registry = make_core(agent, files)
    journal = files[0]
    sup = await start(nursery, core, registry)
    assert await ask(sup, 1, "before", "c0") == reply(1, 1, "reply 1: before")
    before = records(journal)

    disk.code = code
    disk.fill(journal_file)
    resp = await ask(sup, 2, "first", "c1")
    message = storage_failure(resp, journal, ran=False)
    assert errno.errorcode[code] in message
    assert disk.failed_writes == [(0.0, "s1.jsonl")]
    # the torn half-record was cut back: the records are exactly as before the append
    assert records(journal) == before
    assert kinds(journal)[-1] == ("completed", "c0")
    assert agent.prompts == ["before"]
    assert_released(core)

    # a second prompt while the disk is still full is answered too (nothing is wedged)
    storage_failure(await ask(sup, 3, "second", "c2"), journal, ran=False)
    assert_released(core)

    # space returns: the resend of the failed command id runs (it was never accepted)
    disk.free()
    assert await ask(sup, 4, "first", "c1") == reply(4, 2, "reply 2: first")
    assert await ask(sup, 5, "third", "c3") == reply(5, 3, "reply 3: third")
    assert agent.prompts == ["before", "first", "third"]
    assert [k for k in kinds(journal) if k[0] != "started"] == [
        ("accepted", "c0"), ("completed", "c0"),
        ("accepted", "c1"), ("completed", "c1"),
        ("accepted", "c3"), ("completed", "c3"),
    ]


async def test_failed_outcome_append_keeps_the_result_and_a_resend_gets_it_without_a_rerun(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
) -> None:
    agent = NonReplayable()
    core, registry = make_core(agent, files)
    journal = files[0]
    sup = await start(nursery, core, registry)

    disk.fill(record_kind("completed"))
    resp = await ask(sup, 1, "effects", "c1")
    storage_failure(resp, journal, ran=True)
    assert agent.prompts == ["effects"]
    assert_released(core)
    assert kinds(journal) == [("accepted", "c1"), ("started", "c1")]  # no torn tail

    # still full: a resend is told so, and does not run the turn again
    storage_failure(await ask(sup, 2, "effects", "c1"), journal, ran=True)
    assert agent.prompts == ["effects"]

    disk.free()
    assert await ask(sup, 3, "effects", "c1") == reply(3, 1, "reply 1: effects")
    assert await ask(sup, 4, "next", "c2") == reply(4, 2, "reply 2: next")
    assert agent.prompts == ["effects", "next"]
    assert ("completed", "c1") in kinds(journal)
    # a restart finds c1 completed, nothing pending
    assert Journal(journal.path).state.pending() == []


async def test_failed_started_marker_never_runs_the_turn_and_a_resend_runs_it(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
) -> None:
    agent = NonReplayable()
    core, registry = make_core(agent, files)
    journal = files[0]
    sup = await start(nursery, core, registry)
    disk.fill(record_kind("started"))
    storage_failure(await ask(sup, 1, "x", "c1"), journal, ran=False)
    assert agent.prompts == []
    assert_released(core)
    # its acceptance ends at once: no accepted command is left without its end
    assert kinds(journal) == [("accepted", "c1"), ("dropped", "c1")]
    assert _journal.parse(journal.path.read_bytes()).pending() == []
    disk.free()
    assert await ask(sup, 2, "x", "c1") == reply(2, 1, "reply 1: x")
    assert agent.prompts == ["x"]
    assert _journal.parse(journal.path.read_bytes()).pending() == []


async def test_a_command_refused_while_the_disk_is_full_ends_once_space_returns(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
) -> None:
    """Accepted, then the disk fills before it runs: the client is told it did not run, and
    the record that ends its acceptance, which cannot be written yet, is written before the
    next record once space returns."""
    agent = NonReplayable()
    core, registry = make_core(agent, files)
    journal = files[0]
    sup = await start(nursery, core, registry)
    # the acceptance lands; everything after it (its started marker too) finds the disk full
    disk.fill(lambda path, data: path.endswith("s1.jsonl") and b'"kind":"accepted"' not in data)
    storage_failure(await ask(sup, 1, "x", "c1"), journal, ran=False)
    assert agent.prompts == []
    assert_released(core)
    assert kinds(journal) == [("accepted", "c1")]  # its end is kept, not yet written
    disk.free()
    assert await ask(sup, 2, "y", "c2") == reply(2, 1, "reply 1: y")
    assert kinds(journal)[:2] == [("accepted", "c1"), ("dropped", "c1")]
    assert _journal.parse(journal.path.read_bytes()).pending() == []
    assert agent.prompts == ["y"]


# --- a failed flush --------------------------------------------------------------------------


async def test_failed_inline_flush_forgets_the_acceptance_and_a_resend_runs_it(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
) -> None:
    agent = NonReplayable()
    core, registry = make_core(agent, files)
    journal = files[0]
    sup = await start(nursery, core, registry)
    disk.sync_failures = 1
    resp = await ask(sup, 1, "x", "c1")
    assert "EIO" in storage_failure(resp, journal, ran=False)
    assert agent.prompts == []  # it never ran: its acceptance never reached the disk
    assert_released(core)
    assert kinds(journal) == []  # cut back to the last good flush
    assert journal.state.accepted == {}

    assert await ask(sup, 2, "x", "c1") == reply(2, 1, "reply 1: x")
    assert agent.prompts == ["x"]


async def test_failed_group_flush_fails_every_waiter_and_keeps_what_ran(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
) -> None:
    agent = NonReplayable()
    release = agent.gate("first")
    core, registry = make_core(agent, files)
    journal = files[0]
    sup = await start(nursery, core, registry)

    flusher_flushes: list[int] = []
    real_run_sync = trio.to_thread.run_sync

    async def run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
        flusher_flushes.append(len(flusher_flushes))
        return await real_run_sync(fn, *args, **kwargs)

    await sup.prompt(1, "first", command_id="c1")
    await agent.started["first"].wait()
    await sup.prompt(2, "second", command_id="c2")
    await sup.prompt(3, "third", command_id="c3")
    await trio.testing.wait_all_tasks_blocked()
    # c1's completion and c2's acceptance wait for the flusher's flush (three commands are in
    # flight: nobody flushes inline), which fails
    flushes = journal.flushes
    disk.sync_failures = 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trio.to_thread, "run_sync", run_sync)
        release.set()
        responses = await responses_to(sup, {1, 2, 3})
    assert flusher_flushes  # the group commit's thread flushed
    storage_failure(responses[1], journal, ran=True)  # it ran: its result is kept
    storage_failure(responses[2], journal, ran=False)  # it never started
    assert responses[3] == reply(3, 2, "reply 2: third")  # the flush after that was good
    assert journal.flushes > flushes
    assert agent.prompts == ["first", "third"]
    assert_released(core)

    # c1's result comes from the journal (written again), c2 runs now
    assert await ask(sup, 4, "first", "c1") == reply(4, 1, "reply 1: first")
    assert await ask(sup, 5, "second", "c2") == reply(5, 3, "reply 3: second")
    assert agent.prompts == ["first", "third", "second"]
    done = [k for k in kinds(journal) if k[0] != "started"]
    assert sorted(done) == sorted([
        ("accepted", "c1"), ("completed", "c1"), ("accepted", "c3"), ("completed", "c3"),
        ("accepted", "c2"), ("completed", "c2"),
    ])
    assert Journal(journal.path).state.pending() == []


def test_a_cut_that_failed_is_forgotten_once_a_later_cut_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A torn append whose cut fails leaves a cut owed; a failed flush then cuts back further,
    and that cut succeeds. The owed cut is then stale: made before the next write, it would
    grow the file and put that record where the journal does not think it is, so a later cut
    back would erase it, acknowledged as it was."""

    def rec(n: int) -> bytes:
        return _journal.accepted("c", n, "prompt", {"text": f"prompt {n}"})

    def fail(code: int) -> Callable[..., Any]:
        def failing(*_args: Any) -> Any:
            raise OSError(code, os.strerror(code))
        return failing

    journal = Journal(tmp_path / "journal" / "s1.jsonl")
    journal.append_durable(rec(1))
    journal.append(rec(2))  # written, not yet flushed
    real_write, real_ftruncate, real_fdatasync = os.write, os.ftruncate, os.fdatasync

    def torn(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with caplog.at_level(logging.ERROR, "trio_agentd.worker"):
        monkeypatch.setattr(os, "write", torn)
        monkeypatch.setattr(os, "ftruncate", fail(errno.EIO))
        with pytest.raises(AgentdError):
            journal.append(rec(3))  # torn, and its cut fails: owed
        monkeypatch.setattr(os, "write", real_write)
        monkeypatch.setattr(os, "ftruncate", real_ftruncate)
        monkeypatch.setattr(os, "fdatasync", fail(errno.EIO))
        journal._flush_now()  # fails: cut back to record 1, which works
        monkeypatch.setattr(os, "fdatasync", real_fdatasync)
        seq = journal.append(rec(4))
        journal._flush_now()
        assert journal.lost(seq) is None  # record 4 is durable: its client is told so
        journal.append(rec(5))
        monkeypatch.setattr(os, "fdatasync", fail(errno.EIO))
        journal._flush_now()  # fails: cut back to record 4's end
        monkeypatch.setattr(os, "fdatasync", real_fdatasync)
    data = journal.path.read_bytes()
    assert [k[1] for k in _journal.parse(data).accepted] == ["1", "4"]
    assert _journal.written(data) == rec(1) + rec(4)
    journal.close()


def test_a_cut_still_owed_when_the_worker_stops_is_made_on_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A flush fails and so does the cut back: the command's client is told it did not run
    (send it again). The worker stops before writing anything else: the cut is made then, so
    the next worker does not find the command pending and run it too."""
    first = _journal.accepted("c", 1, "prompt", {"text": "one"})
    journal = Journal(tmp_path / "journal" / "s1.jsonl")
    journal.append_durable(first)
    seq = journal.append(_journal.accepted("c", 2, "prompt", {"text": "two"}))

    def eio(*_args: Any) -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with caplog.at_level(logging.ERROR, "trio_agentd.worker"):
        with monkeypatch.context() as broken:
            broken.setattr(os, "fdatasync", eio)
            broken.setattr(os, "ftruncate", eio)
            journal._flush_now()
        lost = journal.lost(seq)
        assert lost is not None
        assert lost.code == "storage_error"
        journal.close()
    again = Journal(journal.path)
    assert [k for k, _ in again.state.pending()] == [("c", "1")]
    assert journal.path.read_bytes() == first
    again.close()


# --- writes that are retried -----------------------------------------------------------------


async def test_failed_transcript_line_is_retried_on_schedule_then_written(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = GatedAgent()
    timing = Timing(storage_retry_delays=(0.5, 2.0, 4.0))
    core, registry = make_core(agent, files, timing)
    transcript = files[1]
    sup = await start(nursery, core, registry)
    disk.fill(transcript_fails(2))  # two torn attempts (half written, then refused)
    assert await ask(sup, 1, "hello", "c1") == reply(1, 1, "reply 1: hello")
    assert trio.current_time() == 2.5  # 0.5 + 2.0: written at the second retry
    assert disk.failed_writes == [(0.0, "transcript.jsonl"), (0.5, "transcript.jsonl")]
    lines = [json.loads(x) for x in transcript.path.read_bytes().splitlines()]
    lines = [x for x in lines if x["kind"] == "turn"]  # (events besides: a worker start)
    assert [(x["turn"], x["prompt"]) for x in lines] == [(1, "hello")]
    assert "could not write transcript" in caplog.text


class Immediate(GatedAgent):
    """Declares its turns immediate: the connection's reader runs them itself."""

    immediate = True


async def test_a_transcript_retry_outlives_the_connection_of_the_turn_run_by_its_reader(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
) -> None:
    """The retry's wait is outside the turn's own scope: a newer supervisor dropping the
    connection that runs the turn meanwhile must not cancel it before its outcome is
    journalled (a resend would wait for ever on it)."""
    agent = Immediate()
    core, registry = make_core(agent, files, Timing(storage_retry_delays=(1.0,)))
    old = await start(nursery, core, registry)
    disk.fill(transcript_fails(1))
    await old.prompt(1, "hello", command_id="x")
    await trio.testing.wait_all_tasks_blocked()  # the turn ran; its line waits to be retried
    assert agent.prompts == ["hello"]
    rec = registry.add_owner(generation="g2", pid=200, start_id="boot:200")
    new = await connect_owner(nursery, core, rec)  # the old connection is dropped
    await trio.sleep(1.0)  # the retry
    await trio.testing.wait_all_tasks_blocked()
    assert core.turns_run == 1
    with trio.fail_after(5):
        assert await ask(new, 2, "hello", "x") == reply(2, 1, "reply 1: hello")
    assert agent.prompts == ["hello"]  # answered from the journal: nothing ran twice


async def test_transcript_that_stays_full_does_not_wedge_and_catches_up(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    disk: Disk,
    files: tuple[Journal, Transcript],
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = GatedAgent()
    core, registry = make_core(agent, files, Timing(storage_retry_delays=(1.0,)))
    transcript = files[1]
    sup = await start(nursery, core, registry)
    disk.fill(lambda path, _data: path.endswith("transcript.jsonl"))
    assert await ask(sup, 1, "a", "c1") == reply(1, 1, "reply 1: a")
    assert await ask(sup, 2, "b", "c2") == reply(2, 2, "reply 2: b")  # turn numbers go on
    assert trio.current_time() == 2.0
    # only the worker's start (written before the disk filled): no turn
    assert b'"kind":"turn"' not in transcript.path.read_bytes()
    assert "gave up after 2 attempts" in caplog.text
    disk.free()
    assert await ask(sup, 3, "c", "c3") == reply(3, 3, "reply 3: c")
    lines = [json.loads(x) for x in transcript.path.read_bytes().splitlines()]
    assert [x["turn"] for x in lines if x["kind"] == "turn"] == [1, 2, 3]


# --- command_interrupted says whether the turn may have run --------------------------------


def test_interrupted_error_text_says_whether_the_turn_may_have_run() -> None:
    started = interrupted_error(("cl", "7"), started=True)
    never = interrupted_error(("cl", "7"), started=False)
    assert started.code == never.code == "command_interrupted"
    assert started.message.endswith(
        "— it had started and may have had effects; check before sending it again"
    )
    assert never.message.endswith("— it never started; send it again")
    assert "send it again if you want it run" not in started.message
    assert (started.details["started"], never.details["started"]) == (True, False)


@pytest.mark.parametrize(
    ("marker", "boot", "text"),
    [
        (True, "this-boot", "it had started and may have had effects"),
        (False, "this-boot", "it never started; send it again"),
        # another boot: a started marker in the page cache may have been lost with it
        (False, "earlier-boot", "it had started and may have had effects"),
        (False, None, "it had started and may have had effects"),  # an older journal
    ],
)
async def test_restart_reports_an_interrupted_command_as_started_or_never_started(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    tmp_path: Path,
    marker: bool,
    boot: str | None,
    text: str,
) -> None:
    path = tmp_path / "journal" / "s1.jsonl"
    path.parent.mkdir()
    data = _journal.accepted("client-1", "c1", "prompt", {"text": "x"}, boot=boot)
    if marker:
        data += _journal.started("client-1", "c1")
    path.write_bytes(data)
    registry = MemoryRegistry()
    journal = Journal(path)
    agent = NonReplayable()
    core = make_worker_core(registry, agent=agent)
    core.journal = journal
    core.boot_id = "this-boot"
    try:
        sup = await start(nursery, core, registry)
        resp = await ask(sup, 1, "x", "c1")
        assert isinstance(resp.error, ErrorBody)
        assert resp.error.code == "command_interrupted"
        assert "interrupted by a worker restart" in str(resp.error.message)
        assert text in str(resp.error.message)
        assert agent.prompts == []
        # the verdict is journalled: the next restart answers the same
        assert Journal(path).state.never_started == (set() if marker or boot != "this-boot"
                                                     else {("client-1", "c1")})
    finally:
        journal.close()


def test_compaction_keeps_started_markers_and_never_started_verdicts() -> None:
    data = (
        _journal.accepted("c", 1, "prompt", {}) + _journal.started("c", 1)
        + _journal.accepted("c", 2, "prompt", {}) + _journal.interrupted("c", 2, started=False)
        + _journal.accepted("c", 3, "prompt", {}) + _journal.interrupted("c", 3)
    )
    again = _journal.parse(_journal.compacted(_journal.parse(data), 10))
    assert again.started == {("c", "1")}
    assert again.never_started == {("c", "2")}
    assert again.interrupted == {("c", "2"), ("c", "3")}


@pytest.fixture(autouse=True)
def _quiet_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_agentd")


# --- the supervisor's descriptor writes ------------------------------------------------------


class FullDescriptorOps(FakeWorkerOps):
    """Descriptor writes fail (ENOSPC) while ``failures`` lasts; every attempt is timed."""

    def __init__(self, nursery: trio.Nursery, failures: int) -> None:
        super().__init__(nursery)
        self.failures = failures
        self.attempts: list[tuple[float, str]] = []

    def persist(self, h: WorkerHandle) -> None:
        self.attempts.append((trio.current_time(), str(h.mode.value)))
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().persist(h)


async def _supervised(ops: FakeWorkerOps, nursery: trio.Nursery) -> WorkerHandle:
    h = WorkerHandle(ops, "s1", "echo", "/")
    await nursery.start(lambda task_status: h.supervise(alive=False, wanted=False,
                                                         task_status=task_status))
    await h.wait_ready()
    return h


async def test_failed_descriptor_write_is_retried_on_schedule_with_the_latest_state(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ops = FullDescriptorOps(nursery, failures=3)
    h = await _supervised(ops, nursery)
    assert trio.current_time() == 0.0
    await trio.sleep(5)
    # starting and ready at 0 fail; retries after 0.05 (fails) and 0.25 more write "ready"
    assert ops.attempts == [(0.0, "starting"), (0.0, "ready"), (0.05, "ready"), (0.3, "ready")]
    assert ops.persisted == ["ready"]
    assert h.mode.value is Mode.READY
    assert "could not write its descriptor" in caplog.text
    assert "descriptor written after 2 retries" in caplog.text


async def test_descriptor_write_that_keeps_failing_is_given_up_on_and_logged(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ops = FullDescriptorOps(nursery, failures=100)
    h = await _supervised(ops, nursery)
    await trio.sleep(5)
    assert [t for t, _ in ops.attempts] == [0.0, 0.0, 0.05, 0.3, 1.3]
    assert "gave up writing its descriptor after 4 attempts" in caplog.text
    # the session is served all the same, and the next state change writes it again
    response = await h.call("prompt", {"text": "hi", "command_id": 1}, client_id="c",
                            on_event=None)
    assert response.ok
    ops.failures = 0
    await h.request_stop().wait()
    assert ops.persisted[-1] == "stopped"
