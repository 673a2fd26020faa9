"""The async client on asyncio and on Trio: its direct route to a fake worker over a real
socketpair, each test once per backend (``anyio_backend``).

The fake worker is anyio code too, so the whole conversation runs on the backend under test:
raw binary chunk frames, backpressure (the client stops reading while its caller does not keep
up, so the worker's sends block), pings of a silent peer and the failure of a dead one,
cancellation, and the error types. The exact schedules are pinned on MockClock in
``test_hung_worker_client.py`` and ``test_reroute_schedule.py`` (Trio); here the timing is
real and short.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import pytest

from trio_agentd import _client
from trio_agentd._aio import Inbox, MessageStream, Silence, native
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._paths import Layout
from trio_agentd._protocol import (
    ErrorBody,
    Event,
    Hello,
    Request,
    Response,
    encode,
    encode_raw_event,
)
from trio_agentd.timing import DEFAULT_TIMING

from ..anyio_support import assert_on, socket_stream_pair

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

PING_INTERVAL = 0.05  # the client pings a peer silent this long...
PING_TIMEOUT = 1.0  # ...and gives up on one that answers nothing this long after a ping
TIMING = dataclasses.replace(DEFAULT_TIMING, link_ping_interval=PING_INTERVAL,
                             link_ping_timeout=PING_TIMEOUT, patience=PING_TIMEOUT)
QUIET = 600.0  # a ping interval no test here reaches
SETTLE = 10.0  # seconds a condition the test waits for may take on a loaded machine

Turn = Callable[["FakePeer", Request], Coroutine[Any, Any, None]]


class FakePeer:
    """A worker (or, with a hello, a supervisor) at the other end of the client's connection:
    answers pings at once while ``answering``, and runs ``turn`` for every other request."""

    def __init__(self, stream: anyio.abc.ByteStream, turn: Turn) -> None:
        self.ms = MessageStream(stream)
        self.turn = turn
        self.answering = True
        self.pings = 0
        self.requests: list[Request] = []
        self.sent_chunks = 0
        self.sent_enough = anyio.Event()  # set once ``enough`` chunks went out
        self.enough = 0
        self._lock = anyio.Lock()

    async def serve(self) -> None:
        async with anyio.create_task_group() as tasks:
            while (msg := await self.ms.receive()) is not None:
                assert isinstance(msg, Request)
                if msg.op == "ping":
                    self.pings += 1
                    if self.answering:
                        await self.send(Response(id=msg.id, ok=True, result={}))
                    continue
                self.requests.append(msg)
                tasks.start_soon(self.turn, self, msg)

    async def send(self, msg: Response | Event) -> None:
        async with self._lock:
            await self.ms.stream.send(encode(msg))

    async def chunk(self, rid: int, data: bytes, *, at: int, stream: str = "stdout") -> None:
        """An output chunk, its bytes raw after the frame (as a worker sends them)."""
        header = encode_raw_event(rid, {"kind": "chunk", "stream": stream, "at": at}, data)
        async with self._lock:
            await self.ms.stream.send(header + data)
        self.sent_chunks += 1
        if self.sent_chunks == self.enough:
            self.sent_enough.set()

    async def reply(self, rid: int, **result: Any) -> None:
        await self.send(Response(id=rid, ok=True, result={"session": "s1", "turn": 1, **result}))


@contextlib.asynccontextmanager
async def client_with(
    turn: Turn, timing: Any = TIMING
) -> AsyncIterator[tuple[_client.Client, FakePeer]]:
    """A client whose supervisor grants a route to a fake worker running ``turn``."""
    ours, theirs = await socket_stream_pair()
    peer = FakePeer(theirs, turn)
    async with ours, theirs, anyio.create_task_group() as tasks:
        tasks.start_soon(peer.serve)
        client = _client.Client(tasks, Layout(home="/h", socket="/s/d.sock", registry="/r"),
                                timing, autostart=False)

        async def request_supervisor(rid: int, op: str, args: dict[str, Any],
                                     on_event: Any) -> Any:
            await anyio.lowlevel.checkpoint()
            assert op == "route"
            return {"session": "s1", "agent": "echo", "worker_socket": "/w.sock",
                    "worker_pid": 4242, "grant": "g", "expires": time.time() + 3600}

        async def attached(session: str, route: dict[str, Any]) -> _client._Connection:
            await anyio.lowlevel.checkpoint()
            conn = client._direct.get(session)
            if conn is None or conn.closed:
                conn = _client._Connection(MessageStream(ours), None, route=route)
                conn.silence = CountingSilence()
                client._direct[session] = conn
                client._read_direct(conn)
            return conn

        client._request_supervisor = request_supervisor  # type: ignore[method-assign]
        client._attached = attached  # type: ignore[method-assign]
        try:
            yield client, peer
        finally:
            tasks.cancel_scope.cancel()


class CountingSilence(Silence):
    """The reader's silence, and an event once it has read ``full_at`` messages."""

    full_at = _client._EVENTS_BUFFERED + 2

    def __init__(self) -> None:
        super().__init__()
        self.full = anyio.Event()

    def arrived(self) -> None:
        super().arrived()
        if self.received == self.full_at:
            self.full.set()


