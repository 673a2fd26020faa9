"""The ownership registry on disk, and a supervisor's claim on it.

Theory of operation
-------------------
``Registry`` is the thin file layer: record directories, the registry guard (a flock held for
each mutation only), the shutdown admission probe, revocation tombstones. Every decision is made
by the pure functions of :mod:`._ownership`; this module reads what they need and carries out
what they decide.

``Ownership`` is one supervisor's claim. ``acquire`` runs before the socket listens, so a
supervisor that answers a hello always has a record. ``ensure_current`` runs on every command:
one file read in steady state. When the record is missing it restores it *single-flight*: the
restore runs in the supervisor's service nursery (never in a caller's task, so a cancelled caller
cannot cancel it for the others), every concurrent caller waits for that one flight, then
validates again.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import logging
import os
import secrets
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import trio

from . import _fs
from . import _registryfiles as _names
from ._errors import AgentdError, ErrorCode
from ._identity import liveness, own_start_id
from ._ownership import (
    CAUSE_TEXT,
    RECORD_VERSION,
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
from ._paths import Layout
from ._singleflight import SingleFlight
from .timing import DEFAULT_TIMING, REGISTRY_RELEASE_TIMEOUT, Timing

log = logging.getLogger("trio_agentd.supervisor")


def utcnow() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Registry:
    """File operations on ``<registry>/``. Every mutation must run under :meth:`guard`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def ensure(self) -> None:
        try:
            _fs.ensure_dir(self.root)
        except PermissionError as exc:
            raise AgentdError(
                ErrorCode.PERMISSION_DENIED,
                f"cannot create the ownership registry {self.root}: {exc.strerror}"
                " — fix its permissions or set TRIO_AGENTD_REGISTRY_DIR",
            ) from None

    # paths -----------------------------------------------------------------------------
    @property
    def guard_path(self) -> Path:
        return self.root / _names.GUARD_FILE

    @property
    def shutdown_lock_path(self) -> Path:
        return self.root / _names.SHUTDOWN_LOCK_FILE

    def owner_dir(self, generation: str) -> Path:
        return self.root / _names.owner_dir_name(generation)

    def owner_json(self, generation: str) -> Path:
        return self.owner_dir(generation) / _names.OWNER_FILE

    def scope_json(self, generation: str) -> Path:
        return self.owner_dir(generation) / _names.SCOPE_FILE

    def tombstone(self, generation: str) -> Path:
        return self.root / _names.tombstone_name(generation)

    # reads ------------------------------------------------------------------------------
    def read_owner_bytes(self, generation: str) -> bytes | None:
        """The record's bytes (``None``: missing). A record another user could have written
        reads as empty: corrupt, so its owner restores it and nobody else trusts it."""
        try:
            return _fs.read_bytes(self.owner_json(generation))
        except _fs.UntrustedFile as exc:
            log.error("owner record: %s", exc)
            return b""

    def is_revoked(self, generation: str) -> bool:
        return self.tombstone(generation).exists()

    def shutdown_in_progress(self, ticket: str | None = None) -> bool:
        """Whether a ``shutdown`` or ``doctor --fix`` holds the admission (and it is not ours)."""
        path = self.shutdown_lock_path
        if not _fs.is_locked(path):
            return False
        if ticket:
            try:
                holder = json.loads(path.read_bytes() or b"{}")
            except (OSError, ValueError):
                holder = {}
            if isinstance(holder, dict) and holder.get("ticket") == ticket:
                return False
        return True

    def scan(self) -> list[ScannedRecord]:
        """Every ``*.owner`` record, with the liveness of its process."""
        out: list[ScannedRecord] = []
        for name in _names.record_names(self.root):
            generation = name[: -len(_names.OWNER_SUFFIX)]
            record: OwnerRecord | None = None
            scope: Scope | None = None
            raw = self.read_owner_bytes(generation)
            if raw is not None:
                with contextlib.suppress(CorruptRecord):
                    record = OwnerRecord.from_json(raw)
            with contextlib.suppress(CorruptRecord, _fs.UntrustedFile):
                raw_scope = _fs.read_bytes(self.scope_json(generation))
                if raw_scope is not None:
                    scope = Scope.from_json(raw_scope)
            live = liveness(record.pid, record.start_id) if record is not None else None
            out.append(
                ScannedRecord(
                    name=name, generation=generation, record=record, scope=scope, liveness=live
                )
            )
        return out

    # mutations (under the guard) --------------------------------------------------------
    @contextlib.asynccontextmanager
    async def guard(self, timing: Timing = DEFAULT_TIMING) -> AsyncIterator[None]:
        if not self.root.is_dir():
            # deleted under us (a cleaner): made again, as the owner record it guards is
            log.warning("ownership registry %s was removed; made it again", self.root)
            self.ensure()
        async with _fs.locked(self.guard_path, poll=timing.lock_poll):
            yield

    def write_candidate(self, record: OwnerRecord) -> Path:
        cand = self.root / f".candidate-{record.generation}-{secrets.token_hex(4)}"
        cand.mkdir(mode=0o700)
        _fs.atomic_write(cand / _names.SCOPE_FILE, record.scope.to_json())
        _fs.atomic_write(cand / _names.OWNER_FILE, record.to_json())
        return cand

    def install_candidate(self, candidate: Path, generation: str) -> None:
        os.rename(candidate, self.owner_dir(generation))
        _fs.fsync_dir(self.root)

    def write_in_place(self, record: OwnerRecord) -> bytes:
        """(Re)write a record in its directory, creating the directory if it was removed."""
        d = self.owner_dir(record.generation)
        d.mkdir(mode=0o700, exist_ok=True)
        _fs.atomic_write(d / _names.SCOPE_FILE, record.scope.to_json())
        data = record.to_json()
        _fs.atomic_write(d / _names.OWNER_FILE, data)
        return data

    def move_aside(self, name: str) -> None:
        _names.move_aside(self.root, name)

    def remove(self, generation: str) -> None:
        self.move_aside(_names.owner_dir_name(generation))

    def revoke(self, generation: str) -> None:
        _names.write_tombstone(self.root, generation, {"at": utcnow()})


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnershipStatistics:
    restores: int
    restore_flights: int
    checks: int


