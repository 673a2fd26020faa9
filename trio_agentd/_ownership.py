"""Ownership records and the verdicts on them. Pure: values in, values out.

Theory of operation
-------------------
A supervisor owns its socket and state dir through a record in the registry,
``<registry>/<generation>.owner/owner.json`` (+ the immutable ``scope.json``). On every command
it compares the record on disk with the one it wrote (:func:`judge`): equal bytes are the
steady-state fast path, so a command costs one small file read. Anything else yields a
:class:`Cause`. ``record-missing`` is the only cause a supervisor may repair itself, by writing
the same record again (:func:`plan_restore`); every other cause, and every refusal of the
restore, leaves it fenced off and failing commands with ``ownership_lost``.

Acquisition (:func:`plan_acquire`) and restore run the same conflict scan: another record for
the same socket or the same (physically canonical) state dir whose process is alive — or whose
liveness cannot be known — is a conflict; records of dead processes are moved aside.
"""

from __future__ import annotations

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._plain import Frozen, StrEnum, replace  # StrEnum: enum's to type checkers (ps path)
from ._procstate import Liveness

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from typing import Any

RECORD_VERSION = 1


class Phase(StrEnum):
    STARTING = "starting"
    OWNER = "owner"
    STOPPING = "stopping"


class Cause(StrEnum):
    """Why a supervisor no longer owns its record."""

    RELEASED = "released"
    MISSING = "record-missing"
    REPLACED = "record-replaced"
    REVOKED = "revoked"


CAUSE_TEXT: dict[Cause, str] = {
    Cause.RELEASED: "this supervisor released its ownership (it is shutting down)",
    Cause.MISSING: "its owner record was deleted on disk",
    Cause.REPLACED: "its owner record was replaced by another owner's",
    Cause.REVOKED: "its generation was revoked by doctor --fix or shutdown --force",
}


class CorruptRecord(ValueError):
    pass


