"""Worker command journals: records, parsing, replay decisions. Pure.

One JSON object per line: ``accepted`` (before a command runs), ``started`` (written, not
flushed, just before its agent runs; for a replayable agent, whose turn runs without waiting
for the flush, in the same write as its ``accepted``), ``completed`` (with its result),
``interrupted`` (it will never complete; ``"started": false`` when it is known never to have
run), ``group`` (a process group the command's turn started: ``pgid``, leader ``pid`` and its
``start`` id; written before the group runs the agent's work) and ``group_stopped`` (a
restarted worker dealt with that group: a group of a command that never completed is an
orphan of a killed worker). A truncated or corrupt line is ignored, so a crash in the middle
of an append loses nothing that was fsynced before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ._plain import enc_hook
from ._procstate import GroupIdentity

Key = tuple[str, str]  # (client_id, command id as text)
GroupKey = tuple[Key, int, str | None]  # (command, leader pid, leader start id)


def key_of(client_id: str, command_id: str | int) -> Key:
    return (client_id, str(command_id))


@dataclass(slots=True)
class JournalState:
    accepted: dict[Key, dict[str, Any]] = field(default_factory=dict)
    completed: dict[Key, Any] = field(default_factory=dict)
    interrupted: set[Key] = field(default_factory=set)
    started: set[Key] = field(default_factory=set)  # its agent ran (or may have)
    never_started: set[Key] = field(default_factory=set)  # interrupted before it ran
    cancelled: set[Key] = field(default_factory=set)  # interrupted by a cancel
    groups: dict[GroupKey, GroupIdentity] = field(default_factory=dict)  # in start order
    groups_stopped: set[GroupKey] = field(default_factory=set)
    skipped_lines: int = 0

    def orphan_groups(self) -> list[tuple[Key, GroupIdentity]]:
        """Process groups of commands that neither completed nor were interrupted, and that no
        restart dealt with yet: whatever of them still runs has nobody to stop it."""
        return [
            (gk[0], g)
            for gk, g in self.groups.items()
            if gk not in self.groups_stopped
            and gk[0] not in self.completed
            and gk[0] not in self.interrupted
        ]

    def pending(self) -> list[tuple[Key, dict[str, Any]]]:
        """Accepted commands that neither completed nor were interrupted, in order."""
        return [
            (k, rec)
            for k, rec in self.accepted.items()
            if k not in self.completed and k not in self.interrupted
        ]

    def apply(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        k = key_of(str(rec.get("client_id", "")), rec.get("id", ""))
        if kind == "accepted":
            self.accepted[k] = rec
        elif kind == "completed":
            self.completed[k] = rec.get("result")
        elif kind == "interrupted":
            self.interrupted.add(k)
            if rec.get("started") is False:
                self.never_started.add(k)
            else:
                self.never_started.discard(k)
            if rec.get("cancelled"):
                self.cancelled.add(k)
        elif kind == "started":
            self.started.add(k)
        elif kind == "dropped":
            # accepted, then refused before its agent ran (its started marker or a flush
            # could not be written): forgotten, as if never accepted; a resend runs it
            self.accepted.pop(k, None)
            self.started.discard(k)
        elif kind in ("group", "group_stopped"):
            try:
                pid = int(rec["pid"])
                pgid = int(rec.get("pgid", pid))
            except (KeyError, TypeError, ValueError):
                self.skipped_lines += 1
                return
            start = rec.get("start")
            start = start if isinstance(start, str) else None
            if kind == "group":
                self.groups[(k, pid, start)] = GroupIdentity(pgid, pid, start)
            else:
                self.groups_stopped.add((k, pid, start))
        else:
            self.skipped_lines += 1


def written(data: bytes) -> bytes:
    """A journal file's records: its bytes up to the room written ahead of them (NUL bytes,
    which no record holds)."""
    return data.rstrip(b"\0")


def parse(data: bytes) -> JournalState:
    """The state a journal file's ``data`` records; a line that does not parse is counted in
    ``skipped_lines``.

    The room written ahead of the records (see ``_workerjournal``) is not read, nor a line of
    nothing but NUL bytes (room an older version, which appends, closed with a newline before
    its own records). A line with NUL bytes among others is one whose bytes did not all reach
    the disk: it is skipped, as any line that does not parse.
    """
    state = JournalState()
    for line in written(data).split(b"\n"):
        if not line.strip() or not line.strip(b"\0"):
            continue
        try:
            rec = _decode(line)
        except msgspec.DecodeError:
            try:  # what msgspec refuses and json takes (a lone surrogate escape, NaN)
                rec = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                state.skipped_lines += 1
                continue
        if not isinstance(rec, dict):
            state.skipped_lines += 1
            continue
        state.apply(rec)
    return state


def dropped(client_id: str, command_id: str | int) -> bytes:
    """An accepted command that never ran (told ``storage_error``, "not run"): it ends here."""
    return _line({"kind": "dropped", "client_id": client_id, "id": command_id})


def accepted(
    client_id: str, command_id: str | int, op: str, args: dict[str, Any], *,
    boot: str | None = None,
) -> bytes:
    """``boot``: the machine's boot id, to tell after a restart whether the page cache (with
    the command's ``started`` marker, if any) survived."""
    rec: dict[str, Any] = {
        "kind": "accepted", "client_id": client_id, "id": command_id, "op": op, "args": args
    }
    if boot is not None:
        rec["boot"] = boot
    return _line(rec)


