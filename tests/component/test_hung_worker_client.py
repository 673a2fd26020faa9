"""A client's direct route to a hung worker, on MockClock (Trio client) and over a socketpair
(the CLI's blocking client).

The worker is a real :class:`WorkerCore` whose end of the client's connection can be frozen
(:meth:`FakeProcess.freeze`: SIGSTOP, a blocked event loop): the connection stays open and
nothing is read or answered. While a prompt is outstanding, the client pings a worker it has
heard nothing from for ``link_ping_interval`` (2 s) and fails the prompt with
``worker_unresponsive`` if nothing arrives within ``link_ping_timeout`` (3 s) of the ping.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd import _client, _syncclient, _syncconn
from trio_agentd._aio import MessageStream as ClientStream
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._grant import make_grant
from trio_agentd._paths import Layout
from trio_agentd._protocol import Attach, AuthOk, WorkerHello
from trio_agentd._workercore import WorkerCore
from trio_agentd._workerlink import link_over_stream
from trio_agentd.agents import TurnContext
from trio_agentd.testing import Behaviour, FakeProcess, MemoryRegistry, make_worker_core
from trio_agentd.testing._fakeops import _ProcessStream
from trio_agentd.timing import DEFAULT_TIMING

from ..anyio_support import TrioByteStream

pytestmark = pytest.mark.timeout(30)

SOCKET = "/run/s.sock"
TOKEN = "worker-token"


class SilentAgent:
    """Each turn works for a minute without a byte of output."""

    replayable = True

    def __init__(self) -> None:
        self.prompts: list[str] = []

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        self.prompts.append(prompt)
        await trio.sleep(60.0)
        yield f"done: {prompt}"


class Worker:
    """A worker core served by a supervisor link, and the client's direct connection to it."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.registry = MemoryRegistry()
        self.agent = SilentAgent()
        self.core: WorkerCore = make_worker_core(self.registry, supervisor_socket=SOCKET,
                                                 token=TOKEN, agent=self.agent)
        self.process = FakeProcess(pid=4242, behaviour=Behaviour.ANSWERS)

    async def start(self) -> None:
        await self.nursery.start(self.core.serve)
        self.registry.add_owner(generation="g1", pid=100, socket=SOCKET,
                                start_id="boot:100")
        ours, theirs = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self.core.serve_connection, theirs)
        link = await link_over_stream(ours, token=TOKEN, generation="g1", pid=100,
                                      start_id="boot:100", socket=SOCKET)
        self.nursery.start_soon(link.run_reader)  # the supervisor: the worker serves g1

    async def attach(self, route: dict[str, Any]) -> _client._Connection:
        """A client's direct route (the worker's end freezes with ``process``)."""
        ours, theirs = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self.core.serve_connection, _ProcessStream(theirs, self.process))
        ms = ClientStream(TrioByteStream(ours))
        assert isinstance(await ms.receive(), WorkerHello)
        await ms.send(Attach(grant=make_grant(TOKEN, "s1", "g1", time.time() + 3600)))
        assert isinstance(await ms.receive(), AuthOk)
        return _client._Connection(ms, None, route=route)

    def pings(self) -> list[float]:
        return [t for t, op in self.process.received if op == "ping"]