BINARY = [b"\xff\xfe not utf-8\n", b"\x00" * 3 + b"\n", bytes(range(256)) * 1024]  # 256 KiB


async def binary_turn(peer: FakePeer, req: Request) -> None:
    assert req.args["raw"] is True  # the client asks for raw chunks
    at = 0
    for data in BINARY:
        await peer.chunk(int(req.id or 0), data, at=at)
        at += len(data)
    await peer.chunk(int(req.id or 0), b"oops\n", at=0, stream="stderr")
    await peer.reply(int(req.id or 0), bytes=at, exit_status=3)


async def test_raw_binary_chunks_arrive_byte_for_byte(anyio_backend: str) -> None:
    assert_on(anyio_backend)
    async with client_with(binary_turn) as (client, _peer):
        assert await client.prompt_bytes("s1", "x") == b"".join(BINARY)
        pieces = [p async for p in client.stream_prompt_bytes("s1", "x")]
        assert pieces == BINARY
        turn = await client.prompt_turn("s1", "x")
        assert (turn.stdout, turn.stderr, turn.exit_status) == (b"".join(BINARY), b"oops\n", 3)
        assert await client.prompt("s1", "x") == b"".join(BINARY).decode(errors="replace")
        assert client.reroutes == 0


CHUNKS = 2000
CHUNK = b"0123456789abcdef" * 2


async def chatty_turn(peer: FakePeer, req: Request) -> None:
    for k in range(CHUNKS):
        await peer.chunk(int(req.id or 0), CHUNK, at=k * len(CHUNK))
    await peer.reply(int(req.id or 0), bytes=CHUNKS * len(CHUNK))


async def test_a_caller_that_does_not_keep_up_stops_the_reader_not_the_buffer(
    anyio_backend: str,
) -> None:
    assert_on(anyio_backend)
    # no pings here: every message the reader counts is one of the turn's
    quiet = dataclasses.replace(TIMING, link_ping_interval=QUIET)
    async with client_with(chatty_turn, quiet) as (client, peer):
        hold = anyio.Event()
        got: list[bytes] = []

        async def slow_sink(event: dict[str, Any]) -> None:
            got.append(event["data"])
            await hold.wait()

        result: list[Any] = []

        async def prompt() -> None:
            result.append(await client.request("prompt", {"session": "s1", "text": "x"},
                                               on_event=slow_sink))

        bound = _client._EVENTS_BUFFERED + 2  # the request's buffer, the caller, the reader
        peer.enough = 4 * bound
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(prompt)
            # the worker gets well ahead (the socket's buffers take its frames)...
            with anyio.fail_after(SETTLE):
                await peer.sent_enough.wait()
                conn = client._direct["s1"]
                assert isinstance(conn.silence, CountingSilence)
                if conn.leads:
                    await anyio.wait_all_tasks_blocked()
                else:
                    await conn.silence.full.wait()
            # ...but the client read only what its bounded buffer holds: the reader waits for
            # the caller, the worker's sends block once the socket is full. A connection the
            # request reads itself (on Trio) reads nothing while its caller is busy: only the
            # message the caller holds was read
            assert len(got) == 1
            assert conn.silence.received == (1 if conn.leads else bound)
            assert conn.leads == (anyio_backend == "trio")
            assert peer.sent_chunks < CHUNKS
            hold.set()
        assert got == [CHUNK] * CHUNKS
        assert result == [{"session": "s1", "turn": 1, "bytes": CHUNKS * len(CHUNK)}]


