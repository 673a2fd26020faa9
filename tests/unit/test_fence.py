"""The worker's re-fence of its supervisor (trio_agentd._fence)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agentd._fence import Claim, Fence
from trio_agentd._ownership import OwnerRecord, Phase
from trio_agentd._plain import replace

GEN = "f" * 32
SOCKET = "/run/user/1000/trio-agentd/daemon.sock"
RECORD = OwnerRecord(
    version=1,
    generation=GEN,
    token="tok",
    pid=4242,
    start_id="boot:777",
    socket=SOCKET,
    home="/h",
    state_dir="/h/daemons/k",
    app_version="0.1.0",
    protocol=1,
    phase=Phase.OWNER,
    created_at="2024-01-01T00:00:00+00:00",
    updated_at="2024-01-01T00:00:00+00:00",
)
CLAIM = Claim(generation=GEN, pid=4242, start_id="boot:777", socket=SOCKET)


@dataclass
class FakeRegistry:
    """An in-memory registry and process table that count every read."""

    records: dict[str, bytes] = field(default_factory=lambda: {GEN: RECORD.to_json()})
    start_ids: dict[int, str | None] = field(default_factory=lambda: {4242: "boot:777"})
    record_reads: list[str] = field(default_factory=list)
    start_id_reads: list[int] = field(default_factory=list)

    def read_record(self, generation: str) -> bytes | None:
        self.record_reads.append(generation)
        return self.records.get(generation)

    def read_start_id(self, pid: int) -> str | None:
        self.start_id_reads.append(pid)
        return self.start_ids.get(pid)

    def fence(self, claim: Claim = CLAIM) -> Fence:
        return Fence(claim, self.read_record, self.read_start_id)


def test_first_check_reads_the_record_and_the_start_id_once() -> None:
    reg = FakeRegistry()
    fence = reg.fence()
    assert fence.check() is None
    assert reg.record_reads == [GEN]
    assert reg.start_id_reads == [4242]


def test_steady_state_reads_the_start_id_zero_times() -> None:
    reg = FakeRegistry()
    fence = reg.fence()
    assert fence.check() is None
    for _ in range(50):
        assert fence.check() is None
    assert reg.record_reads == [GEN] * 51
    assert reg.start_id_reads == [4242]


def test_steady_state_does_not_notice_a_dead_supervisor_until_the_record_changes() -> None:
    # Cheap by design: one file read per check, no process probe while the bytes are unchanged.
    reg = FakeRegistry()
    fence = reg.fence()
    assert fence.check() is None
    reg.start_ids[4242] = "boot:999"
    assert fence.check() is None
    assert reg.start_id_reads == [4242]
    reg.records[GEN] = RECORD.with_phase(Phase.STOPPING, "2024-01-01T00:01:00+00:00").to_json()
    assert fence.check() == "supervisor-gone"
    assert reg.start_id_reads == [4242, 4242]


def test_changed_record_forces_exactly_one_start_id_read() -> None:
    reg = FakeRegistry()
    fence = reg.fence()
    assert fence.check() is None
    assert fence.check() is None
    reg.records[GEN] = RECORD.with_phase(Phase.STOPPING, "2024-01-01T00:01:00+00:00").to_json()
    assert fence.check() is None
    assert reg.start_id_reads == [4242, 4242]
    for _ in range(10):
        assert fence.check() is None
    assert reg.start_id_reads == [4242, 4242]
    assert len(reg.record_reads) == 13


def test_same_record_with_other_bytes_is_rechecked_once() -> None:
    reg = FakeRegistry()
    fence = reg.fence()
    assert fence.check() is None
    reg.records[GEN] = json.dumps(json.loads(RECORD.to_json()), indent=1).encode()
    assert fence.check() is None
    assert fence.check() is None
    assert reg.start_id_reads == [4242, 4242]


def test_missing_record() -> None:
    reg = FakeRegistry(records={})
    fence = reg.fence()
    assert fence.check() == "record-missing"
    assert reg.start_id_reads == []


def test_record_removed_after_a_good_check_is_missing() -> None:
    reg = FakeRegistry()
    fence = reg.fence()
    assert fence.check() is None
    del reg.records[GEN]
    assert fence.check() == "record-missing"
    assert reg.start_id_reads == [4242]


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[]", b"null", b'{"generation": "' + GEN.encode() + b'"}', b"\xff"]
)
def test_corrupt_record(raw: bytes) -> None:
    reg = FakeRegistry(records={GEN: raw})
    assert reg.fence().check() == "record-corrupt"
    assert reg.start_id_reads == []


@pytest.mark.parametrize(
    "changes",
    [
        {"generation": "e" * 32},
        {"pid": 4243},
        {"start_id": "boot:778"},
        {"start_id": None},
        {"socket": "/tmp/other.sock"},
    ],
    ids=["generation", "pid", "start_id", "start_id-none", "socket"],
)
def test_replaced_record(changes: dict[str, Any]) -> None:
    reg = FakeRegistry(records={GEN: replace(RECORD, **changes).to_json()})
    assert reg.fence().check() == "record-replaced"
    assert reg.start_id_reads == []


def test_replacing_the_record_after_a_good_check_is_noticed() -> None:
    reg = FakeRegistry()
    fence = reg.fence()
    assert fence.check() is None
    reg.records[GEN] = replace(RECORD, pid=5000, start_id="boot:5").to_json()
    assert fence.check() == "record-replaced"


@pytest.mark.parametrize(
    "changes",
    [{"token": "another-token"}, {"home": "/x"}, {"app_version": "9"}, {"phase": Phase.STARTING}],
    ids=["token", "home", "app_version", "phase"],
)
def test_fields_outside_the_claim_do_not_matter(changes: dict[str, Any]) -> None:
    reg = FakeRegistry(records={GEN: replace(RECORD, **changes).to_json()})
    assert reg.fence().check() is None


@pytest.mark.parametrize("now", ["boot:778", None], ids=["reused-pid", "unreadable"])
def test_supervisor_gone(now: str | None) -> None:
    reg = FakeRegistry(start_ids={4242: now})
    assert reg.fence().check() == "supervisor-gone"
    assert reg.start_id_reads == [4242]


def test_claim_without_start_id_holds_while_it_cannot_be_read() -> None:
    claim = dataclasses.replace(CLAIM, start_id=None)
    reg = FakeRegistry(
        records={GEN: replace(RECORD, start_id=None).to_json()}, start_ids={4242: None}
    )
    assert reg.fence(claim).check() is None


def test_a_failure_is_not_cached_as_good() -> None:
    reg = FakeRegistry(start_ids={4242: "boot:other"})
    fence = reg.fence()
    assert fence.check() == "supervisor-gone"
    assert fence.check() == "supervisor-gone"
    assert reg.start_id_reads == [4242, 4242]


def test_recovers_when_the_good_record_returns() -> None:
    reg = FakeRegistry()
    fence = reg.fence()
    good = reg.records[GEN]
    assert fence.check() is None
    del reg.records[GEN]
    assert fence.check() == "record-missing"
    reg.records[GEN] = good
    assert fence.check() is None
    assert reg.start_id_reads == [4242]


@given(
    st.lists(
        st.sampled_from(["same", "touch", "missing", "restore", "corrupt", "replace", "kill"]),
        max_size=30,
    )
)
def test_start_id_is_read_only_when_record_bytes_change(steps: list[str]) -> None:
    reg = FakeRegistry()
    fence = reg.fence()
    assert fence.check() is None
    last_ok = reg.records[GEN]
    for tick, step in enumerate(steps):
        if step == "touch":
            reg.records[GEN] = RECORD.with_phase(Phase.OWNER, f"t{tick}").to_json()
        elif step == "missing":
            reg.records.pop(GEN, None)
        elif step == "restore":
            reg.records[GEN] = RECORD.to_json()
        elif step == "corrupt":
            reg.records[GEN] = b"{"
        elif step == "replace":
            reg.records[GEN] = replace(RECORD, pid=1).to_json()
        elif step == "kill":
            reg.start_ids[4242] = None
        raw = reg.records.get(GEN)
        reads_before = len(reg.start_id_reads)
        result = fence.check()
        reads = len(reg.start_id_reads) - reads_before
        if raw is None:
            assert (result, reads) == ("record-missing", 0)
        elif raw == last_ok:
            assert (result, reads) == (None, 0)
        elif raw == b"{":
            assert (result, reads) == ("record-corrupt", 0)
        elif b'"pid": 1,' in raw:
            assert (result, reads) == ("record-replaced", 0)
        elif reg.start_ids[4242] is None:
            assert (result, reads) == ("supervisor-gone", 1)
        else:
            assert (result, reads) == (None, 1)
            last_ok = raw
