"""``trio-agentd logs``: a session's history (its transcript), followed live; the daemon's log.

A session's transcript (``<home>/sessions/<id>/transcript.jsonl``, rotated to ``.1`` … like
the logs) holds one line per completed turn (``kind: turn``: prompt, the reply inline or the
path of its output file, bytes, and stderr and exit status where the agent gave them) and one
per event (``kind: event``: a worker started or stopped, a turn cancelled, killed, failed or
interrupted by a worker restart). This module prints them, and with ``-f`` follows the turns
as they stream: it asks the supervisor for a route to the session's worker, subscribes
(``follow``) and prints each chunk as it comes; at each turn's end it reads the transcript's
new lines for what the stream does not carry (the rest of the output, stderr, exit status).

Blocking and trio-free, as the rest of the CLI's client side. Memory stays bounded: files are
streamed line by line and outputs in pieces; the worker drops a follower that falls too far
behind (the turn never waits for it), and this side then catches up from where it was.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ._defaults import FOLLOW_RETRY_DELAY, RESEND_DELAY, RESEND_DELAY_MAX
from ._errors import AgentdError, ErrorCode
from ._output import read_file
from ._paths import Layout
from ._rotate import existing_files

TURN_ENDS = frozenset({"cancelled", "killed", "failed", "interrupted"})
FOLLOW_POLL = 0.25  # seconds between looks at a followed daemon log


def is_turn(rec: dict[str, Any]) -> bool:
    """A record that counts as a turn for ``-n``: a completed one, or one that did not."""
    return rec.get("kind") == "turn" or (
        rec.get("kind") == "event" and rec.get("event") in TURN_ENDS
    )


def _records(path: Path, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(offset after the line, record)`` for each whole, valid line from ``start``."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return
    with f:
        f.seek(start)
        at = start
        for line in f:
            if not line.endswith(b"\n"):
                return  # a line still being written
            at += len(line)
            try:
                rec = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict):
                yield at, rec


def history(session_dir: Path, last: int | None = None,
            current: Tail | None = None) -> Iterator[dict[str, Any]]:
    """The transcript's records, oldest first, across its rotated files; with ``last`` only
    from the ``last``-th last turn on. Two passes over the files, nothing held but a count.

    ``current``: a :class:`Tail` of ``transcript.jsonl`` opened at its start; the current
    file is read through it, so it goes on (``-f``) exactly where this stopped.
    """
    path = session_dir / "transcript.jsonl"
    files = existing_files(path)
    if current is not None and path not in files:
        files.append(path)
    first_file, skip = 0, 0
    if last is not None:
        if last == 0:
            files, first_file = files[-1:], 0
            skip = -1  # nothing: only move ``current`` past what there is
        else:
            need = last
            for i in range(len(files) - 1, -1, -1):
                n = sum(1 for _at, rec in _records(files[i]) if is_turn(rec))
                first_file = i
                if n >= need:
                    skip = n - need  # turns of this file before the ones wanted
                    break
                need -= n
    for i in range(first_file, len(files)):
        if current is not None and files[i] == path:
            records: Iterator[dict[str, Any]] = _parsed(current.lines())
        else:
            records = (rec for _at, rec in _records(files[i]))
        for rec in records:
            if skip < 0:
                continue
            if i == first_file and skip:
                if is_turn(rec):
                    skip -= 1
                continue
            yield rec


def _parsed(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            rec = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict):
            yield rec


class Printer:
    """Writes records (and live chunks) for a human, or as JSON lines.

    Human form, per turn: ``==> turn N · AT · prompt:``, the prompt, ``==> output (B bytes):``,
    the output's bytes exactly, then ``==> stderr (B bytes):`` and its bytes and ``==> exit
    status S`` when the record has them. An output that does not end in a newline is followed
    by ``\\ no newline at end of output`` (as diff does), so the next header starts a line.
    """

    def __init__(self, out: Callable[[bytes], None], *, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self._line_open = False  # the last bytes written did not end a line
        self._worker_up = False  # a worker_started with no worker_stopped since

    # raw output --------------------------------------------------------------------------
    def _header(self, text: str) -> None:
        self._end_line()
        self.out(f"==> {text}\n".encode(errors="surrogateescape"))

    def _end_line(self) -> None:
        if self._line_open:
            self.out(b"\n\\ no newline at end of output\n")
            self._line_open = False

    def _bytes(self, data: bytes) -> None:
        if data:
            self.out(data)
            self._line_open = not data.endswith(b"\n")

    def _json(self, obj: dict[str, Any]) -> None:
        self.out(json.dumps(obj, ensure_ascii=False).encode(errors="surrogateescape") + b"\n")

    # records -----------------------------------------------------------------------------
    def record(self, rec: dict[str, Any], *, streamed: int | None = None) -> None:
        """Print one record. ``streamed``: that many bytes of its output were printed live
        already (with its header): only the rest, then stderr and exit status."""
        if self.as_json:
            self._json(rec)
            return
        kind = rec.get("kind")
        if kind == "turn":
            self._turn(rec, streamed)
        elif kind == "event":
            self._event(rec, streamed)

    def _turn(self, rec: dict[str, Any], streamed: int | None) -> None:
        if streamed is None:
            self.turn_header(rec.get("turn"), rec.get("prompt"), rec.get("at"),
                             rec.get("replayed") or rec.get("recovered"))
            self.output_header(rec.get("bytes"))
            streamed = 0
        for piece in _pieces(rec, "reply", "output", streamed):
            self._bytes(piece)
        if "stderr" in rec or "stderr_output" in rec:
            self._header(f"stderr ({_count(rec.get('stderr_bytes'))}):")
            for piece in _pieces(rec, "stderr", "stderr_output", 0):
                self._bytes(piece)
        if rec.get("exit_status") is not None:
            status = rec["exit_status"]
            self._header(f"exit status {status if isinstance(status, int) else json.dumps(status)}")

    def turn_header(self, turn: object, prompt: object, at: object = None,
                    again: object = None) -> None:
        when = f" · {at}" if at else ""
        note = " (run again after a worker restart)" if again else ""
        self._header(f"turn {turn}{when}{note} · prompt:")
        text = prompt if isinstance(prompt, str) else "(prompt not kept)"
        self.out(text.encode(errors="surrogateescape") + (b"" if text.endswith("\n") else b"\n"))

    def output_header(self, size: object = None) -> None:
        self._header(f"output ({_count(size)}):" if size is not None else "output:")

    def _event(self, rec: dict[str, Any], streamed: int | None) -> None:
        event = rec.get("event")
        at = f" · {rec['at']}" if rec.get("at") else ""
        if event == "worker_started":
            crashed = self._worker_up
            self._worker_up = True
            why = " (the one before it ended without stopping: killed or crashed)" if crashed \
                else ""
            self._header(f"worker started, pid {rec.get('pid')}{at}{why}")
        elif event == "worker_stopped":
            self._worker_up = False
            sig = f" on signal {rec['signal']}" if rec.get("signal") else ""
            self._header(f"worker stopped, pid {rec.get('pid')}{sig}{at}")
        elif event in TURN_ENDS:
            if streamed is None:
                self.turn_header(rec.get("turn", "?"), rec.get("prompt"))
            self._header(f"{event}{at}: {rec.get('error', '')}")
        elif event == "rotated":
            return  # where a file begins: nothing happened
        else:
            self._header(f"{event}{at}")

    def chunk(self, data: bytes) -> None:
        self._bytes(data)

    def end(self) -> None:
        self._end_line()


def _count(size: object) -> str:
    return f"{size} bytes" if isinstance(size, int) else "? bytes"


def _pieces(rec: dict[str, Any], inline: str, path: str, start: int) -> Iterator[bytes]:
    """A record's output (or stderr) from byte ``start``: inline text, or its file."""
    text = rec.get(inline)
    if isinstance(text, str):
        data = text.encode(errors="surrogateescape")
        if start < len(data):
            yield data[start:]
        return
    where = rec.get(path)
    if isinstance(where, str):
        if not os.path.exists(where):
            if start == 0:
                yield f"(the output file {where} is gone)\n".encode(errors="surrogateescape")
            return
        for _at, piece in read_file(Path(where), start):
            yield piece


