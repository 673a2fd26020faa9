"""The worker's re-fence: is the supervisor on this connection still the registered owner?

Pure apart from two injected reads, so it runs on MockClock with an in-memory registry. Steady
state costs one record read: the process start id is re-read only when the record's bytes
changed since the last successful check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._ownership import CorruptRecord, OwnerRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """What a supervisor claims when it authenticates to a worker."""

    generation: str
    pid: int
    start_id: str | None
    socket: str


class Fence:
    def __init__(
        self,
        claim: Claim,
        read_record: Callable[[str], bytes | None],
        read_start_id: Callable[[int], str | None],
    ) -> None:
        self.claim = claim
        self._read_record = read_record
        self._read_start_id = read_start_id
        self._last_ok: bytes | None = None

    def check(self) -> str | None:
        """``None`` if the claim holds, else a short reason."""
        raw = self._read_record(self.claim.generation)
        if raw is None:
            return "record-missing"
        if raw == self._last_ok:
            return None
        try:
            rec = OwnerRecord.from_json(raw)
        except CorruptRecord:
            return "record-corrupt"
        c = self.claim
        if (rec.generation, rec.pid, rec.start_id, rec.socket) != (
            c.generation,
            c.pid,
            c.start_id,
            c.socket,
        ):
            return "record-replaced"
        if self._read_start_id(c.pid) != c.start_id:
            return "supervisor-gone"
        self._last_ok = raw
        return None
