"""A session's durable state in ``<home>/sessions/<id>/``: its metadata and transcript."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import msgspec

from . import _fs
from ._errors import AgentdError, ErrorCode
from ._plain import enc_hook
from ._rotate import Limits
from ._sessionid import SESSION_ID_RULE, is_session_id

log = logging.getLogger("trio_agentd.session")

_encode = msgspec.json.Encoder(enc_hook=enc_hook).encode  # plain StrEnums as their values


def _line(rec: dict[str, Any]) -> bytes:
    """One transcript line: compact JSON (msgspec, a turn's cost; json for what it refuses,
    a prompt that is not UTF-8, which json writes as escapes)."""
    try:
        return _encode(rec) + b"\n"
    except (UnicodeEncodeError, TypeError, OverflowError, msgspec.EncodeError):
        return json.dumps(rec, separators=(",", ":")).encode() + b"\n"


def check_session_id(session_id: str) -> str:
    if not is_session_id(session_id):
        raise AgentdError(
            ErrorCode.BAD_REQUEST, f"invalid session id {session_id!r}: use {SESSION_ID_RULE}"
        )
    return session_id


def now_iso() -> str:
    return iso_ms(time.time())


_second: tuple[int, str] = (-1, "")  # the last whole second formatted (a turn's lines share it)


def iso_ms(t: float) -> str:
    """``t`` (seconds since the epoch, not before it) as UTC ISO 8601 with milliseconds, as
    ``datetime.isoformat(timespec="milliseconds")`` writes it, ``Z`` for the zone; the
    date and time of the second formatted once per second, not per line."""
    global _second
    # split as datetime does: the fraction rounded to microseconds (half to even), then cut
    frac, whole = math.modf(t)
    sec, us = int(whole), round(frac * 1e6)
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    if _second[0] != sec:
        _second = (sec, _dt.datetime.fromtimestamp(sec, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{_second[1]}.{us // 1000:03d}Z"


class Transcript:
    """Append-only ``transcript.jsonl``: one line per completed turn (``kind: turn``) and per
    event (``kind: event``: a worker start, a turn cancelled, killed, failed or interrupted by
    a worker restart, a rotation).

    Size-bounded like the logs (``limits``): a line that would take the file past
    ``max_bytes`` first moves it to ``transcript.jsonl.1`` (and so on, ``backups`` kept), and
    the new file starts with a ``rotated`` event naming the turns before it, so turn numbers
    go on and the turns in older files count as transcribed (:meth:`has`).
    """

    def __init__(self, session_dir: Path, limits: Limits | None = None) -> None:
        self.dir = session_dir
        self.path = session_dir / "transcript.jsonl"
        self.output_dir = session_dir / "output"  # turns' spilled output (joined once: pathlib)
        self.output_prefix = f"{self.output_dir}{os.sep}"  # ... a turn's file: prefix + name
        self.limits = limits or Limits()
        self.turns = 0
        self.rotated_through = 0  # every turn up to this one is in a rotated file
        self.keys: set[tuple[str, str]] = set()
        self.last: dict[str, Any] | None = None
        self._fd: int | None = None
        self._size: int | None = None  # of the open file (only this worker appends to it)
        self.pending: list[bytes] = []  # lines not written yet (a write failed)
        self._floor = 0  # a file no bigger than this (its rotated header) is not rotated
        try:
            data = _fs.read_bytes(self.path) or b""
        except _fs.UntrustedFile as exc:
            log.error("ignoring the transcript: %s", exc)
            data = b""
        self._torn = _fs.torn_tail(data)  # sealed when the file is opened to append
        for line in data.split(b"\n"):
            try:
                rec = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("kind") == "turn":
                self.turns = max(self.turns, int(rec.get("turn", 0)))
                self.keys.add((str(rec.get("client_id", "")), str(rec.get("id", ""))))
                self.last = rec
            elif rec.get("kind") == "event" and rec.get("event") == "rotated":
                through = rec.get("turns")
                if isinstance(through, int) and not isinstance(through, bool):
                    self.rotated_through = max(self.rotated_through, through)
                    self.turns = max(self.turns, through)

    def has(self, key: tuple[str, str], turn: object) -> bool:
        """Whether the completed command ``key`` (its turn ``turn``) is transcribed already:
        turns are transcribed in order, so one in a rotated file is, whatever its key."""
        if key in self.keys:
            return True
        return isinstance(turn, int) and not isinstance(turn, bool) and (
            turn <= self.rotated_through
        )

    def append(self, rec: dict[str, Any]) -> None:
        """Append a line (no fsync: the journal is the durable record; see ``sync``).

        The turn counts at once, written or not: a line that cannot be written (no space) is
        kept and written before the next one (:meth:`write_pending`), and no torn line is left.

        Raises:
            OSError: the line (and any kept before it) could not be written yet.
        """
        line = _line({**rec, "at": now_iso()})
        if rec.get("kind") == "turn":
            self.turns = max(self.turns, int(rec["turn"]))
            self.keys.add((str(rec.get("client_id", "")), str(rec.get("id", ""))))
            self.last = rec
        self.pending.append(line)
        self.write_pending()

    def event(self, event: str, **fields: Any) -> None:
        """Append an event line; one that cannot be written now is kept (and logged)."""
        try:
            self.append({"kind": "event", "event": event, **fields})
        except OSError as exc:
            log.error("transcript %s: %s", self.path, exc)

    def write_pending(self) -> None:
        """Write the kept lines, in order; a failed one is cut off again and stays kept."""
        if not self.pending:
            return
        if self._fd is None:
            _fs.ensure_dir(self.dir)
            self._fd = _fs.open_trusted(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            if self._torn is not None:
                _fs.seal_torn_tail(self._fd, self._torn)
                self._torn = None
        while self.pending:
            if self._size is None:  # (the file's size is read once per open, then kept)
                self._size = os.fstat(self._fd).st_size
            start = self._size
            limit = self.limits.max_bytes
            if limit > 0 and start > self._floor and start + len(self.pending[0]) > limit:
                self._rotate()
                continue
            try:
                _fs.write_all(self._fd, self.pending[0])
            except OSError:
                self._size = None  # (read again: the cut below may not have happened)
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                raise
            self._size = start + len(self.pending[0])
            del self.pending[0]

    def _rotate(self) -> None:
        """Move the file aside (bounded: the oldest beyond ``backups`` goes) and start a new
        one with a ``rotated`` event, written before the line that did not fit."""
        from ._rotate import shift

        assert self._fd is not None
        with contextlib.suppress(OSError):
            os.fsync(self._fd)  # the old file is complete before it is moved
        os.close(self._fd)
        self._fd = None
        self._size = None
        shift(self.path, self.limits.backups)
        self._fd = _fs.open_trusted(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        # the line that did not fit is not written yet: turns before it are done
        through = self.turns
        first = self.pending[0] if self.pending else b""
        with contextlib.suppress(ValueError, TypeError):
            rec = json.loads(first)
            if isinstance(rec, dict) and rec.get("kind") == "turn":
                through = int(rec.get("turn", 1)) - 1
        self.rotated_through = max(self.rotated_through, through)
        header = json.dumps({"kind": "event", "event": "rotated", "turns": through,
                             "at": now_iso()}, separators=(",", ":")).encode() + b"\n"
        self.pending.insert(0, header)
        self._floor = len(header)
        log.info("transcript %s rotated (past %d bytes)", self.path, self.limits.max_bytes)

    def sync(self) -> None:
        self.write_pending()
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._size = None


def write_meta(session_dir: Path, meta: dict[str, Any]) -> None:
    _fs.ensure_dir(session_dir)  # 0700, and refused if another user could write in it
    _fs.atomic_write_json(session_dir / "session.json", meta)


def read_meta(session_dir: Path) -> dict[str, Any] | None:
    """The session's metadata, or ``None`` if there is none, or none we can trust (a corrupt
    file, or one another user could have written: refused with a logged reason)."""
    try:
        raw = _fs.read_bytes(session_dir / "session.json")
    except _fs.UntrustedFile as exc:
        log.error("refusing session metadata: %s", exc)
        return None
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