async def silent_turn(peer: FakePeer, req: Request) -> None:
    await anyio.sleep(6 * PING_INTERVAL)  # a turn that says nothing for a while
    await peer.reply(int(req.id or 0), reply="done\n")


async def test_a_silent_worker_is_pinged_and_its_turn_goes_on(anyio_backend: str) -> None:
    assert_on(anyio_backend)
    async with client_with(silent_turn) as (client, peer):
        assert await client.prompt("s1", "think") == "done\n"
        assert peer.pings >= 2  # the client pinged the silent worker; it answered


async def test_a_worker_that_answers_nothing_fails_the_prompt_worker_unresponsive(
    anyio_backend: str,
) -> None:
    assert_on(anyio_backend)

    async def stopped_turn(peer: FakePeer, req: Request) -> None:
        await anyio.sleep_forever()

    async with client_with(stopped_turn) as (client, peer):
        peer.answering = False  # SIGSTOPped: not even a ping is answered
        start = anyio.current_time()
        with pytest.raises(AgentdError) as info:
            await client.prompt("s1", "think")
        took = anyio.current_time() - start
        assert info.value.code == ErrorCode.WORKER_UNRESPONSIVE
        assert info.value.details == {"session": "s1", "pid": 4242}
        assert "answers nothing" in info.value.message
        assert PING_INTERVAL + PING_TIMEOUT <= took < SETTLE
        assert peer.pings >= 1
        assert "s1" not in client._direct  # the next prompt asks the supervisor again


async def test_a_supervisor_that_answers_nothing_fails_the_request_after_patience(
    anyio_backend: str,
) -> None:
    assert_on(anyio_backend)
    ours, theirs = await socket_stream_pair()
    stalled: list[Request] = []

    async def never_answers(peer: FakePeer, req: Request) -> None:
        await anyio.lowlevel.checkpoint()
        stalled.append(req)

    peer = FakePeer(theirs, never_answers)
    peer.answering = False  # SIGSTOPped after its hello
    hello = Hello(protocol=1, app_version="x", generation="g", pid=1, start_id=None, socket="/s")
    conn = _client._Connection(MessageStream(ours), hello)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(peer.serve)
        client = _client.Client(tasks, Layout(home="/h", socket="/s/d.sock", registry="/r"),
                                TIMING, autostart=False)
        client._conn = conn
        tasks.start_soon(conn.run_reader)
        with pytest.raises(AgentdError) as info:
            await client.status()
        assert info.value.code == ErrorCode.DAEMON_UNAVAILABLE
        assert info.value.details == {"wedged": True}
        assert "doctor --fix" in info.value.message
        assert [r.op for r in stalled] == ["status"]
        assert peer.pings >= 1
        tasks.cancel_scope.cancel()
    await theirs.aclose()