def completed(client_id: str, command_id: str | int, result: Any) -> bytes:
    return _line({"kind": "completed", "client_id": client_id, "id": command_id, "result": result})


def interrupted(
    client_id: str, command_id: str | int, *, started: bool = True, cancelled: bool = False
) -> bytes:
    """``started``: whether its agent ran (or may have); absent from the record means it may.
    ``cancelled``: a client cancelled it."""
    rec: dict[str, Any] = {"kind": "interrupted", "client_id": client_id, "id": command_id}
    if not started:
        rec["started"] = False
    if cancelled:
        rec["cancelled"] = True
    return _line(rec)


def started(client_id: str, command_id: str | int) -> bytes:
    return _line({"kind": "started", "client_id": client_id, "id": command_id})


def group(client_id: str, command_id: str | int, g: GroupIdentity) -> bytes:
    """A process group the command's turn started (before it runs the agent's work)."""
    return _line({"kind": "group", "client_id": client_id, "id": command_id, "pgid": g.pgid,
                  "pid": g.pid, "start": g.start_id})


def group_stopped(client_id: str, command_id: str | int, g: GroupIdentity, outcome: str
                  ) -> bytes:
    """A restarted worker dealt with an orphaned group (``outcome``: what it found or did)."""
    return _line({"kind": "group_stopped", "client_id": client_id, "id": command_id,
                  "pgid": g.pgid, "pid": g.pid, "start": g.start_id, "outcome": outcome})


class Line(bytes):
    """A journal line that also holds the record it encodes (:attr:`rec`), so the worker
    that writes it applies the record without decoding its own line again."""

    rec: dict[str, Any]


_encode = msgspec.json.Encoder(enc_hook=enc_hook).encode  # plain StrEnums as their values
_decode = msgspec.json.Decoder().decode


def _line(obj: dict[str, Any]) -> Line:
    try:
        data = _encode(obj)
    except (UnicodeEncodeError, TypeError, OverflowError, msgspec.EncodeError):
        # a surrogate-escaped string (a prompt that is not UTF-8) goes as an escape, as
        # json.dumps writes it; so does anything msgspec would not encode
        data = json.dumps(obj, separators=(",", ":")).encode()
    line = Line(data + b"\n")
    line.rec = obj
    return line


def record_of(line: bytes) -> Any:
    """The record a line holds: the one it was made from, or its decoded JSON."""
    return line.rec if isinstance(line, Line) else json.loads(line)


def compacted(state: JournalState, keep_completed: int) -> bytes:
    """The journal rewritten: pending commands (with the process groups of theirs no restart
    dealt with yet), interrupted markers and the newest ``keep_completed`` results (older results
    are forgotten: a resend that old runs again)."""
    out = bytearray()
    done = list(state.completed.items())[-keep_completed:] if keep_completed > 0 else []
    orphans: dict[Key, list[GroupIdentity]] = {}
    for gk, g in state.orphan_groups():
        orphans.setdefault(gk, []).append(g)
    for k, rec in state.pending():
        out += _line(rec)
        if k in state.started:
            out += started(k[0], rec.get("id", k[1]))
        for g in orphans.get(k, []):
            out += group(k[0], rec.get("id", k[1]), g)
    for k in state.interrupted:
        rec = state.accepted.get(k, {"client_id": k[0], "id": k[1], "op": "?", "args": {}})
        out += _line({**rec, "kind": "accepted"})
        out += interrupted(k[0], rec.get("id", k[1]), started=k not in state.never_started,
                           cancelled=k in state.cancelled)
    for k, result in done:
        rec = state.accepted.get(k, {"client_id": k[0], "id": k[1], "op": "?", "args": {}})
        out += _line({**rec, "kind": "accepted"})
        out += completed(k[0], rec.get("id", k[1]), result)
    return bytes(out)
