"""Owner records and the verdicts on them (trio_agentd._ownership)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agentd._ownership import (
    CAUSE_TEXT,
    RECORD_VERSION,
    AcquirePlan,
    Cause,
    CorruptRecord,
    OwnerRecord,
    Phase,
    RestoreVerdict,
    ScannedRecord,
    Scope,
    cause_of_refusal,
    judge,
    plan_acquire,
    plan_restore,
)
from trio_agentd._plain import replace
from trio_agentd._procstate import Liveness

SOCKET = "/run/user/1000/trio-agentd/daemon.sock"
STATE_DIR = "/home/u/.local/state/trio-agentd/daemons/51a6f2933dc0"
MY_GEN = "a" * 32


def record(**changes: Any) -> OwnerRecord:
    base = OwnerRecord(
        version=RECORD_VERSION,
        generation=MY_GEN,
        token="tok-mine",
        pid=1000,
        start_id="boot-1:5000",
        socket=SOCKET,
        home="/home/u/.local/state/trio-agentd",
        state_dir=STATE_DIR,
        app_version="0.1.0",
        protocol=1,
        phase=Phase.OWNER,
        created_at="2024-01-01T00:00:00+00:00",
        updated_at="2024-01-01T00:00:00+00:00",
    )
    return replace(base, **changes)


MINE = record()
MINE_BYTES = MINE.to_json()


def scanned(
    name_gen: str,
    *,
    liveness: Liveness | None = Liveness.ALIVE,
    readable: bool = True,
    scope: bool = True,
    **changes: Any,
) -> ScannedRecord:
    rec = record(generation=name_gen, token=f"tok-{name_gen}", pid=2000, **changes)
    return ScannedRecord(
        name=f"{name_gen}.owner",
        generation=name_gen,
        record=rec if readable else None,
        scope=rec.scope if scope else None,
        liveness=liveness if readable else None,
    )


# --- records ----------------------------------------------------------------------------------

texts = st.text(max_size=24)
owner_records = st.builds(
    OwnerRecord,
    version=st.integers(min_value=-(2**70), max_value=2**70),
    generation=texts,
    token=texts,
    pid=st.integers(min_value=-(2**70), max_value=2**70),
    start_id=st.none() | texts,
    socket=texts,
    home=texts,
    state_dir=texts,
    app_version=texts,
    protocol=st.integers(min_value=-(2**40), max_value=2**40),
    phase=st.sampled_from(list(Phase)),
    created_at=texts,
    updated_at=texts,
)


@given(owner_records)
def test_owner_record_json_round_trip(rec: OwnerRecord) -> None:
    data = rec.to_json()
    assert OwnerRecord.from_json(data) == rec
    assert OwnerRecord.from_json(data).to_json() == data


@given(owner_records)
def test_scope_json_round_trip(rec: OwnerRecord) -> None:
    scope = rec.scope
    assert Scope.from_json(scope.to_json()) == scope
    assert (scope.version, scope.generation, scope.token, scope.socket, scope.state_dir) == (
        rec.version,
        rec.generation,
        rec.token,
        rec.socket,
        rec.state_dir,
    )


def test_owner_record_json_has_every_field_of_the_spec() -> None:
    obj = json.loads(MINE.to_json())
    assert obj == {
        "version": 1,
        "generation": MY_GEN,
        "token": "tok-mine",
        "pid": 1000,
        "start_id": "boot-1:5000",
        "socket": SOCKET,
        "home": "/home/u/.local/state/trio-agentd",
        "state_dir": STATE_DIR,
        "app_version": "0.1.0",
        "protocol": 1,
        "phase": "owner",
        "created_at": "2024-01-01T00:00:00+00:00",
        "updated_at": "2024-01-01T00:00:00+00:00",
    }


def test_scope_json_is_the_immutable_subset() -> None:
    assert json.loads(MINE.scope.to_json()) == {
        "version": 1,
        "generation": MY_GEN,
        "token": "tok-mine",
        "socket": SOCKET,
        "state_dir": STATE_DIR,
    }


def test_phases_and_causes_are_the_spec_strings() -> None:
    assert [str(p) for p in Phase] == ["starting", "owner", "stopping"]
    assert {str(c) for c in Cause} == {"released", "record-missing", "record-replaced", "revoked"}
    assert set(CAUSE_TEXT) == set(Cause)


def test_with_phase_changes_only_phase_and_updated_at() -> None:
    later = MINE.with_phase(Phase.STOPPING, "2024-01-02T00:00:00+00:00")
    assert later == replace(MINE, phase=Phase.STOPPING, updated_at="2024-01-02T00:00:00+00:00")
    assert later.same_identity(MINE)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff\xfe\x00garbage",
        b"[1, 2]",
        b'"owner"',
        b"null",
        json.dumps({k: v for k, v in json.loads(MINE_BYTES).items() if k != "pid"}).encode(),
        json.dumps({**json.loads(MINE_BYTES), "pid": "abc"}).encode(),
        json.dumps({**json.loads(MINE_BYTES), "pid": None}).encode(),
        json.dumps({**json.loads(MINE_BYTES), "protocol": [1]}).encode(),
        json.dumps({**json.loads(MINE_BYTES), "phase": "running"}).encode(),
        json.dumps({**json.loads(MINE_BYTES), "version": {}}).encode(),
        MINE_BYTES[: len(MINE_BYTES) // 2],
    ],
)
def test_owner_record_from_corrupt_json_raises_corrupt_record(data: bytes) -> None:
    with pytest.raises(CorruptRecord):
        OwnerRecord.from_json(data)


@pytest.mark.parametrize(
    "data",
    [
        b"{",
        b"[]",
        b'{"version": 1, "generation": "g", "token": "t", "socket": "/s"}',
        b'{"version": "x", "generation": "g", "token": "t", "socket": "/s", "state_dir": "/d"}',
    ],
)
def test_scope_from_corrupt_json_raises_corrupt_record(data: bytes) -> None:
    with pytest.raises(CorruptRecord):
        Scope.from_json(data)


@pytest.mark.parametrize(
    "data",
    [
        json.dumps({**json.loads(MINE_BYTES), "pid": float("inf")}).encode(),
        json.dumps({**json.loads(MINE_BYTES), "version": float("-inf")}).encode(),
        json.dumps({**json.loads(MINE_BYTES), "protocol": float("inf")}).encode(),
        MINE_BYTES.replace(b'"pid": 1000', b'"pid": 1e999'),
    ],
    ids=["pid-Infinity", "version--Infinity", "protocol-Infinity", "pid-1e999"],
)
def test_owner_record_with_infinite_number_is_corrupt(data: bytes) -> None:
    # Regression: int(Infinity) raises OverflowError, which from_json must turn into CorruptRecord.
    with pytest.raises(CorruptRecord):
        OwnerRecord.from_json(data)


def test_scope_with_infinite_version_is_corrupt() -> None:
    data = json.dumps({**json.loads(MINE.scope.to_json()), "version": float("inf")}).encode()
    with pytest.raises(CorruptRecord):
        Scope.from_json(data)


def test_judge_of_record_with_infinite_pid_is_missing() -> None:
    # Regression: a garbled owner.json must judge as missing, not crash validation.
    on_disk = json.dumps({**json.loads(MINE_BYTES), "pid": float("inf")}).encode()
    assert b'"pid": Infinity' in on_disk
    assert judge(MINE, MINE_BYTES, on_disk, released=False) is Cause.MISSING


@given(
    field=st.sampled_from(sorted(json.loads(MINE_BYTES))),
    value=st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=8),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
        max_leaves=6,
    ),
)
def test_owner_record_from_any_field_value_parses_or_is_corrupt(field: str, value: Any) -> None:
    data = json.dumps({**json.loads(MINE_BYTES), field: value}).encode()
    parsed: OwnerRecord | None
    try:
        parsed = OwnerRecord.from_json(data)
    except CorruptRecord:
        parsed = None
    if parsed is not None:
        # Whatever was accepted is normalised into a record that round-trips exactly.
        assert OwnerRecord.from_json(parsed.to_json()) == parsed


@pytest.mark.parametrize("field", ["generation", "token", "pid", "start_id", "socket"])
def test_same_identity_compares_each_identity_field(field: str) -> None:
    other_value: Any = {
        "generation": "b" * 32,
        "token": "tok-other",
        "pid": 1001,
        "start_id": None,
        "socket": "/tmp/other.sock",
    }[field]
    assert not MINE.same_identity(replace(MINE, **{field: other_value}))


def test_same_identity_ignores_non_identity_fields() -> None:
    other = replace(
        MINE,
        home="/elsewhere",
        state_dir="/elsewhere/d",
        app_version="9.9",
        protocol=2,
        phase=Phase.STOPPING,
        created_at="x",
        updated_at="y",
    )
    assert MINE.same_identity(other)


# --- judge ------------------------------------------------------------------------------------


def test_judge_same_bytes_is_none() -> None:
    assert judge(MINE, MINE_BYTES, MINE_BYTES, released=False) is None


def test_judge_missing_record_is_missing() -> None:
    assert judge(MINE, MINE_BYTES, None, released=False) is Cause.MISSING


@pytest.mark.parametrize(
    "on_disk", [b"", b"{", b"[]", b'{"version": 1}', MINE_BYTES[:-1], b"\xff\xff"]
)
def test_judge_corrupt_record_is_missing(on_disk: bytes) -> None:
    assert judge(MINE, MINE_BYTES, on_disk, released=False) is Cause.MISSING


@pytest.mark.parametrize(
    "other",
    [
        record(generation="b" * 32),
        record(token="tok-other"),
        record(pid=1001),
        record(start_id="boot-1:5001"),
        record(start_id=None),
        record(socket="/tmp/other.sock"),
    ],
)
def test_judge_another_identity_is_replaced(other: OwnerRecord) -> None:
    assert judge(MINE, MINE_BYTES, other.to_json(), released=False) is Cause.REPLACED


def test_judge_same_identity_other_phase_and_time_is_none() -> None:
    on_disk = MINE.with_phase(Phase.STOPPING, "2030-01-01T00:00:00+00:00").to_json()
    assert on_disk != MINE_BYTES
    assert judge(MINE, MINE_BYTES, on_disk, released=False) is None


def test_judge_same_identity_other_key_order_is_none() -> None:
    on_disk = json.dumps(json.loads(MINE_BYTES), indent=2).encode()
    assert judge(MINE, MINE_BYTES, on_disk, released=False) is None


@pytest.mark.parametrize("on_disk", [MINE_BYTES, None, b"{", record(pid=7).to_json()])
def test_judge_released_wins_over_everything(on_disk: bytes | None) -> None:
    assert judge(MINE, MINE_BYTES, on_disk, released=True) is Cause.RELEASED


@given(mine=owner_records, other=owner_records)
def test_judge_is_none_exactly_for_same_identity(mine: OwnerRecord, other: OwnerRecord) -> None:
    verdict = judge(mine, mine.to_json(), other.to_json(), released=False)
    assert verdict is (None if mine.same_identity(other) else Cause.REPLACED)


# --- plan_acquire -----------------------------------------------------------------------------


def acquire(records: list[ScannedRecord], **kw: Any) -> AcquirePlan:
    return plan_acquire(
        generation=MY_GEN, socket=SOCKET, state_dir=STATE_DIR, scanned=records, **kw
    )


def test_acquire_empty_registry_is_clear() -> None:
    assert acquire([]) == AcquirePlan(conflict=None, move_aside=())


def test_acquire_live_record_for_same_socket_is_a_conflict() -> None:
    other = scanned("b1", state_dir="/other/state")
    assert acquire([other]) == AcquirePlan(conflict=other, move_aside=())


def test_acquire_live_record_for_same_state_dir_other_socket_is_a_conflict() -> None:
    other = scanned("b1", socket="/tmp/other.sock")
    assert acquire([other]) == AcquirePlan(conflict=other, move_aside=())


def test_acquire_live_record_for_a_canonical_spelling_of_the_state_dir_is_a_conflict() -> None:
    other = scanned("b1", socket="/tmp/other.sock", state_dir="/real/state")
    assert acquire([other]).conflict is None
    plan = acquire([other], canonical_state_dirs=frozenset({"/real/state"}))
    assert plan == AcquirePlan(conflict=other, move_aside=())


def test_acquire_live_unrelated_record_is_left_alone() -> None:
    other = scanned("b1", socket="/tmp/other.sock", state_dir="/other/state")
    assert acquire([other]) == AcquirePlan(conflict=None, move_aside=())


def test_acquire_unknown_liveness_counts_as_alive() -> None:
    other = scanned("b1", liveness=Liveness.UNKNOWN)
    assert acquire([other]) == AcquirePlan(conflict=other, move_aside=())


def test_acquire_readable_record_without_probe_counts_as_alive() -> None:
    other = scanned("b1", liveness=None)
    assert acquire([other]) == AcquirePlan(conflict=other, move_aside=())


@pytest.mark.parametrize(
    "claims",
    [
        {},
        {"socket": "/tmp/other.sock"},
        {"socket": "/tmp/other.sock", "state_dir": "/other/state"},
    ],
    ids=["same-socket-and-dir", "same-dir", "unrelated"],
)
def test_acquire_dead_record_is_moved_aside_whatever_it_claims(claims: dict[str, Any]) -> None:
    other = scanned("b1", liveness=Liveness.DEAD, **claims)
    assert acquire([other]) == AcquirePlan(conflict=None, move_aside=("b1.owner",))


@pytest.mark.parametrize("scope", [True, False], ids=["scope-readable", "no-scope"])
@pytest.mark.parametrize(
    "claims", [{}, {"socket": "/tmp/other.sock", "state_dir": "/o"}], ids=["relevant", "unrelated"]
)
def test_acquire_unreadable_record_is_left_alone(scope: bool, claims: dict[str, Any]) -> None:
    other = scanned("b1", readable=False, scope=scope, **claims)
    assert acquire([other]) == AcquirePlan(conflict=None, move_aside=())


@pytest.mark.parametrize("liveness", list(Liveness))
def test_acquire_skips_its_own_generation(liveness: Liveness) -> None:
    own = ScannedRecord(
        name=f"{MY_GEN}.owner", generation=MY_GEN, record=MINE, scope=MINE.scope, liveness=liveness
    )
    assert acquire([own]) == AcquirePlan(conflict=None, move_aside=())


def test_acquire_mixed_registry() -> None:
    live_conflict = scanned("c3", state_dir="/x")
    dead_a = scanned("a1", liveness=Liveness.DEAD)
    dead_b = scanned("d4", liveness=Liveness.DEAD, socket="/u.sock", state_dir="/u")
    live_unrelated = scanned("b2", socket="/u.sock", state_dir="/u")
    unreadable = scanned("e5", readable=False)
    plan = acquire([unreadable, dead_b, live_unrelated, live_conflict, dead_a])
    assert plan == AcquirePlan(conflict=live_conflict, move_aside=("a1.owner", "d4.owner"))


def test_acquire_picks_the_first_conflict_by_name_whatever_the_order() -> None:
    first = scanned("b1")
    second = scanned("b2", socket="/tmp/o.sock")
    assert acquire([second, first]).conflict == first
    assert acquire([first, second]).conflict == first


scanned_records = st.builds(
    lambda gen, live, readable, same_socket, same_dir: scanned(
        gen,
        liveness=live,
        readable=readable,
        socket=SOCKET if same_socket else f"/tmp/{gen}.sock",
        state_dir=STATE_DIR if same_dir else f"/state/{gen}",
    ),
    st.sampled_from([MY_GEN, "b1", "b2", "b3", "b4", "b5"]),
    st.sampled_from([*Liveness, None]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)


@given(records=st.lists(scanned_records, max_size=8, unique_by=lambda r: r.name), seed=st.randoms())
def test_acquire_plan_property(records: list[ScannedRecord], seed: random.Random) -> None:
    plan = acquire(records)
    others = [r for r in records if r.generation != MY_GEN and r.record is not None]
    assert plan.move_aside == tuple(sorted(r.name for r in others if r.liveness is Liveness.DEAD))
    live_relevant = sorted(
        (
            r
            for r in others
            if r.liveness is not Liveness.DEAD
            and r.record is not None
            and (r.record.socket == SOCKET or r.record.state_dir == STATE_DIR)
        ),
        key=lambda r: r.name,
    )
    assert plan.conflict == (live_relevant[0] if live_relevant else None)
    shuffled = list(records)
    seed.shuffle(shuffled)
    assert acquire(shuffled) == plan


# --- plan_restore -----------------------------------------------------------------------------


def restore(**changes: Any) -> RestoreVerdict:
    kw: dict[str, Any] = {
        "mine": MINE,
        "mine_bytes": MINE_BYTES,
        "on_disk": None,
        "released": False,
        "revoked": False,
        "shutdown_in_progress": False,
        "conflict": None,
        "self_heal": True,
    }
    kw.update(changes)
    return plan_restore(**kw)


def test_restore_missing_record_is_restored() -> None:
    assert restore() is RestoreVerdict.RESTORE


def test_restore_corrupt_record_is_restored() -> None:
    assert restore(on_disk=b"{garbage") is RestoreVerdict.RESTORE


def test_restore_refuses_when_released() -> None:
    assert restore(released=True) is RestoreVerdict.REFUSE_RELEASED


def test_restore_refuses_when_revoked() -> None:
    assert restore(revoked=True) is RestoreVerdict.REFUSE_REVOKED


def test_restore_refuses_when_replaced() -> None:
    assert restore(on_disk=record(token="other").to_json()) is RestoreVerdict.REFUSE_REPLACED


def test_restore_refuses_when_self_heal_disabled() -> None:
    assert restore(self_heal=False) is RestoreVerdict.REFUSE_DISABLED


def test_restore_refuses_when_shutdown_in_progress() -> None:
    assert restore(shutdown_in_progress=True) is RestoreVerdict.REFUSE_SHUTDOWN


def test_restore_refuses_on_live_conflict() -> None:
    assert restore(conflict=scanned("b1")) is RestoreVerdict.REFUSE_CONFLICT


@pytest.mark.parametrize(
    "on_disk",
    [MINE_BYTES, MINE.with_phase(Phase.STOPPING, "2031-01-01T00:00:00+00:00").to_json()],
    ids=["same-bytes", "same-identity"],
)
def test_restore_of_a_present_record_is_already_present(on_disk: bytes) -> None:
    # Another flight restored it; present wins over every later refusal.
    verdict = restore(
        on_disk=on_disk, self_heal=False, shutdown_in_progress=True, conflict=scanned("b1")
    )
    assert verdict is RestoreVerdict.ALREADY_PRESENT


def test_restore_refusal_priority() -> None:
    everything: dict[str, Any] = {
        "released": True,
        "revoked": True,
        "on_disk": record(token="other").to_json(),
        "self_heal": False,
        "shutdown_in_progress": True,
        "conflict": scanned("b1"),
    }
    order = [
        ("released", RestoreVerdict.REFUSE_RELEASED),
        ("revoked", RestoreVerdict.REFUSE_REVOKED),
        ("on_disk", RestoreVerdict.REFUSE_REPLACED),
        ("self_heal", RestoreVerdict.REFUSE_DISABLED),
        ("shutdown_in_progress", RestoreVerdict.REFUSE_SHUTDOWN),
        ("conflict", RestoreVerdict.REFUSE_CONFLICT),
    ]
    neutral: dict[str, Any] = {
        "released": False,
        "revoked": False,
        "on_disk": None,
        "self_heal": True,
        "shutdown_in_progress": False,
        "conflict": None,
    }
    kw = dict(everything)
    for name, expected in order:
        assert restore(**kw) is expected
        kw[name] = neutral[name]
    assert restore(**kw) is RestoreVerdict.RESTORE


REFUSAL_CAUSES = [
    (RestoreVerdict.REFUSE_RELEASED, Cause.RELEASED),
    (RestoreVerdict.REFUSE_REVOKED, Cause.REVOKED),
    (RestoreVerdict.REFUSE_REPLACED, Cause.REPLACED),
    (RestoreVerdict.REFUSE_CONFLICT, Cause.REPLACED),
    (RestoreVerdict.REFUSE_SHUTDOWN, Cause.MISSING),
    (RestoreVerdict.REFUSE_DISABLED, Cause.MISSING),
    (RestoreVerdict.RESTORE, Cause.MISSING),
    (RestoreVerdict.ALREADY_PRESENT, Cause.MISSING),
]


@pytest.mark.parametrize(("verdict", "cause"), REFUSAL_CAUSES)
def test_cause_of_refusal(verdict: RestoreVerdict, cause: Cause) -> None:
    assert cause_of_refusal(verdict) is cause


def test_cause_of_refusal_table_covers_every_verdict() -> None:
    assert {v for v, _ in REFUSAL_CAUSES} == set(RestoreVerdict)
