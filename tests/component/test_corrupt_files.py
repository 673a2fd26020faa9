"""Corrupt or truncated descriptors and journals, at every byte offset: never a crash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from trio_agentd import _journal
from trio_agentd._handle import WorkerHandle
from trio_agentd._paths import Layout
from trio_agentd._procops import ProcessWorkerOps
from trio_agentd._registry import Ownership, Registry
from trio_agentd._workercore import WorkerCore
from trio_agentd._workerjournal import Journal
from trio_agentd.agents import EchoAgent
from trio_agentd.timing import DEFAULT_TIMING


def _ops(tmp_path: Path) -> ProcessWorkerOps:
    layout = Layout(home=tmp_path / "home", socket="/tmp/x/d.sock", registry=tmp_path / "reg")
    layout.workers_dir.mkdir(parents=True)
    own = Ownership(Registry(layout.registry), layout, generation="g", app_version="t",
                    protocol=1)
    return ProcessWorkerOps(layout, own, DEFAULT_TIMING)


def test_descriptor_truncated_at_every_offset_loads_or_is_refused(tmp_path: Path) -> None:
    ops = _ops(tmp_path)
    h = WorkerHandle(ops, "s1", "echo", "/work")
    h.pid, h.start_id, h.token = os.getpid(), "not-this-process", "tok"
    full = ops.layout.descriptor_path("s1")
    ops.persist(h)
    data = full.read_bytes()
    loaded = refused = 0
    for cut in range(len(data) + 1):
        full.write_bytes(data[:cut])
        try:
            handle, alive, _lifecycle = ops.load(full)
        except ValueError:
            refused += 1
            continue
        loaded += 1
        assert handle.session_id == "s1"
        assert alive is False  # same pid, other start id: not our worker
    assert loaded == 1  # only the complete file is a descriptor
    assert refused == len(data)


@pytest.mark.parametrize(
    "garbage",
    [b"", b"null", b"[]", b"{}", b'{"socket": "/tmp/x/d.sock"}',
     b'{"socket": "/tmp/x/d.sock", "session": "../../etc"}',
     b'{"socket": "/tmp/x/d.sock", "session": "s", "pid": "12", "create": 5}',
     b'{"socket": "/tmp/x/d.sock", "session": "s", "lifecycle": "zombie"}',
     bytes(range(256))],
)
def test_garbage_descriptor_is_refused_with_a_reason(tmp_path: Path, garbage: bytes) -> None:
    ops = _ops(tmp_path)
    path = ops.layout.descriptor_path("s")
    path.write_bytes(garbage)
    with pytest.raises(ValueError, match=r"\w"):
        ops.load(path)


async def test_journal_truncated_at_every_offset_recovers(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    lines = [
        _journal.accepted("c", 1, "prompt", {"text": "a"}),
        _journal.completed("c", 1, {"session": "s", "turn": 1, "reply": "A"}),
        _journal.accepted("c", 2, "prompt", {"text": "b"}),
        _journal.interrupted("c", 2),
        _journal.accepted("c", 3, "prompt", {"text": "c"}),
    ]
    data = b"".join(lines)
    for cut in range(len(data) + 1):
        path.write_bytes(data[:cut])
        journal = Journal(path)
        core = WorkerCore(
            session_id="s", agent=EchoAgent(), token="t", supervisor_socket="/s",
            read_record=lambda _g: None, journal=journal, transcript=None, cwd=tmp_path,
            pid=1, start_id="x",
        )
        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                await n.start(core.serve)
                core.stop_requested.set()
        state = _journal.parse(path.read_bytes())
        # every complete record before the cut survives; a torn tail never breaks later appends
        if cut >= len(lines[0]) + len(lines[1]):
            assert state.completed[("c", "1")]["reply"] == "A"
        if cut == len(data):
            # command 3 was pending: echo is replayable, so it ran once on recovery
            assert ("c", "3") in state.completed
        journal.close()