class Ownership:
    """One supervisor's claim on its registry record.

    Cancellation: ``acquire`` may be cancelled at any point and leaves at most a candidate
    directory behind (hidden, ignored by scans). A caller of ``ensure_current`` that is cancelled
    stops waiting; the restore flight it joined goes on for the others.
    """

    def __init__(
        self,
        registry: Registry,
        layout: Layout,
        *,
        generation: str,
        app_version: str,
        protocol: int,
        self_heal: bool = True,
        admission_ticket: str | None = None,
        timing: Timing = DEFAULT_TIMING,
        pid: int | None = None,
        start_id: str | None = None,
    ) -> None:
        self.registry = registry
        self.layout = layout
        self.generation = generation
        self.token = secrets.token_hex(16)
        self.self_heal = self_heal
        self.admission_ticket = admission_ticket
        self.timing = timing
        now = utcnow()
        self.record = OwnerRecord(
            version=RECORD_VERSION,
            generation=generation,
            token=self.token,
            pid=os.getpid() if pid is None else pid,
            start_id=own_start_id() if start_id is None else start_id,
            socket=layout.socket,
            home=os.path.realpath(layout.home),
            state_dir=os.path.realpath(layout.state_dir),
            app_version=app_version,
            protocol=protocol,
            phase=Phase.STARTING,
            created_at=now,
            updated_at=now,
        )
        self._bytes = self.record.to_json()
        self.released = False
        self.revoked = trio.Event()
        self._flight: SingleFlight[RestoreVerdict] | None = None
        self._restores = 0
        self._flights = 0
        self._checks = 0

    def bind_nursery(self, nursery: trio.Nursery) -> None:
        """Restores fly in this (long-lived, service) nursery."""
        self._flight = SingleFlight(nursery, self._restore_flight)

    def statistics(self) -> OwnershipStatistics:
        return OwnershipStatistics(
            restores=self._restores, restore_flights=self._flights, checks=self._checks
        )

    # acquisition ----------------------------------------------------------------------
    async def acquire(self) -> None:
        """Claim the socket and state dir, or raise ``already_running`` naming the incumbent.

        A held shutdown admission defers the claim (polling) for at most ``admission_wait``.
        """
        self.registry.ensure()
        candidate = self.registry.write_candidate(self.record)
        try:
            with trio.move_on_after(self.timing.admission_wait) as scope:
                while True:
                    async with self.registry.guard(self.timing):
                        if not self.registry.shutdown_in_progress(self.admission_ticket):
                            self._install_under_guard(candidate)
                            return
                    await trio.sleep(self.timing.admission_poll)
            if scope.cancelled_caught:
                raise AgentdError(
                    ErrorCode.SHUTTING_DOWN,
                    "a shutdown or doctor --fix holds the admission; supervisor did not start"
                    " — retry when it has finished",
                )
        finally:
            if candidate.exists():
                shutil.rmtree(candidate, ignore_errors=True)

    def _install_under_guard(self, candidate: Path) -> None:
        plan = plan_acquire(
            generation=self.generation,
            socket=self.record.socket,
            state_dir=self.record.state_dir,
            scanned=self.registry.scan(),
        )
        if plan.conflict is not None:
            raise already_running(plan.conflict)
        for name in plan.move_aside:
            log.info("Moved aside the owner record %s of a dead supervisor", name)
            self.registry.move_aside(name)
        self.registry.install_candidate(candidate, self.generation)

    async def set_phase(self, phase: Phase) -> None:
        async with self.registry.guard(self.timing):
            if judge(self.record, self._bytes, self.registry.read_owner_bytes(self.generation),
                     released=self.released) is not None:
                return
            self.record = self.record.with_phase(phase, utcnow())
            self._bytes = await self._write_record()

    async def _write_record(self) -> bytes:
        """Write the record in place; a failed write (no space) is logged and retried
        (``storage_retry_delays``) before it raises."""
        from ._storage import retried

        return await retried(
            lambda: self.registry.write_in_place(self.record),
            what=f"owner record {self.registry.owner_json(self.generation)}",
            delays=self.timing.storage_retry_delays,
            log=log,
        )

    async def release(self) -> None:
        """Give the claim up (clean shutdown): remove the record if it is still ours."""
        self.released = True
        with trio.move_on_after(REGISTRY_RELEASE_TIMEOUT, shield=True):
            async with self.registry.guard(self.timing):
                on_disk = self.registry.read_owner_bytes(self.generation)
                if judge(self.record, self._bytes, on_disk, released=False) in (
                    None,
                    Cause.MISSING,
                ):
                    self.registry.remove(self.generation)

    # validation -----------------------------------------------------------------------
    def check(self) -> Cause | None:
        """Validate once: one small file read, no locks, no process probes.

        Raises:
            OwnershipUnknown: the record could not be read (EMFILE, ENFILE, EIO…): ownership
                is neither confirmed nor lost; ask again later.
        """
        self._checks += 1
        try:
            on_disk = self.registry.read_owner_bytes(self.generation)
        except OSError as exc:
            raise ownership_unknown(self.generation, exc) from None
        cause = judge(self.record, self._bytes, on_disk, released=self.released)
        if cause is not None and cause is not Cause.RELEASED and self.registry.is_revoked(
            self.generation
        ):
            cause = Cause.REVOKED
        if cause is Cause.REVOKED:
            self.revoked.set()
        return cause

    async def ensure_current(self) -> None:
        """Prove this supervisor still owns its record, restoring it if it was deleted.

        Raises:
            AgentdError: ``ownership_lost`` with ``details.cause`` when it does not.
            OwnershipUnknown: (``resource_exhausted`` or ``storage_error``) the record could
                not be read or restored for want of descriptors or an I/O error: unknown, not
                lost; nothing was restored or given up.

        Cancellation: safe at any point; a restore in flight continues for other callers.
        """
        cause = self.check()
        if cause is None:
            return
        if cause is Cause.MISSING and self._flight is not None:
            try:
                verdict = await self._flight.run()
            except AgentdError as exc:
                if isinstance(exc.__cause__, OwnershipUnknown):
                    raise exc.__cause__ from None
                raise
            cause = self.check()
            if cause is None:
                return
            if verdict not in (RestoreVerdict.RESTORE, RestoreVerdict.ALREADY_PRESENT):
                cause = cause_of_refusal(verdict) if cause is Cause.MISSING else cause
                raise ownership_lost(self.generation, cause, refusal=verdict)
        raise ownership_lost(self.generation, cause)

    async def _restore_flight(self) -> RestoreVerdict:
        self._flights += 1
        try:
            return await self._restore_flight_guarded()
        except OSError as exc:
            raise ownership_unknown(self.generation, exc) from None

    async def _restore_flight_guarded(self) -> RestoreVerdict:
        async with self.registry.guard(self.timing):
            on_disk = self.registry.read_owner_bytes(self.generation)
            conflict = None
            revoked = self.registry.is_revoked(self.generation)
            in_progress = self.registry.shutdown_in_progress(self.admission_ticket)
            if on_disk is None and not revoked and not self.released:
                plan = plan_acquire(
                    generation=self.generation,
                    socket=self.record.socket,
                    state_dir=self.record.state_dir,
                    scanned=self.registry.scan(),
                )
                conflict = plan.conflict
            verdict = plan_restore(
                mine=self.record,
                mine_bytes=self._bytes,
                on_disk=on_disk,
                released=self.released,
                revoked=revoked,
                shutdown_in_progress=in_progress,
                conflict=conflict,
                self_heal=self.self_heal,
            )
            if verdict is RestoreVerdict.RESTORE:
                self.record = self.record.with_phase(self.record.phase, utcnow())
                self._bytes = await self._write_record()
                self._restores += 1
                log.warning(
                    "Restored supervisor owner record for generation %s after external removal",
                    self.generation,
                )
            elif verdict is not RestoreVerdict.ALREADY_PRESENT:
                log.warning(
                    "Refused to restore the owner record of generation %s: %s",
                    self.generation,
                    verdict,
                )
            if verdict is RestoreVerdict.REFUSE_REVOKED:
                self.revoked.set()
            return verdict