# --- reading a session's history ---------------------------------------------------------------


def session_dir_of(layout: Layout, session: str) -> Path:
    """The session's data dir.

    Raises:
        AgentdError: ``unknown_session``: no data for it here.
    """
    d = layout.session_dir(session)
    if not d.is_dir():
        raise AgentdError(
            ErrorCode.UNKNOWN_SESSION,
            f"no session {session!r} (nothing in {d}) — `trio-agentd sessions` lists them",
        )
    return d


def print_history(printer: Printer, session_dir: Path, last: int | None,
                  current: Tail | None = None) -> None:
    for rec in history(session_dir, last, current):
        printer.record(rec)
    printer.end()


class Tail:
    """New whole lines of a growing file that may be rotated (renamed away) under us: the
    file read so far is kept open and finished before the new one is begun."""

    def __init__(self, path: Path, *, from_end: bool) -> None:
        self.path = path
        self._f: BinaryIO | None = None
        self._partial = b""
        self._open(from_end=from_end)

    def _open(self, *, from_end: bool) -> None:
        try:
            self._f = open(self.path, "rb")  # noqa: SIM115 - kept open, closed in close()
        except FileNotFoundError:
            self._f = None
            return
        if from_end:
            self._f.seek(0, os.SEEK_END)

    def lines(self) -> Iterator[bytes]:
        """Whole lines appended since the last call (a line being written waits)."""
        while True:
            if self._f is None:
                self._open(from_end=False)
                if self._f is None:
                    return
            for piece in iter(lambda: self._f.read(65536) if self._f else b"", b""):
                data = self._partial + piece
                cut = data.rfind(b"\n") + 1
                self._partial = data[cut:]
                if len(self._partial) > 1 << 20:  # never a whole line: no unbounded buffer
                    self._partial = b""
                yield from data[:cut].splitlines(keepends=True)
            if not self._rotated():
                return
            self._f.close()
            self._f = None
            self._partial = b""

    def _rotated(self) -> bool:
        assert self._f is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._f.fileno())
        return (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def follow_daemon_log(path: Path, out: Callable[[bytes], None], *, last: int | None,
                      follow: bool, sleep: Callable[[float], None] = time.sleep) -> None:
    """Print the daemon log (its last ``last`` lines), then with ``follow`` what is added."""
    if not path.exists():
        raise AgentdError(ErrorCode.UNKNOWN_SESSION,
                          f"no daemon log at {path} — no supervisor has run on this socket")
    if last is None:
        tail = Tail(path, from_end=False)
        for line in tail.lines():
            out(line)
    else:
        kept: collections.deque[bytes] = collections.deque(maxlen=last)
        tail = Tail(path, from_end=False)
        kept.extend(tail.lines())
        for line in kept:
            out(line)
    try:
        while follow:
            sleep(FOLLOW_POLL)
            for line in tail.lines():
                out(line)
    finally:
        tail.close()


# --- following a session -----------------------------------------------------------------------


class Follower:
    """Prints a session's turns as they stream, and what the transcript adds at their ends."""

    def __init__(self, printer: Printer, session_dir: Path) -> None:
        self.printer = printer
        # read from its start by the history (print_history(current=tail)), then followed
        self.tail = Tail(session_dir / "transcript.jsonl", from_end=False)
        # the command streaming now, and how many of its bytes were printed
        self.command: list[Any] | None = None
        self.streamed = 0
        # commands whose transcript record was printed (their late chunks are skipped)
        self.printed: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=64)

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "turn_started":
            command = event.get("command")
            if not isinstance(command, list) or tuple(command) in self.printed:
                return
            if command != self.command:
                self.command, self.streamed = command, 0
                if self.printer.as_json:
                    self.printer._json({**event, "kind": "turn_started"})
                else:
                    self.printer.turn_header(event.get("turn"), event.get("prompt"))
                    self.printer.output_header()
        elif kind == "chunk":
            self._chunk(event)
        elif kind in ("turn_done", "following"):
            self.catch_up()

    def _chunk(self, event: dict[str, Any]) -> None:
        command = event.get("command")
        if command != self.command or not isinstance(command, list):
            return
        data = event.get("data")
        raw = base64.b64decode(data) if isinstance(data, str) else b""
        at = event.get("at")
        if not isinstance(at, int) or at > self.streamed:
            return  # a gap never happens: the worker sends every byte in order
        fresh = raw[self.streamed - at:]
        if not fresh:
            return
        if self.printer.as_json:
            self.printer._json({"kind": "chunk", "turn": event.get("turn"), "command": command,
                                "at": self.streamed, "data": base64.b64encode(fresh).decode()})
        else:
            self.printer.chunk(fresh)
        self.streamed += len(fresh)

    def catch_up(self) -> None:
        """Print the transcript's new lines; a record of the command streamed now gives only
        what the stream did not."""
        for rec in _parsed(self.tail.lines()):
            command = _command_of(rec)
            streamed = None
            if command is not None and self.command is not None and list(command) == list(
                self.command
            ):
                streamed = self.streamed
                self.command, self.streamed = None, 0
            if command is not None:
                self.printed.append(tuple(command))
            self.printer.record(rec, streamed=streamed)
        self.printer.end()

    def close(self) -> None:
        self.tail.close()


