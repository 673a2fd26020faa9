"""A live supervisor whose listen backlog is full (busy: many clients at once on a loaded
machine) gets patience for the connect, as for its hello: the clients wait, and advise a
repair only once it is really unresponsive past patience or nothing holds its lease.

Real sockets in a private temp dir: a listener with a full backlog, accepted by a thread once
the client has decided to be patient (it looked up the lease holder)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from trio_agentd import _client, _syncconn
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._paths import Layout
from trio_agentd.timing import DEFAULT_TIMING

# patience waits far longer than the test takes
TIMING = dataclasses.replace(DEFAULT_TIMING, patience=30.0, patience_tick=0.05)
HELLO = json.dumps({"type": "hello", "pid": os.getpid()}).encode() + b"\n"


@dataclasses.dataclass
class Busy:
    layout: Layout
    listener: socket.socket
    fillers: list[socket.socket]
    asked: threading.Event  # the client looked up the lease holder (it is being patient)


@pytest.fixture
def busy(tmp_path: Path) -> Iterator[Busy]:
    """A listening socket whose backlog is full, and a lease naming this (live) process."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    layout = Layout(home=tmp_path / "home", socket=str(run / "d.sock"), registry=tmp_path / "r")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(layout.socket)
    listener.listen(0)
    fillers: list[socket.socket] = []
    try:
        while True:  # fill the backlog: the next connect waits
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            fillers.append(s)
            s.setblocking(False)
            if s.connect_ex(layout.socket) != 0:
                fillers.pop().close()
                break
        Path(layout.lease_path).write_text(json.dumps({"pid": os.getpid()}))
        yield Busy(layout, listener, fillers, threading.Event())
    finally:
        for s in fillers:
            s.close()
        listener.close()


def _answer_once_asked(b: Busy) -> threading.Thread:
    """Once the client is patient: accept every waiting connection and send each a hello."""
    def run() -> None:
        if not b.asked.wait(10):
            return
        b.listener.settimeout(10)
        for _ in range(len(b.fillers) + 1):  # the fillers, then the client
            conn, _addr = b.listener.accept()
            with conn:
                conn.sendall(HELLO)
                if _ == len(b.fillers):
                    conn.recv(1)  # the client's connection: held until it is done

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _holder(b: Busy, alive: bool) -> Callable[[Layout], int | None]:
    def holder(layout: Layout) -> int | None:
        b.asked.set()
        return os.getpid() if alive else None
    return holder


def test_sync_probe_waits_for_a_busy_supervisor_with_a_progress_line(
    busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_syncconn, "_lease_holder", _holder(busy, alive=True))
    t = _answer_once_asked(busy)
    said: list[str] = []
    got = _syncconn.probe(busy.layout, TIMING, patience=TIMING.patience, progress=said.append)
    assert got is not None
    conn, hello = got
    assert hello["type"] == "hello"
    conn.close()
    t.join(10)
    assert said
    assert said[0].startswith(f"supervisor pid {os.getpid()} not accepting connections for")


def test_sync_probe_advises_repair_at_once_when_nothing_holds_the_lease(
    busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_syncconn, "_lease_holder", _holder(busy, alive=False))
    said: list[str] = []
    with pytest.raises(AgentdError) as err:
        _syncconn.probe(busy.layout, TIMING, patience=TIMING.patience, progress=said.append)
    assert err.value.code == ErrorCode.DAEMON_UNAVAILABLE
    assert "does not accept connections (waited 0.0s)" in err.value.message
    assert "doctor --fix" in err.value.message
    assert said == []


def test_sync_probe_advises_repair_past_patience(
    busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_syncconn, "_lease_holder", _holder(busy, alive=True))
    said: list[str] = []
    with pytest.raises(AgentdError) as err:
        _syncconn.probe(busy.layout, TIMING, patience=0.15, progress=said.append)
    assert "doctor --fix" in err.value.message
    assert len(said) >= 1  # it waited, saying so, before advising a repair


async def test_async_probe_waits_for_a_busy_supervisor(
    busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_client, "_lease_holder", _holder(busy, alive=True))
    t = _answer_once_asked(busy)
    with trio.fail_after(10), pytest.raises(AgentdError) as err:
        await _client._probe(busy.layout, TIMING)
    # it connected and read what the supervisor sent (a stub hello the client rejects), never
    # "does not accept connections", nor a stream connected to nobody ("uid -1")
    assert err.value.message.startswith("invalid message:"), err.value.message
    await trio.to_thread.run_sync(t.join, 10)
    assert not t.is_alive()  # the thread accepted the client's connection: it connected