def already_running(incumbent: ScannedRecord) -> AgentdError:
    rec = incumbent.record
    pid = rec.pid if rec is not None else None
    socket = rec.socket if rec is not None else (incumbent.scope.socket if incumbent.scope else "?")
    return AgentdError(
        ErrorCode.ALREADY_RUNNING,
        f"a supervisor is already running for {socket}: pid {pid}, generation"
        f" {incumbent.generation} — use it, or stop it with `trio-agentd shutdown`",
        {"pid": pid, "generation": incumbent.generation, "socket": socket},
    )


class OwnershipUnknown(AgentdError):
    """The owner record could not be read: ownership is *unknown*, never lost on this."""


def ownership_unknown(generation: str, exc: OSError) -> OwnershipUnknown:
    from ._exhaustion import exhaustion_text, is_exhaustion

    what = f"cannot read the owner record of generation {generation}"
    if is_exhaustion(exc):
        return OwnershipUnknown(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"{what}: {exhaustion_text(exc.errno)}",
            {"generation": generation, "errno": errno.errorcode.get(exc.errno or 0)},
        )
    return OwnershipUnknown(
        ErrorCode.STORAGE_ERROR,
        f"{what}: {exc} — ownership unknown, checked again shortly",
        {"generation": generation, "errno": errno.errorcode.get(exc.errno or 0)},
    )


def ownership_lost(
    generation: str, cause: Cause, *, refusal: RestoreVerdict | None = None
) -> AgentdError:
    text = CAUSE_TEXT[cause]
    extra = f" (restore refused: {refusal})" if refusal is not None else ""
    return AgentdError(
        ErrorCode.OWNERSHIP_LOST,
        f"supervisor generation {generation} no longer owns its registry entry: {text}{extra}"
        ' — run "trio-agentd doctor --fix" to restart it (sessions are preserved)',
        {"cause": str(cause), "generation": generation,
         **({"refusal": str(refusal)} if refusal is not None else {})},
    )