def _command_of(rec: dict[str, Any]) -> tuple[Any, ...] | None:
    if rec.get("kind") == "turn" and "client_id" in rec:
        return (str(rec.get("client_id")), str(rec.get("id")))
    command = rec.get("command")
    if rec.get("kind") == "event" and isinstance(command, list) and len(command) == 2:
        return (str(command[0]), str(command[1]))
    return None


def follow_session(layout: Layout, session: str, follower: Follower,
                   *, client: Any, notice: Callable[[str], None],
                   sleep: Callable[[float], None] = time.sleep) -> None:
    """Follow ``session`` until interrupted: route to its worker, ``follow``, print. A worker
    that goes away (stopped, restarted) is routed to again; a follower let go for falling
    behind subscribes again from where it was.

    Raises:
        AgentdError: the session is gone (``unknown_session``), or another failure.
    """
    from ._syncclient import _attach
    from ._syncconn import _await_response, _Liveness, _Lost
    from ._wirerules import REROUTE

    delay = RESEND_DELAY
    n = 0
    while True:
        n += 1
        _wait_until_running(layout, session, follower, client=client, sleep=sleep)
        try:
            route = client._request_supervisor(
                f"route-f{n}", "route", {"session": session, "existing": True}, None, None)
        except AgentdError as exc:
            if exc.code == ErrorCode.UNKNOWN_SESSION:
                follower.catch_up()
                raise AgentdError(ErrorCode.UNKNOWN_SESSION,
                                  f"session {session} was removed") from None
            raise
        rid = f"follow-{n}"
        args: dict[str, Any] = {}
        if follower.command is not None:
            args = {"command": follower.command, "at": follower.streamed}
        frame = {"type": "request", "id": rid, "client_id": client.client_id, "op": "follow",
                 "args": args}
        liveness = _Liveness(client.timing, {"type": "request", "id": f"ping-f{n}",
                                             "client_id": client.client_id, "op": "ping",
                                             "args": {}}, session, route.get("worker_pid"))
        conn = None
        try:
            conn = _attach(route, client.timing)
            conn.send(frame)
            _await_response(conn, rid, follower.on_event, liveness)
            delay = RESEND_DELAY  # the worker ended the follow (it should not): again
        except AgentdError as exc:
            if exc.code == ErrorCode.FOLLOWER_BEHIND:
                notice(f"{exc.message}; catching up")
                delay = RESEND_DELAY
            elif exc.code not in REROUTE and exc.code != ErrorCode.WORKER_UNRESPONSIVE:
                raise
        except (OSError, _Lost):
            pass  # the worker went away (stopped, restarted): route again
        finally:
            if conn is not None:
                conn.close()
        follower.catch_up()  # whatever was written meanwhile (a worker stopped, a turn)
        sleep(delay)
        delay = min(delay * 2, RESEND_DELAY_MAX)


def _wait_until_running(layout: Layout, session: str, follower: Follower, *, client: Any,
                       sleep: Callable[[float], None]) -> None:
    """Return once the session has a worker (or is getting one): a follower never starts a
    stopped, evicted, failed or killed session's worker (that is a prompt's to do), so an
    idle session is still evicted while followed. Meanwhile the transcript is followed.

    Raises:
        AgentdError: ``unknown_session`` once the session's data is gone (``rm``).
    """
    delay = FOLLOW_RETRY_DELAY
    while True:
        rows = client._request_supervisor("sessions-f", "sessions", {}, None, None)
        row = next((r for r in rows if isinstance(r, dict) and r.get("session") == session),
                   None)
        if row is not None and row.get("state") not in ("stopped", "evicted", "failed"):
            return
        follower.catch_up()
        if not layout.session_dir(session).is_dir():
            raise AgentdError(ErrorCode.UNKNOWN_SESSION, f"session {session} was removed")
        sleep(delay)
        delay = min(delay * 2, RESEND_DELAY_MAX)


def write_stdout(data: bytes) -> None:
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(data.decode("utf-8", "replace"))
        sys.stdout.flush()
        return
    buffer.write(data)
    buffer.flush()
