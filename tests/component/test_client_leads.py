"""A direct connection read by its own requests (the async client on Trio, no reader task):
the reading handed over on every way a request can leave, the liveness clock left right, and a
request that leaves before its answer turning the connection over to a reader task, so what
the worker still sends is read and dropped."""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import AsyncGenerator
from typing import Any, cast

import anyio
import pytest
import trio
import trio.testing

from tests.component.test_client_backends import FakePeer, client_with
from tests.run_order import fixed_order
from trio_agentd._aio import Inbox, watch
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


class _Requests:
    """Requests on one connection, each a task (:meth:`ask`): the messages each got, an event
    set once its answer (or the connection's end) came, and the scope it gives up with."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.got: dict[int, list[Response | Event]] = collections.defaultdict(list)
        self.over: dict[int, trio.Event] = collections.defaultdict(trio.Event)
        self.scopes: dict[int, trio.CancelScope] = collections.defaultdict(trio.CancelScope)

    async def ask(self, rid: int, give_up: float = math.inf) -> None:
        """Request ``rid``'s messages up to its answer or the end; it gives up ``give_up``
        seconds on, or when its scope is cancelled."""
        inbox: Inbox[Response | Event] = Inbox(8, trio.Event)
        self.conn.pending[rid] = inbox
        scope = self.scopes[rid]
        scope.deadline = trio.current_time() + give_up
        try:
            with scope:
                while (msg := await self.conn.next_for(inbox)) is not None:
                    self.got[rid].append(msg)
                    if isinstance(msg, Response):
                        break
                self.over[rid].set()
        finally:
            self.conn.pending.pop(rid, None)
            inbox.abandon()

    async def start(self, nursery: trio.Nursery, *rids: int, give_up: float = math.inf) -> None:
        """Requests ``rids``, one after the other: each is waiting before the next starts."""
        for rid in rids:
            nursery.start_soon(self.ask, rid, give_up)
            await trio.testing.wait_all_tasks_blocked()

    def answer(self, rid: int) -> object:
        """The result in request ``rid``'s answer; ``None`` if none came."""
        return next((m.result for m in self.got[rid] if isinstance(m, Response)), None)


class _Pings:
    """The liveness watcher's ping, faked: the virtual times it was sent at."""

    def __init__(self) -> None:
        self.at: list[float] = []

    async def __call__(self) -> None:
        self.at.append(trio.current_time())
        await trio.lowlevel.checkpoint()


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
    reqs = _Requests(conn)
    async with trio.open_nursery() as nursery:
        await reqs.start(nursery, 1, 2, 3, 4)
        assert conn.reading
        reqs.scopes[2].cancel()
        recv.put_data(encode(Response(id=1, ok=True, result="one")))
        reqs.scopes[3].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert reqs.answer(1) == "one"
        recv.put_data(encode(Response(id=4, ok=True, result="four")))
        with trio.fail_after(5):
            await reqs.over[4].wait()
    assert [reqs.answer(rid) for rid in (1, 2, 3, 4)] == ["one", None, None, "four"]


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
    not at t=17: overlapping prompts that each give up before the interval must not hide a
    hung worker."""
    conn = _leading_over(trio.testing.MemoryReceiveStream())
    reqs, pings = _Requests(conn), _Pings()
    async with trio.open_nursery() as nursery:
        await reqs.start(nursery, 1, give_up=7)
        await reqs.start(nursery, 2, give_up=30)
        assert conn.reading
        at = await watch(conn.silence, pings, interval=10, ping_timeout=5)
        nursery.cancel_scope.cancel()
    assert pings.at == [10]
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
    reqs, pings = _Requests(conn), _Pings()
    async with trio.open_nursery() as nursery:
        await reqs.start(nursery, 1, 2)
        await trio.sleep(3)
        reqs.scopes[1].cancel()
        reqs.scopes[2].cancel()  # in the same pass: it never reads
        await trio.testing.wait_all_tasks_blocked()
        assert not conn.reading
        assert conn.silence.waiting_since is None
        await reqs.start(nursery, 3)
        assert conn.reading
        at = await watch(conn.silence, pings, interval=10, ping_timeout=5)
        reqs.scopes[3].cancel()
    assert pings.at == [13]
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
    reqs = _Requests(conn)
    async with trio.open_nursery() as nursery:
        await reqs.start(nursery, 1, 2, 3)
        assert conn.reading
        recv.put_data(
            encode(Event(id=1, event={"type": "chunk"}))
            + encode(Response(id=2, ok=True, result="two"))
            + encode(Response(id=1, ok=True, result="one"))
        )
        await trio.testing.wait_all_tasks_blocked()
        assert [reqs.answer(1), reqs.answer(2)] == ["one", "two"]
        recv.put_data(encode(Response(id=3, ok=True, result="three")))
        with trio.move_on_after(600):
            await reqs.over[3].wait()
        state = (conn.reading, conn._successor is not None, conn.silence.waiting_since)
        nursery.cancel_scope.cancel()
    assert reqs.answer(3) == "three", (
        f"request 3 never woken: nobody reads (reading, stale successor, waiting_since)={state}"
    )


async def test_closed_while_a_deferred_reader_waits_wakes_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Request 1 reads and request 2 waits; a request that left hands the connection over
    to a reader task, started once request 1 is done reading. The route is forgotten
    meanwhile (the connection marked closed), and request 1 gets its answer: no reader task
    starts on a closed connection, so request 2 must be told the connection is over."""
    recv = trio.testing.MemoryReceiveStream()
    conn = _leading_over(recv)
    reqs = _Requests(conn)
    started: list[object] = []
    async with trio.open_nursery() as nursery:
        await reqs.start(nursery, 1, 2)
        assert conn.reading
        conn.read_for_the_gone(started.append)  # (a request 3 left before its answer)
        assert conn._start_reader is not None
        conn.closed = True  # (as Client._forget_route: another prompt was told to reroute)
        recv.put_data(encode(Response(id=1, ok=True, result="one")))
        await trio.testing.wait_all_tasks_blocked()
        assert reqs.answer(1) == "one"
        with trio.move_on_after(600):
            await reqs.over[2].wait()
        nursery.cancel_scope.cancel()
    assert started == []
    # told the connection is over (no answer: the client resends on a new route)
    assert reqs.over[2].is_set(), f"request 2 never woken (closed={conn.closed})"
    assert reqs.got[2] == []


