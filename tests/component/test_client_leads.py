"""A direct connection read by its own requests (the async client on Trio, no reader task):
the reading handed over on every way a request can leave, the liveness clock left right, and a
request that leaves before its answer turning the connection over to a reader task, so what
the worker still sends is read and dropped."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncGenerator
from typing import Any, cast

import anyio
import pytest
import trio
import trio.testing

from tests.component.test_client_backends import FakePeer, client_with
from trio_agentd._aio import Inbox, Silence, watch
from trio_agentd._client import _Connection
from trio_agentd._protocol import Event, Request, Response, encode
from trio_agentd._stream import MessageStream


def _leading_over(recv: trio.testing.MemoryReceiveStream) -> _Connection:
    # the worker side's framing over an in-memory Trio stream: it has the methods the client's
    # connection calls
    framed: Any = MessageStream(trio.StapledStream(trio.testing.MemorySendStream(), recv))
    conn = _Connection(framed, None)
    conn.leads = True
    return conn


@pytest.mark.parametrize("attempt", range(5))
async def test_a_hand_over_to_a_request_cancelled_meanwhile_goes_on_to_one_still_waiting(
    attempt: int, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests 2 and 3 give up in the same pass of the run loop as request 1, the reader, gets
    its answer: whichever runs first, request 4 is the one that reads on."""
    # Trio's own order within a batch (in order or reversed), not pytest-trio's shuffle: the
    # two cancelled requests sit either side of the reader, so one of them is still pending,
    # its wait not yet unwound, when the reader hands over
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)
    recv = trio.testing.MemoryReceiveStream()
    conn = _leading_over(recv)
    got: dict[int, object] = {}
    answered = {rid: trio.Event() for rid in (1, 2, 3, 4)}
    scopes: dict[int, trio.CancelScope] = {}

    async def request(rid: int) -> None:
        inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
        conn.pending[rid] = inbox
        try:
            with scopes.setdefault(rid, trio.CancelScope()):
                msg = await conn.next_for(inbox)
                got[rid] = msg.result if isinstance(msg, Response) else None
                answered[rid].set()
        finally:
            conn.pending.pop(rid, None)
            inbox.abandon()

    async with trio.open_nursery() as nursery:
        for rid in (1, 2, 3, 4):
            nursery.start_soon(request, rid)
            await trio.testing.wait_all_tasks_blocked()
        assert conn.reading
        scopes[2].cancel()
        recv.put_data(encode(Response(id=1, ok=True, result="one")))
        scopes[3].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert got == {1: "one"}
        recv.put_data(encode(Response(id=4, ok=True, result="four")))
        with trio.fail_after(5):
            await answered[4].wait()
    assert got == {1: "one", 4: "four"}


