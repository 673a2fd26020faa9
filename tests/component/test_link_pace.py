"""The pace of the supervisor's liveness pings on one worker link, on MockClock.

The test plays the worker over an in-memory stream: it answers every ping at once (unless
frozen) and sends the notices a worker sends when a client runs a turn on a direct route. With
the default timing an idle link is pinged after 30 s of silence; a link with a call outstanding
or a turn running after 2 s of silence counted from when it became busy; a probe (a route
granted to a client) makes an idle link prove itself: pinged 2 s after the probe unless the
worker says something first.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_agentd._protocol import Notice, Request, Response, WorkerHello
from trio_agentd._stream import MessageStream
from trio_agentd._workerlink import WorkerDropped, WorkerLink
from trio_agentd.timing import DEFAULT_TIMING

pytestmark = pytest.mark.timeout(10)

T = DEFAULT_TIMING
HELLO = WorkerHello(session="s1", pid=4242, start_id="boot:4242")


class FakeWorker:
    """The worker's end: logs when each request arrived, answers pings (not while frozen)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.ms = MessageStream(stream)
        self.received: list[tuple[float, str]] = []
        self.frozen = False

    async def serve(self) -> None:
        while (msg := await self.ms.receive()) is not None:
            assert isinstance(msg, Request)
            self.received.append((trio.current_time(), msg.op))
            if msg.op == "ping" and not self.frozen:
                await self.ms.send(Response(id=msg.id, ok=True, result={}))

    def pings(self) -> list[float]:
        return [t for t, op in self.received if op == "ping"]

    async def notice(self, kind: str) -> None:
        await self.ms.send(Notice(kind=kind, turn=1))


async def _link(nursery: trio.Nursery) -> tuple[WorkerLink, FakeWorker]:
    ours, theirs = trio.testing.memory_stream_pair()
    link = WorkerLink(MessageStream(ours), HELLO)
    worker = FakeWorker(theirs)
    nursery.start_soon(worker.serve)
    nursery.start_soon(link.run_reader)
    nursery.start_soon(lambda: link.watch_liveness(
        interval=T.link_ping_interval, ping_timeout=T.link_ping_timeout,
        idle_interval=T.link_idle_ping_interval))
    await trio.testing.wait_all_tasks_blocked()
    return link, worker


async def advance_to(when: float) -> None:
    await trio.sleep_until(when)
    await trio.testing.wait_all_tasks_blocked()
    assert trio.current_time() == when


def test_the_defaults() -> None:
    assert (T.link_ping_interval, T.link_ping_timeout, T.link_idle_ping_interval) == (
        2.0, 3.0, 30.0)


async def test_an_idle_link_is_pinged_every_30_s(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    link, worker = await _link(nursery)
    await advance_to(100.0)
    assert worker.pings() == [30.0, 60.0, 90.0]
    assert not link.closed.is_set()


async def test_a_running_turn_is_pinged_every_2_s_of_silence_then_idle_again(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    _, worker = await _link(nursery)
    await advance_to(5.0)
    await worker.notice("turn_started")  # a client runs a turn on a direct route
    await advance_to(20.0)
    await worker.notice("turn_done")
    await advance_to(60.0)
    # busy from t=5: every 2 s of silence; idle again from the notice of t=20: 30 s later
    assert worker.pings() == [7.0, 9.0, 11.0, 13.0, 15.0, 17.0, 19.0, 50.0]


async def test_a_call_is_paced_from_its_start_not_from_the_last_arrival(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    link, worker = await _link(nursery)
    await advance_to(10.0)  # silent since t=0
    worker.frozen = True  # answers nothing from now on

    with pytest.raises(WorkerDropped):
        await link.call("prompt", {"text": "hi"}, client_id="c")
    # the call of t=10 gets its own 2 s: pinged at 12, unanswered at 15
    assert trio.current_time() == 15.0
    assert worker.received == [(10.0, "prompt"), (12.0, "ping")]
    assert link.unresponsive == 12.0
    assert link.closed.is_set()


async def test_a_probe_pings_an_idle_worker_that_says_nothing_2_s_after_it(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    link, worker = await _link(nursery)
    await advance_to(10.0)
    link.probe()  # a route was granted
    await advance_to(40.0)
    # pinged at 12 (answered), then the idle pace again from that answer
    assert worker.pings() == [12.0]
    await advance_to(45.0)
    assert worker.pings() == [12.0, 42.0]


async def test_a_probe_costs_nothing_when_the_worker_speaks_first(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    link, worker = await _link(nursery)
    await advance_to(10.0)
    link.probe()
    await advance_to(11.0)
    await worker.notice("turn_started")  # the routed client's prompt reached it
    await advance_to(11.5)
    await worker.notice("turn_done")
    await advance_to(45.0)
    assert worker.pings() == [41.5]  # no probe ping: only the idle pace from t=11.5


async def test_a_probe_finds_a_hung_idle_worker_within_interval_plus_timeout(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    link, worker = await _link(nursery)
    await advance_to(10.0)
    worker.frozen = True
    link.probe()
    await link.closed.wait()
    assert trio.current_time() == 15.0
    assert link.unresponsive == 12.0


async def test_the_links_end_cancels_a_wait_tied_to_it_and_forgets_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    link = WorkerLink(MessageStream(ours), HELLO)
    never = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run_reader)
        with link.cancelled_on_close() as scope:
            with trio.move_on_after(5.0):  # a wait for something else, while the link lives
                await never.wait()
            assert not scope.cancel_called
        with link.cancelled_on_close() as scope:
            nursery.start_soon(theirs.aclose)  # the worker goes
            await never.wait()
        assert scope.cancelled_caught
        assert trio.current_time() == 5.0
        assert link._on_close == set()
    with link.cancelled_on_close() as scope:  # ended before: cancelled at once
        await never.wait()
    assert scope.cancelled_caught