class Scope(Frozen):
    """The immutable subset of a record: enough to judge relevance when owner.json is corrupt."""

    __slots__ = ("generation", "socket", "state_dir", "token", "version")
    version: int
    generation: str
    token: str
    socket: str
    state_dir: str

    def __init__(
        self, *, version: int, generation: str, token: str, socket: str, state_dir: str
    ) -> None:
        s = object.__setattr__
        s(self, "version", version)
        s(self, "generation", generation)
        s(self, "token", token)
        s(self, "socket", socket)
        s(self, "state_dir", state_dir)

    def to_json(self) -> bytes:
        return json.dumps({n: getattr(self, n) for n in self.__slots__}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Scope:
        obj = _load_object(data)
        try:
            return cls(
                version=int(obj["version"]),
                generation=str(obj["generation"]),
                token=str(obj["token"]),
                socket=str(obj["socket"]),
                state_dir=str(obj["state_dir"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CorruptRecord(f"scope.json lacks a valid field: {exc}") from None


class OwnerRecord(Frozen):
    __slots__ = (
        "app_version",
        "created_at",
        "generation",
        "home",
        "phase",
        "pid",
        "protocol",
        "socket",
        "start_id",
        "state_dir",
        "token",
        "updated_at",
        "version",
    )
    version: int
    generation: str
    token: str
    pid: int
    start_id: str | None
    socket: str
    home: str
    state_dir: str
    app_version: str
    protocol: int
    phase: Phase
    created_at: str
    updated_at: str

    def __init__(
        self, *, version: int, generation: str, token: str, pid: int, start_id: str | None,
        socket: str, home: str, state_dir: str, app_version: str, protocol: int, phase: Phase,
        created_at: str, updated_at: str,
    ) -> None:
        s = object.__setattr__
        s(self, "version", version)
        s(self, "generation", generation)
        s(self, "token", token)
        s(self, "pid", pid)
        s(self, "start_id", start_id)
        s(self, "socket", socket)
        s(self, "home", home)
        s(self, "state_dir", state_dir)
        s(self, "app_version", app_version)
        s(self, "protocol", protocol)
        s(self, "phase", phase)
        s(self, "created_at", created_at)
        s(self, "updated_at", updated_at)

    @property
    def scope(self) -> Scope:
        return Scope(
            version=self.version,
            generation=self.generation,
            token=self.token,
            socket=self.socket,
            state_dir=self.state_dir,
        )

    def with_phase(self, phase: Phase, now: str) -> OwnerRecord:
        return replace(self, phase=phase, updated_at=now)

    def to_json(self) -> bytes:
        obj = {n: getattr(self, n) for n in self.__slots__}
        obj["phase"] = str(self.phase)
        return json.dumps(obj, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> OwnerRecord:
        obj = _load_object(data)
        try:
            return cls(
                version=int(obj["version"]),
                generation=str(obj["generation"]),
                token=str(obj["token"]),
                pid=int(obj["pid"]),
                start_id=None if obj["start_id"] is None else str(obj["start_id"]),
                socket=str(obj["socket"]),
                home=str(obj["home"]),
                state_dir=str(obj["state_dir"]),
                app_version=str(obj["app_version"]),
                protocol=int(obj["protocol"]),
                phase=Phase(obj["phase"]),
                created_at=str(obj["created_at"]),
                updated_at=str(obj["updated_at"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CorruptRecord(f"owner.json lacks a valid field: {exc}") from None

    def same_identity(self, other: OwnerRecord) -> bool:
        """The fields validation compares: generation, token, pid, start id, socket."""
        return (
            self.generation == other.generation
            and self.token == other.token
            and self.pid == other.pid
            and self.start_id == other.start_id
            and self.socket == other.socket
        )


def _load_object(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptRecord(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CorruptRecord("not a JSON object")
    return obj


def judge(
    mine: OwnerRecord, mine_bytes: bytes, on_disk: bytes | None, *, released: bool
) -> Cause | None:
    """Is the record on disk still ours? ``None`` means yes.

    Args:
        mine: the record this supervisor wrote last.
        mine_bytes: its exact bytes (the steady-state fast path compares bytes only).
        on_disk: the bytes of owner.json now, or ``None`` when it is missing.
        released: whether this supervisor released its ownership.
    """
    if released:
        return Cause.RELEASED
    if on_disk is None:
        return Cause.MISSING
    if on_disk == mine_bytes:
        return None
    try:
        other = OwnerRecord.from_json(on_disk)
    except CorruptRecord:
        # A corrupt record in our own directory is not someone else's claim: it is a lost record.
        return Cause.MISSING
    return None if mine.same_identity(other) else Cause.REPLACED


class ScannedRecord(Frozen):
    """One ``*.owner`` directory as the scan saw it."""

    __slots__ = ("generation", "liveness", "name", "record", "scope")
    name: str
    generation: str
    record: OwnerRecord | None
    scope: Scope | None
    liveness: Liveness | None  # None when there is no readable record to probe

    def __init__(
        self, *, name: str, generation: str, record: OwnerRecord | None, scope: Scope | None,
        liveness: Liveness | None,
    ) -> None:
        s = object.__setattr__
        s(self, "name", name)
        s(self, "generation", generation)
        s(self, "record", record)
        s(self, "scope", scope)
        s(self, "liveness", liveness)


class AcquirePlan(Frozen):
    __slots__ = ("conflict", "move_aside")
    conflict: ScannedRecord | None
    move_aside: tuple[str, ...]

    def __init__(self, *, conflict: ScannedRecord | None, move_aside: tuple[str, ...]) -> None:
        object.__setattr__(self, "conflict", conflict)
        object.__setattr__(self, "move_aside", move_aside)


def _relevant(
    record: OwnerRecord, socket: str, state_dir: str, canonical_state_dirs: frozenset[str]
) -> bool:
    """Does this record claim the same socket or state dir?"""
    return record.socket == socket or record.state_dir in canonical_state_dirs | {state_dir}


def plan_acquire(
    *,
    generation: str,
    socket: str,
    state_dir: str,
    scanned: list[ScannedRecord],
    canonical_state_dirs: frozenset[str] = frozenset(),
) -> AcquirePlan:
    """Decide what acquisition (or the conflict scan of a restore) does with each record.

    A relevant record whose process is alive (or not knowably dead) is a conflict. A record whose
    process is dead is moved aside whatever it claims. A record that cannot be read at all is
    left alone: its owner may be alive and about to restore it, and the socket lease decides.
    """
    conflict: ScannedRecord | None = None
    aside: list[str] = []
    for rec in sorted(scanned, key=lambda r: r.name):
        if rec.generation == generation:
            continue
        if rec.record is None:
            continue
        rel = _relevant(rec.record, socket, state_dir, canonical_state_dirs)
        if rec.liveness is Liveness.DEAD:
            aside.append(rec.name)
        elif rel and conflict is None:
            conflict = rec
    return AcquirePlan(conflict=conflict, move_aside=tuple(aside))


class RestoreVerdict(StrEnum):
    RESTORE = "restore"
    ALREADY_PRESENT = "already-present"  # someone (another flight) restored it: validate again
    REFUSE_RELEASED = "released"
    REFUSE_REVOKED = "revoked"
    REFUSE_SHUTDOWN = "shutdown-in-progress"
    REFUSE_REPLACED = "record-replaced"
    REFUSE_CONFLICT = "live-conflict"
    REFUSE_DISABLED = "self-heal-disabled"


def plan_restore(
    *,
    mine: OwnerRecord,
    mine_bytes: bytes,
    on_disk: bytes | None,
    released: bool,
    revoked: bool,
    shutdown_in_progress: bool,
    conflict: ScannedRecord | None,
    self_heal: bool,
) -> RestoreVerdict:
    """Decide, under the registry guard, whether a supervisor may write its record again."""
    if released:
        return RestoreVerdict.REFUSE_RELEASED
    if revoked:
        return RestoreVerdict.REFUSE_REVOKED
    cause = judge(mine, mine_bytes, on_disk, released=False)
    if cause is None:
        return RestoreVerdict.ALREADY_PRESENT
    if cause is Cause.REPLACED:
        return RestoreVerdict.REFUSE_REPLACED
    if not self_heal:
        return RestoreVerdict.REFUSE_DISABLED
    if shutdown_in_progress:
        return RestoreVerdict.REFUSE_SHUTDOWN
    if conflict is not None:
        return RestoreVerdict.REFUSE_CONFLICT
    return RestoreVerdict.RESTORE


def cause_of_refusal(verdict: RestoreVerdict) -> Cause:
    """The ownership-lost cause a refused restore reports."""
    match verdict:
        case RestoreVerdict.REFUSE_RELEASED:
            return Cause.RELEASED
        case RestoreVerdict.REFUSE_REVOKED:
            return Cause.REVOKED
        case RestoreVerdict.REFUSE_REPLACED | RestoreVerdict.REFUSE_CONFLICT:
            return Cause.REPLACED
        case (
            RestoreVerdict.REFUSE_SHUTDOWN
            | RestoreVerdict.REFUSE_DISABLED
            | RestoreVerdict.RESTORE
            | RestoreVerdict.ALREADY_PRESENT
        ):
            return Cause.MISSING