async def test_a_carry_is_not_dropped_by_a_waiter_cancelled_in_the_same_pass(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request 1 reads from t=0, requests 2 and 3 wait; at t=7 requests 1 and 3 give up in
    the same pass, 1 unwinding first: the reading goes to 2 with t=0 (ping at 10). Request
    3, finding nobody else to hand over to, must not drop that start."""
    fixed_order(monkeypatch, reverse=True)
    conn = _leading_over(trio.testing.MemoryReceiveStream())
    reqs, pings = _Requests(conn), _Pings()

    async def give_up() -> None:
        await trio.sleep(7)
        reqs.scopes[1].cancel()  # the reader...
        reqs.scopes[3].cancel()  # ...and a waiter, in the same pass

    async with trio.open_nursery() as nursery:
        await reqs.start(nursery, 1, 2, 3)
        assert conn.reading
        nursery.start_soon(give_up)
        with trio.move_on_after(30):
            at = await watch(conn.silence, pings, interval=10, ping_timeout=5)
        nursery.cancel_scope.cancel()
    # the peer has been silent on somebody since t=0: ping at 10, unresponsive at 15
    assert pings.at == [10]
    assert at == 10


@pytest.mark.parametrize("reverse", [True, False])
async def test_the_watcher_counts_a_carried_start_handed_over_as_it_looks(
    reverse: bool, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher looks at t=10, in the pass in which request 1 (reading since t=3) gives
    up and hands the reading, and t=3, to request 2. Whichever of the two runs first in that
    pass, the ping is at t=13: a watcher that found nobody waiting is woken by the next
    reader, not asleep for a whole interval."""
    fixed_order(monkeypatch, reverse=reverse)
    conn = _leading_over(trio.testing.MemoryReceiveStream())
    reqs, pings = _Requests(conn), _Pings()
    result: list[float | None] = []
    watched = trio.Event()

    async def watcher() -> None:
        result.append(await watch(conn.silence, pings, interval=10, ping_timeout=5))
        watched.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watcher)  # t=0, nobody reads: it looks again at t=10
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(3)
        await reqs.start(nursery, 1, give_up=7)  # reads from t=3, gives up at t=10
        await reqs.start(nursery, 2, give_up=100)
        assert conn.reading
        with trio.move_on_after(40):
            await watched.wait()
        nursery.cancel_scope.cancel()
    assert pings.at == [13]
    assert result == [13]