async def test_a_cancelled_prompt_stops_waiting_and_the_client_goes_on(
    anyio_backend: str,
) -> None:
    assert_on(anyio_backend)
    release = anyio.Event()

    async def held_turn(peer: FakePeer, req: Request) -> None:
        if req.args["text"] == "long":
            await peer.chunk(int(req.id or 0), b"started\n", at=0)
            await release.wait()
        await peer.reply(int(req.id or 0), reply=f"{req.args['text']}\n")

    async with client_with(held_turn) as (client, _peer):
        seen: list[str] = []
        with anyio.CancelScope() as scope:
            async for piece in client.stream_prompt("s1", "long"):
                seen.append(piece)
                scope.cancel()  # e.g. the caller's deadline
        assert scope.cancelled_caught
        assert seen == ["started\n"]
        assert await client.prompt("s1", "next") == "next\n"  # same connection, no reroute
        release.set()  # the long turn's late answer is for a request nobody waits on
        assert await client.prompt("s1", "after") == "after\n"
        assert client.reroutes == 0


async def test_an_error_response_is_an_agentd_error_with_its_code(anyio_backend: str) -> None:
    assert_on(anyio_backend)

    async def refusing_turn(peer: FakePeer, req: Request) -> None:
        await peer.send(Response(id=req.id, ok=False, error=ErrorBody(
            code="command_cancelled", message="the turn was cancelled")))

    async with client_with(refusing_turn) as (client, _peer):
        with pytest.raises(AgentdError) as info:
            await client.prompt("s1", "x")
        assert (info.value.code, info.value.message) == (
            "command_cancelled", "the turn was cancelled")
        with pytest.raises(AgentdError) as info:
            async for _ in client.stream_prompt("s1", "x"):
                pass  # pragma: no cover
        assert info.value.code == "command_cancelled"


async def test_a_stream_left_early_frees_the_connection_for_the_next_prompt(
    anyio_backend: str,
) -> None:
    """A caller that stops reading a stream for good (closes its iterator) lets go of the
    prompt: the connection it shares with the session's other prompts is not held up by the
    output nobody reads."""
    assert_on(anyio_backend)

    async def turn(peer: FakePeer, req: Request) -> None:
        if req.args["text"] == "flood":
            await chatty_turn(peer, req)
        else:
            await peer.reply(int(req.id or 0), reply="next\n")

    async with client_with(turn, dataclasses.replace(TIMING, link_ping_interval=QUIET)) as (
        client, peer
    ):
        peer.enough = 4 * (_client._EVENTS_BUFFERED + 2)
        stream = client.stream_prompt_bytes("s1", "flood")
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for piece in stream:
                assert piece == CHUNK
                with anyio.fail_after(SETTLE):
                    await peer.sent_enough.wait()  # more on the way than the client buffers
                break
        with anyio.fail_after(SETTLE):
            assert await client.prompt("s1", "next") == "next\n"


async def test_an_inbox_holds_its_bound_and_a_full_one_makes_the_reader_wait(
    anyio_backend: str,
) -> None:
    assert_on(anyio_backend)
    inbox: Inbox[int] = Inbox(2, native()[0])
    assert inbox.offer(1)
    assert inbox.offer(2)
    assert not inbox.offer(3)  # full: the reader has to wait for room
    put = anyio.Event()

    async def put_3() -> None:
        await inbox.put(3)
        put.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(put_3)
        await anyio.wait_all_tasks_blocked()
        assert not put.is_set()
        assert await inbox.get() == 1  # room: the reader goes on
        with anyio.fail_after(SETTLE):
            await put.wait()
    got: list[int | None] = []

    async def get_all() -> None:
        while (item := await inbox.get()) is not None:
            got.append(item)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(get_all)
        await anyio.wait_all_tasks_blocked()
        assert got == [2, 3]  # and it waits for more...
        assert inbox.offer(4)
        await anyio.wait_all_tasks_blocked()
        assert got == [2, 3, 4]
        inbox.end()  # ...until the reader says nothing more comes
    assert got == [2, 3, 4]