async def test_a_reader_cancelled_while_it_waits_on_the_peer_leaves_no_silence_counting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The liveness watcher counts silence only while somebody waits on the peer: a request
    that gave up while reading must not leave the clock running (nobody would read the pong of
    the ping it causes, and the worker would be called unresponsive)."""
    conn = _leading_over(trio.testing.MemoryReceiveStream())
    inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
    conn.pending[1] = inbox
    with trio.move_on_after(1):
        await conn.next_for(inbox)
    assert not conn.reading
    assert conn.silence.waiting_since is None


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


BIG = bytes(range(256)) * 1024  # 256 KiB
CHUNKS = 32  # 8 MiB: well past the socket's buffers


@pytest.mark.anyio
async def test_a_stream_let_go_of_is_read_and_dropped_and_the_turn_ends(
    anyio_backend: str,
) -> None:
    done = anyio.Event()

    async def turn(peer: FakePeer, req: Request) -> None:
        rid = int(req.id or 0)
        for k in range(CHUNKS):
            await peer.chunk(rid, BIG, at=k * len(BIG))
        await peer.reply(rid, bytes=CHUNKS * len(BIG))
        done.set()

    async with client_with(turn) as (client, peer):
        stream = cast(AsyncGenerator[bytes, None], client.stream_prompt_bytes("s1", "x"))
        async with contextlib.aclosing(stream):
            async for piece in stream:
                assert piece == BIG
                break  # the consumer lets go of the prompt after its first chunk
        with anyio.fail_after(10):
            await done.wait()
        assert peer.sent_chunks == CHUNKS
        conn = client._direct["s1"]
        assert not conn.leads  # a reader task reads it from now on
        # and the connection still serves the next prompt
        with anyio.fail_after(10):
            await client.request("prompt", {"session": "s1", "text": "y"})


async def test_the_watcher_of_a_connection_nobody_reads_while_idle_ends(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Nobody reads an idle connection its requests read, so its silence never starts: the
    liveness watcher must still see that no request is outstanding and end."""
    from trio_agentd._errors import AgentdError, ErrorCode
    from trio_agentd.timing import DEFAULT_TIMING

    conn = _leading_over(trio.testing.MemoryReceiveStream())
    conn.watch_from(nursery, lambda: Request(id=99, op="ping"), DEFAULT_TIMING,
                    lambda: AgentdError(ErrorCode.WORKER_UNRESPONSIVE, "x"), 1.0)
    assert conn._watch_scope is not None
    await trio.sleep(2 * DEFAULT_TIMING.link_ping_interval + 0.001)
    assert conn._watch_scope is None  # ended: no request was outstanding
    assert not conn.closed


async def test_silence_is_counted_from_the_first_reader_when_a_cancelled_one_hands_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Request 1 reads a silent peer from t=0 and gives up at t=7; request 2, waiting all along,
    reads on. The peer has been silent since t=0, so the watcher pings at t=10 (its interval),
    not at t=17: prompts that each give up before the interval must not hide a hung worker."""
    conn = _leading_over(trio.testing.MemoryReceiveStream())
    pings: list[float] = []

    async def ping() -> None:
        pings.append(trio.current_time())
        await trio.lowlevel.checkpoint()

    async def request(rid: int, give_up: float) -> None:
        inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
        conn.pending[rid] = inbox
        try:
            with trio.move_on_after(give_up):
                await conn.next_for(inbox)
        finally:
            conn.pending.pop(rid, None)
            inbox.abandon()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, 1, 7)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, 2, 30)
        await trio.testing.wait_all_tasks_blocked()
        assert conn.reading
        at = await watch(conn.silence, ping, interval=10, ping_timeout=5)
        nursery.cancel_scope.cancel()
    assert pings == [10]
    assert at == 10
    assert trio.current_time() == 15


async def test_silence_is_not_carried_past_a_moment_nobody_waited_on_the_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Request 1 reads from t=0; at t=3 it and request 2, to which it hands the reading, both
    give up, so nobody waits on the peer. Request 3 then reads from t=3: the watcher pings at
    t=13, its interval after request 3 started, not at t=10 (the peer was not silent on
    anybody between)."""
    conn = _leading_over(trio.testing.MemoryReceiveStream())
    scopes = {rid: trio.CancelScope() for rid in (1, 2, 3)}
    pings: list[float] = []

    async def ping() -> None:
        pings.append(trio.current_time())
        await trio.lowlevel.checkpoint()

    async def request(rid: int) -> None:
        inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
        conn.pending[rid] = inbox
        try:
            with scopes[rid]:
                await conn.next_for(inbox)
        finally:
            conn.pending.pop(rid, None)
            inbox.abandon()

    async with trio.open_nursery() as nursery:
        for rid in (1, 2):
            nursery.start_soon(request, rid)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(3)
        scopes[1].cancel()
        scopes[2].cancel()  # in the same pass: it never reads
        await trio.testing.wait_all_tasks_blocked()
        assert not conn.reading
        assert conn.silence.waiting_since is None
        nursery.start_soon(request, 3)
        await trio.testing.wait_all_tasks_blocked()
        assert conn.reading
        at = await watch(conn.silence, ping, interval=10, ping_timeout=5)
        scopes[3].cancel()
    assert pings == [13]
    assert at == 13



