"""In-memory stand-ins for the registry and a worker (no files, no processes)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
import trio.testing

from .._ownership import RECORD_VERSION, OwnerRecord, Phase
from .._plain import replace
from .._workercore import WorkerCore
from ..agents import Agent, EchoAgent
from ..timing import DEFAULT_TIMING, Timing

#: ``trio.testing.memory_stream_pair``: two connected in-memory streams
memory_stream_pair = trio.testing.memory_stream_pair


def make_owner_record(
    *, generation: str, pid: int, start_id: str | None = "boot:1", socket: str = "/run/s.sock",
    token: str = "t0k3n",
) -> OwnerRecord:
    """A supervisor's owner record (phase ``owner``) with test values for what is not given."""
    return OwnerRecord(
        version=RECORD_VERSION,
        generation=generation,
        token=token,
        pid=pid,
        start_id=start_id,
        socket=socket,
        home="/home/x/.local/state/trio-agentd",
        state_dir="/home/x/.local/state/trio-agentd/daemons/abc",
        app_version="test",
        protocol=1,
        phase=Phase.OWNER,
        created_at="2026-01-01T00:00:00Z",
        updated_at="2026-01-01T00:00:00Z",
    )


class MemoryRegistry:
    """Owner records and process start ids held in dictionaries, with read counters."""

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}
        self.start_ids: dict[int, str] = {}
        self.record_reads = 0
        self.start_id_reads = 0

    def add_owner(self, **kwargs: object) -> OwnerRecord:
        rec = make_owner_record(**kwargs)  # type: ignore[arg-type]
        self.records[rec.generation] = rec.to_json()
        if rec.start_id is not None:
            self.start_ids[rec.pid] = rec.start_id
        return rec

    def replace(self, rec: OwnerRecord, **changes: object) -> OwnerRecord:
        new = replace(rec, **changes)
        self.records[rec.generation] = new.to_json()
        return new

    def delete(self, generation: str) -> None:
        self.records.pop(generation, None)

    def read_record(self, generation: str) -> bytes | None:
        self.record_reads += 1
        return self.records.get(generation)

    def read_start_id(self, pid: int) -> str | None:
        self.start_id_reads += 1
        return self.start_ids.get(pid)


def make_worker_core(
    registry: MemoryRegistry,
    *,
    supervisor_socket: str = "/run/s.sock",
    session_id: str = "s1",
    token: str = "worker-token",
    agent: Agent | None = None,
    timing: Timing = DEFAULT_TIMING,
    cwd: Path = Path("/"),
    read_record: Callable[[str], bytes | None] | None = None,
    read_start_id: Callable[[int], str | None] | None = None,
    watch_claims: Callable[[str], None] | None = None,
    wait_change: Callable[[], Awaitable[None]] | None = None,
) -> WorkerCore:
    """A worker core with no files: in-memory registry (unless ``read_record`` and
    ``read_start_id`` say otherwise), no journal or transcript; it re-fences every
    ``refence_interval``, or as ``wait_change`` says (``trio_agentd._refence.watched_refence``)."""
    return WorkerCore(
        session_id=session_id,
        agent=agent or EchoAgent(),
        token=token,
        supervisor_socket=supervisor_socket,
        read_record=registry.read_record if read_record is None else read_record,
        read_start_id=registry.read_start_id if read_start_id is None else read_start_id,
        watch_claims=watch_claims,
        wait_change=wait_change,
        journal=None,
        transcript=None,
        cwd=cwd,
        timing=timing,
        pid=4242,
        start_id="boot:4242",
    )