async def test_an_abandoned_inbox_frees_its_reader_and_drops_what_comes(
    anyio_backend: str,
) -> None:
    assert_on(anyio_backend)
    inbox: Inbox[int] = Inbox(1, native()[0])
    assert inbox.offer(1)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(inbox.put, 2)  # waits for room
        await anyio.wait_all_tasks_blocked()
        inbox.abandon()  # the request is gone: the reader goes on, the message dropped
    assert inbox.offer(3)  # taken and dropped: nobody reads
    assert await inbox.get() is None


async def test_a_message_stream_raises_anyios_errors_whoever_closed_it(
    anyio_backend: str,
) -> None:
    """On Trio the stream reads and writes the socket itself: its errors are still anyio's,
    which is what the client's reader and requests catch."""
    assert_on(anyio_backend)
    ours, theirs = await socket_stream_pair()
    ms = MessageStream(ours)
    failed: list[type[BaseException]] = []

    async def receive() -> None:
        try:
            await ms.receive()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            failed.append(type(exc))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(receive)
        await anyio.wait_all_tasks_blocked()
        await ms.aclose()  # closed here while its reader waits
    assert failed == [anyio.ClosedResourceError]
    with pytest.raises(anyio.ClosedResourceError):
        await ms.send(Request(id=1, op="ping"))
    await theirs.aclose()

    ours, theirs = await socket_stream_pair()
    ms = MessageStream(ours)
    await theirs.aclose()  # the peer went away: its end of stream, then a broken pipe
    assert await ms.receive() is None
    with pytest.raises(anyio.BrokenResourceError):
        await ms.send(Request(id=1, op="ping"))
    await ms.aclose()


async def test_an_idle_direct_connection_its_worker_closed_is_attached_again_at_once(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that closes an idle client's connection (nobody is reading it on Trio: the
    requests read it themselves) costs the next prompt a new attach with the route it has, not
    a failed send, a pause and a new route from the supervisor."""
    assert_on(anyio_backend)

    async def echo(peer: FakePeer, req: Request) -> None:
        await peer.reply(int(req.id or 0), reply=req.args["text"])

    peers: list[FakePeer] = []
    scopes: list[anyio.CancelScope] = []
    async with anyio.create_task_group() as tasks:

        async def serve(peer: FakePeer, scope: anyio.CancelScope) -> None:
            with scope:
                await peer.serve()

        async def attach(route: dict[str, Any], timing: Any) -> _client._Connection:
            ours, theirs = await socket_stream_pair()
            peer = FakePeer(theirs, echo)
            peers.append(peer)
            scopes.append(anyio.CancelScope())
            tasks.start_soon(serve, peer, scopes[-1])
            return _client._Connection(MessageStream(ours), None, route=route)

        monkeypatch.setattr(_client, "_attach", attach)
        client = _client.Client(tasks, Layout(home="/h", socket="/s/d.sock", registry="/r"),
                                TIMING, autostart=False)
        routes = 0

        async def request_supervisor(rid: int, op: str, args: dict[str, Any],
                                     on_event: Any) -> Any:
            nonlocal routes
            routes += 1
            await anyio.lowlevel.checkpoint()
            return {"session": "s1", "agent": "echo", "worker_socket": "/w.sock",
                    "worker_pid": 4242, "grant": "g", "expires": time.time() + 3600}

        client._request_supervisor = request_supervisor  # type: ignore[method-assign]
        with anyio.fail_after(SETTLE):
            assert (await client.request("prompt", {"session": "s1", "text": "a"}))["reply"] == "a"
            scopes[0].cancel()  # the worker drops the idle connection
            await peers[0].ms.stream.aclose()
            await anyio.wait_all_tasks_blocked()
            assert (await client.request("prompt", {"session": "s1", "text": "b"}))["reply"] == "b"
        assert (len(peers), routes, client.reroutes) == (2, 1, 0)
        assert [r.args["text"] for r in peers[1].requests] == ["b"]
        for scope in scopes:
            scope.cancel()
        for conn in client._direct.values():
            await conn.ms.aclose()
        for peer in peers:
            await peer.ms.stream.aclose()
        tasks.cancel_scope.cancel()
