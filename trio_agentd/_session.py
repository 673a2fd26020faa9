"""A session's durable state in ``<home>/sessions/<id>/``: its metadata and transcript."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
from pathlib import Path
from typing import Any

from . import _fs, _storage
from ._errors import AgentdError, ErrorCode
from ._sessionid import SESSION_ID_RULE, is_session_id

log = logging.getLogger("trio_agentd.session")


def check_session_id(session_id: str) -> str:
    if not is_session_id(session_id):
        raise AgentdError(
            ErrorCode.BAD_REQUEST, f"invalid session id {session_id!r}: use {SESSION_ID_RULE}"
        )
    return session_id


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Transcript:
    """Append-only ``transcript.jsonl``; each completed turn is one fsynced line."""

    def __init__(self, session_dir: Path) -> None:
        self.dir = session_dir
        self.path = session_dir / "transcript.jsonl"
        self.turns = 0
        self.keys: set[tuple[str, str]] = set()
        self.last: dict[str, Any] | None = None
        self._fd: int | None = None
        self.pending: list[bytes] = []  # lines not written yet (a write failed)
        try:
            data = _fs.read_bytes(self.path) or b""
        except _fs.UntrustedFile as exc:
            log.error("ignoring the transcript: %s", exc)
            data = b""
        for line in data.split(b"\n"):
            try:
                rec = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict) and rec.get("kind") == "turn":
                self.turns = max(self.turns, int(rec.get("turn", 0)))
                self.keys.add((str(rec.get("client_id", "")), str(rec.get("id", ""))))
                self.last = rec

    def append(self, rec: dict[str, Any]) -> None:
        """Append a line (no fsync: the journal is the durable record; see ``sync``).

        The turn counts at once, written or not: a line that cannot be written (no space) is
        kept and written before the next one (:meth:`write_pending`), and no torn line is left.

        Raises:
            OSError: the line (and any kept before it) could not be written yet.
        """
        line = json.dumps({**rec, "at": now_iso()}, separators=(",", ":")).encode() + b"\n"
        if rec.get("kind") == "turn":
            self.turns = max(self.turns, int(rec["turn"]))
            self.keys.add((str(rec.get("client_id", "")), str(rec.get("id", ""))))
            self.last = rec
        self.pending.append(line)
        self.write_pending()

    def write_pending(self) -> None:
        """Write the kept lines, in order; a failed one is cut off again and stays kept."""
        if not self.pending:
            return
        if self._fd is None:
            _fs.ensure_dir(self.dir)
            self._fd = _fs.open_trusted(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        while self.pending:
            start = os.fstat(self._fd).st_size
            try:
                _storage.write_all(self._fd, self.pending[0])
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
                raise
            del self.pending[0]

    def sync(self) -> None:
        self.write_pending()
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