async def test_waiter_is_read_for_after_a_nudged_request_finds_its_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Request 1 reads; 2 and 3 wait. One chunk brings an event for 1, the answer of 2 and
    the answer of 1. Request 1 stops at its event and hands the reading to 2; its caller
    asks for the next message at once (a consumer that does not await), so 1 reads again
    before 2 runs: the answer of 2, then its own. Request 2 then finds its answer and leaves
    without reading: request 1, done, must hand the reading to 3."""
    recv = trio.testing.MemoryReceiveStream()
    conn = _leading_over(recv)
    got: dict[int, list[object]] = {1: [], 2: [], 3: []}
    done = {rid: trio.Event() for rid in (1, 2, 3)}

    async def request(rid: int) -> None:
        inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
        conn.pending[rid] = inbox
        try:
            while (msg := await conn.next_for(inbox)) is not None:
                got[rid].append(msg)
                if isinstance(msg, Response):
                    break
            done[rid].set()
        finally:
            conn.pending.pop(rid, None)
            inbox.abandon()

    async with trio.open_nursery() as nursery:
        for rid in (1, 2, 3):
            nursery.start_soon(request, rid)
            await trio.testing.wait_all_tasks_blocked()
        assert conn.reading
        recv.put_data(
            encode(Event(id=1, event={"type": "chunk"}))
            + encode(Response(id=2, ok=True, result="two"))
            + encode(Response(id=1, ok=True, result="one"))
        )
        await trio.testing.wait_all_tasks_blocked()
        assert done[1].is_set()
        assert done[2].is_set()
        recv.put_data(encode(Response(id=3, ok=True, result="three")))
        with trio.move_on_after(600):
            await done[3].wait()
        state = (conn.reading, conn._successor is not None, conn.silence.waiting_since)
        nursery.cancel_scope.cancel()
    assert done[3].is_set(), (
        f"request 3 never woken: nobody reads (reading, stale successor, waiting_since)={state}"
    )

class _Fixed(random.Random):
    """Trio's run-loop order within a pass, fixed: ``random() < 0.5`` reverses the batch."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