async def _client_on(
    worker: Worker, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> _client.Client:
    """A Trio client whose supervisor grants a route to ``worker`` and whose direct routes
    attach to it."""
    await trio.lowlevel.checkpoint()
    c = _client.Client(nursery, Layout(home="/h", socket="/s/d.sock", registry="/r"),
                       DEFAULT_TIMING, autostart=False)
    routes: list[float] = []

    async def request_supervisor(rid: int, op: str, args: dict[str, Any], on_event: Any) -> Any:
        await trio.lowlevel.checkpoint()
        assert op == "route"
        routes.append(trio.current_time())
        return {"session": "s1", "agent": "echo", "worker_socket": "/w.sock",
                "worker_pid": 4242, "grant": "g", "expires": time.time() + 3600}

    async def attach(route: dict[str, Any], timing: Any) -> _client._Connection:
        return await worker.attach(route)

    c._request_supervisor = request_supervisor  # type: ignore[method-assign]
    c.routes_asked = routes  # type: ignore[attr-defined]
    monkeypatch.setattr(_client, "_attach", attach)
    return c


async def test_trio_client_a_silent_long_turn_is_pinged_and_answered(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = Worker(nursery)
    await w.start()
    client = await _client_on(w, nursery, monkeypatch)
    result = await client._prompt_direct(7, {"session": "s1", "text": "think"}, None)
    assert trio.current_time() == 60.0
    assert result["reply"] == "done: think"
    # the client pinged after every 2 s of silence; each ping was answered at once
    assert [t for t in w.pings() if t < 60.0] == [2.0 * k for k in range(1, 30)]
    assert client.reroutes == 0


async def test_trio_client_fails_a_prompt_on_a_stopped_worker_with_worker_unresponsive(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = Worker(nursery)
    await w.start()
    client = await _client_on(w, nursery, monkeypatch)

    async def stop_at_9() -> None:
        await trio.sleep_until(9.0)
        w.process.freeze()

    nursery.start_soon(stop_at_9)
    with pytest.raises(AgentdError) as info:
        await client._prompt_direct(7, {"session": "s1", "text": "think"}, None)
    # pings at 2, 4, 6, 8 answered; the ping of t=10 is not: failed at 10 + 3
    assert trio.current_time() == 13.0
    assert w.pings() == [2.0, 4.0, 6.0, 8.0]
    assert info.value.code == ErrorCode.WORKER_UNRESPONSIVE
    assert info.value.details == {"session": "s1", "pid": 4242}
    assert client.reroutes == 0
    assert "s1" not in client._routes  # the next prompt asks the supervisor again
    assert "s1" not in client._direct

    # SIGCONT: the turn went on in the worker (its journal holds the command); the same id,
    # resent on a new route, gets its result without running it again
    w.process.thaw()
    result = await client._prompt_direct(7, {"session": "s1", "text": "think"}, None)
    assert trio.current_time() == 60.0
    assert result["reply"] == "done: think"
    assert w.agent.prompts == ["think"]
    assert client.routes_asked == [0.0, 13.0]  # type: ignore[attr-defined]


async def test_trio_client_a_slow_consumer_is_not_the_workers_silence(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller takes 10 s over each of 80 chunks: the client's reader stops reading once
    its buffer is full (backpressure). That time is the caller's, never counted as silence
    of the worker, although nothing new arrives for 10 s at a time; the worker is pinged only
    once everything it sent has been read and the reader waits on it again."""
    w = Worker(nursery)
    await w.start()
    w.core.agent = _ChattyAgent()
    client = await _client_on(w, nursery, monkeypatch)
    arrivals: list[float] = []
    original = client._exchange_on

    async def slow(event: dict[str, Any]) -> None:
        await trio.sleep(10.0)

    async def exchange_on(conn: _client._Connection, *args: Any) -> Any:
        original_arrived = conn.silence.arrived

        def arrived() -> None:
            arrivals.append(trio.current_time())
            original_arrived()

        conn.silence.arrived = arrived  # type: ignore[method-assign]
        return await original(conn, *args)

    client._exchange_on = exchange_on  # type: ignore[method-assign,assignment]
    result = await client._prompt_direct(7, {"session": "s1", "text": "x"}, slow)
    assert result["bytes"] == 80
    assert trio.current_time() == 800.0
    pings = w.pings()
    data = [t for t in arrivals if t < pings[0]]  # the chunks and the response
    # at once: what the request's buffer holds, plus one with the caller and one with the
    # reader; then they trickled in as the caller made room: nothing new for 10 s at a time,
    # no ping (80 chunks and the response: 81 arrivals)
    at_once = _client._EVENTS_BUFFERED + 2
    assert data == [0.0] * at_once + [10.0 * k for k in range(1, 81 - at_once + 1)]
    # the last one waited 10 s more for room; from then on the reader waits on the worker,
    # which is pinged every 2 s of silence (and answers) until the caller is done
    first = 10.0 * (81 - at_once) + 10.0 + 2.0
    assert pings == [first + 2.0 * k for k in range(int((798.0 - first) / 2) + 1)]
    assert pings[-1] == 798.0


class _ChattyAgent:
    replayable = True

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        for _ in range(80):
            yield "a"



class _QuickAgent:
    replayable = True

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        yield f"ok: {prompt}"


async def test_trio_client_back_to_back_prompts_share_one_watcher_and_copy_no_environment(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts that follow each other on a route start one liveness watcher between them (not
    one task each), which ends once the route is idle; the environment is copied for the
    route request only."""
    w = Worker(nursery)
    await w.start()
    w.core.agent = _QuickAgent()
    client = await _client_on(w, nursery, monkeypatch)
    watchers: list[float] = []
    original_watch = _client._Connection._watch

    async def counted_watch(self: _client._Connection, *args: Any) -> None:
        watchers.append(trio.current_time())
        await original_watch(self, *args)

    copies: list[dict[str, Any]] = []
    original_creator = _syncclient.creator_args

    def counted_creator(args: dict[str, Any]) -> dict[str, Any]:
        copies.append(args)
        return original_creator(args)

    monkeypatch.setattr(_client._Connection, "_watch", counted_watch)
    monkeypatch.setattr(_client, "creator_args", counted_creator)
    for i in range(10):
        result = await client.request("prompt", {"session": "s1", "text": f"p{i}"})
        assert result["reply"] == f"ok: p{i}"
    assert watchers == [0.0]
    assert len(copies) == 1  # the route request's
    conn = client._direct["s1"]
    # idle: the watcher ends when it next wakes, without pinging the idle worker
    await trio.sleep(DEFAULT_TIMING.link_ping_interval)
    await trio.testing.wait_all_tasks_blocked()
    assert conn._watch_scope is None
    assert w.pings() == []
    # the next prompt starts a watcher again, which pings a silent turn as before
    w.core.agent = w.agent
    start = trio.current_time()
    result = await client.request("prompt", {"session": "s1", "text": "think"})
    assert result["reply"] == "done: think"
    assert watchers == [0.0, start]
    # (a route silent for longer than the interval is pinged as the prompt starts)
    assert [t - start for t in w.pings()][:3] == [0.0, 2.0, 4.0]

# --- the blocking client (CLI) ---------------------------------------------------------------


class _Fast:
    link_ping_interval = 0.05
    link_ping_timeout = 0.2


def _liveness() -> Any:
    ping = {"type": "request", "id": "ping-1", "client_id": "c", "op": "ping", "args": {}}
    return _syncconn._Liveness(_Fast(), ping, "s1", 4242)  # type: ignore[arg-type]


def _frames(sock: socket.socket) -> list[dict[str, Any]]:
    sock.setblocking(False)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except BlockingIOError:
        pass
    return [json.loads(line) for line in data.splitlines()]


def test_sync_client_fails_on_a_worker_that_answers_no_ping() -> None:
    ours, theirs = socket.socketpair()
    try:
        conn = _syncconn._Conn(ours)
        started = time.monotonic()
        with pytest.raises(AgentdError) as info:
            _syncconn._await_response(conn, 1, None, _liveness())
        elapsed = time.monotonic() - started
        assert info.value.code == ErrorCode.WORKER_UNRESPONSIVE
        assert info.value.details == {"session": "s1", "pid": 4242}
        assert 0.25 <= elapsed < 5.0  # interval + timeout, then at once
        assert [f["op"] for f in _frames(theirs)] == ["ping"]
    finally:
        ours.close()
        theirs.close()


def test_sync_client_a_silent_turn_whose_worker_answers_pings_is_not_failed() -> None:
    ours, theirs = socket.socketpair()
    pings: list[str] = []

    def worker() -> None:
        """Answers three pings, then the prompt."""
        f = theirs.makefile("rb")
        while len(pings) < 3:
            frame = json.loads(f.readline())
            pings.append(frame["op"])
            theirs.sendall(json.dumps({"type": "response", "id": frame["id"], "ok": True,
                                       "result": {"busy": True}}).encode() + b"\n")
        theirs.sendall(json.dumps({"type": "response", "id": 1, "ok": True,
                                   "result": {"reply": "done"}}).encode() + b"\n")

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    try:
        result = _syncconn._await_response(_syncconn._Conn(ours), 1, None, _liveness())
        assert result == {"reply": "done"}
        assert pings == ["ping"] * 3
    finally:
        t.join(timeout=10)
        ours.close()
        theirs.close()
