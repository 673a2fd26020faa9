"""A session's durable state in ``<home>/sessions/<id>/``: its metadata and transcript."""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any

from . import _fs
from ._errors import AgentdError, ErrorCode
from ._sessionid import SESSION_ID_RULE, is_session_id


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
        data = _fs.read_bytes(self.path) or b""
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
        """Append a line (no fsync: the journal is the durable record; see ``sync``)."""
        line = json.dumps({**rec, "at": now_iso()}, separators=(",", ":")).encode() + b"\n"
        if self._fd is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(
                self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        os.write(self._fd, line)
        if rec.get("kind") == "turn":
            self.turns = max(self.turns, int(rec["turn"]))
            self.keys.add((str(rec.get("client_id", "")), str(rec.get("id", ""))))
            self.last = rec


    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_meta(session_dir: Path, meta: dict[str, Any]) -> None:
    session_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    _fs.atomic_write_json(session_dir / "session.json", meta)


def read_meta(session_dir: Path) -> dict[str, Any] | None:
    raw = _fs.read_bytes(session_dir / "session.json")
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