async def test_closed_while_a_deferred_reader_waits_wakes_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Request 1 reads and request 2 waits; a request that left hands the connection over
    to a reader task, started once request 1 is done reading. The route is forgotten
    meanwhile (the connection marked closed), and request 1 gets its answer: no reader task
    starts on a closed connection, so request 2 must be told the connection is over."""
    recv = trio.testing.MemoryReceiveStream()
    conn = _leading_over(recv)
    done: dict[int, object] = {}
    finished = {1: trio.Event(), 2: trio.Event()}
    started: list[object] = []

    async def request(rid: int) -> None:
        inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
        conn.pending[rid] = inbox
        try:
            msg = await conn.next_for(inbox)
            done[rid] = msg.result if isinstance(msg, Response) else msg
            finished[rid].set()
        finally:
            conn.pending.pop(rid, None)
            inbox.abandon()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, 1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert conn.reading
        # request 3 left before its answer (Client calls this): reader task deferred
        conn.read_for_the_gone(started.append)
        assert conn._start_reader is not None
        # another prompt on the session failed with a REROUTE code: Client._forget_route
        conn.closed = True
        # request 1's answer was already on its way
        recv.put_data(encode(Response(id=1, ok=True, result="one")))
        await trio.testing.wait_all_tasks_blocked()
        assert done.get(1) == "one"
        with trio.move_on_after(600):
            await finished[2].wait()
        nursery.cancel_scope.cancel()
    # request 2 must learn the connection is over (inbox ended -> None) or be read for
    assert 2 in done, f"request 2 never woken; reader started={started}, closed={conn.closed}"


async def test_a_carry_is_not_dropped_by_a_waiter_cancelled_in_the_same_pass(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request 1 reads from t=0, requests 2 and 3 wait; at t=7 requests 1 and 3 give up in
    the same pass, 1 unwinding first: the reading goes to 2 with t=0 (ping at 10). Request
    3, finding nobody else to hand over to, must not drop that start."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)
    monkeypatch.setattr(trio._core._run, "_r", _Fixed(0.0))
    conn = _leading_over(trio.testing.MemoryReceiveStream())
    scopes = {rid: trio.CancelScope() for rid in (1, 2, 3)}
    pings: list[float] = []

    async def ping() -> None:
        pings.append(trio.current_time())
        await trio.lowlevel.checkpoint()

    async def request(rid: int) -> None:
        inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
        conn.pending[rid] = inbox
        try:
            with scopes[rid]:
                await conn.next_for(inbox)
        finally:
            conn.pending.pop(rid, None)
            inbox.abandon()

    async with trio.open_nursery() as nursery:
        for rid in (1, 2, 3):
            nursery.start_soon(request, rid)
            await trio.testing.wait_all_tasks_blocked()
        assert conn.reading

        async def give_up() -> None:
            await trio.sleep(7)
            scopes[1].cancel()  # the reader...
            scopes[3].cancel()  # ...and a waiter, in the same pass

        nursery.start_soon(give_up)
        with trio.move_on_after(30):
            at = await watch(conn.silence, ping, interval=10, ping_timeout=5)
        nursery.cancel_scope.cancel()
    # the peer has been silent on somebody since t=0: ping at 10, unresponsive at 15
    assert pings == [10]
    assert at == 10


@pytest.mark.parametrize("order", [0.0, 0.9])
async def test_the_watcher_counts_a_carried_start_handed_over_as_it_looks(
    order: float, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher looks at t=10, in the pass in which request 1 (reading since t=3) gives
    up and hands the reading, and t=3, to request 2. Whichever of the two runs first in that
    pass, the ping is at t=13: a watcher that found nobody waiting is woken by the next
    reader, not asleep for a whole interval."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)
    monkeypatch.setattr(trio._core._run, "_r", _Fixed(order))
    conn = _leading_over(trio.testing.MemoryReceiveStream())
    pings: list[float] = []
    result: list[float | None] = []
    watched = trio.Event()

    async def ping() -> None:
        pings.append(trio.current_time())
        await trio.lowlevel.checkpoint()

    async def request(rid: int, give_up: float) -> None:
        inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
        conn.pending[rid] = inbox
        try:
            with trio.move_on_after(give_up):
                await conn.next_for(inbox)
        finally:
            conn.pending.pop(rid, None)
            inbox.abandon()

    async def watcher() -> None:
        result.append(await watch(conn.silence, ping, interval=10, ping_timeout=5))
        watched.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watcher)  # t=0, nobody reads: it looks again at t=10
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(3)
        nursery.start_soon(request, 1, 7)  # reads from t=3, gives up at t=10
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(request, 2, 100)
        await trio.testing.wait_all_tasks_blocked()
        assert conn.reading
        with trio.move_on_after(40):
            await watched.wait()
        nursery.cancel_scope.cancel()
    assert pings == [13]
    assert result == [13]


@pytest.mark.parametrize("attempt", range(8))
async def test_an_answer_in_the_pass_of_the_ping_deadline_answers_the_ping(
    attempt: int, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer to a ping arrives at its deadline, in the same pass as the deadline's
    cancellation. If the answer's task runs first, the wait for the answer must say it came
    (``False``), not that the peer stayed silent: a live worker is not unresponsive."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)
    # which of the two runs first in the pass: the batch's order (fixed here, each way in
    # turn) and, within it, the deadlines' (by the scopes' addresses: a coin toss per attempt)
    monkeypatch.setattr(trio._core._run, "_r", _Fixed(0.0 if attempt % 2 else 0.9))
    silence = Silence(trio.current_time)
    silence.waiting()
    results: list[bool] = []
    answered_before_the_verdict: list[bool] = []

    async def answer() -> None:
        await trio.sleep_until(5)
        answered_before_the_verdict.append(not results)
        silence.arrived()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        results.append(await silence.wait_silent(5, since=0, baseline=0))
    assert trio.current_time() == 5
    assert results == [not answered_before_the_verdict[0]]
