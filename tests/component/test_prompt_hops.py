"""What one prompt costs the scheduler, on MockClock: the trips through Trio's run loop a
sequential prompt makes in the worker and in the client, counted by an instrument. Each trip is
a pass of the run loop (an ``epoll_wait``); a prompt that needs none of its own must not take
one. Counts only: figures belong to the benchmarks.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import trio_agentd
from tests.component.test_direct_route import (
    ADMITTED,
    HELLO,
    SESSION,
    TTL,
    WALL0,
    ClientEnd,
    GatedAgent,
    World,
    failure,
    grant,
    reply,
)
from trio_agentd import _journal
from trio_agentd._aio import Inbox
from trio_agentd._client import _Connection
from trio_agentd._errors import AgentdError
from trio_agentd._protocol import Attach, Event, Request, Response, encode, encode_raw_event
from trio_agentd._stream import MessageStream
from trio_agentd._workerjournal import Journal
from trio_agentd.agents import EchoAgent
from trio_agentd.testing import memory_stream_pair

pytestmark = [pytest.mark.timeout(10)]


def _trio_framed(stream: trio.abc.Stream) -> Any:
    """The client's framing over an in-memory Trio stream: :class:`._stream.MessageStream` has
    the methods the client's connection calls (``receive``, ``send``, ``aclose``)."""
    return MessageStream(stream)


class Steps(trio.abc.Instrument):
    """Scheduler steps per task (by the name of its function)."""

    def __init__(self) -> None:
        self.steps: collections.Counter[str] = collections.Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name.rsplit(".", 1)[-1]] += 1


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal(tmp_path / "journal" / "s1.jsonl")
    yield j
    j.close()


async def _socket_client(w: World) -> ClientEnd:
    """A client on a direct route over a real socket pair (what a prompt's answer is written
    to), attached with a grant that holds on the real clock."""
    ours, theirs = trio.socket.socketpair()
    w.nursery.start_soon(w.core.serve_connection, trio.SocketStream(theirs))
    client = ClientEnd(trio.SocketStream(ours), "client-1")
    assert await client.ms.receive() == HELLO
    await client.ms.send(Attach(grant=grant("g1", expires_at=WALL0 + trio.current_time() + TTL)))
    assert await client.ms.receive() == ADMITTED
    return client


class _WaitingEcho(EchoAgent):
    """The echo agent without its ``immediate`` declaration: its turns get a task."""

    immediate = False


class _ImmediateGated(GatedAgent):
    """Declares its turns immediate, and (for the test) a gated one waits all the same."""

    immediate = True


async def _prompt_steps(w: World, journal: Journal) -> tuple[Steps, int]:
    """The steps of each task while one prompt to an idle session is answered, and the
    journal's flushes meanwhile."""
    await w.serving()
    client = await _socket_client(w)
    await client.send(1, "prompt", text="warm", stream=False)
    assert await client.until_response() == ([], reply(1, 1, "[echo turn 1] warm\n"))

    steps = Steps()
    flushes = journal.flushes
    trio.lowlevel.add_instrument(steps)
    try:
        await client.send(2, "prompt", text="hello", stream=False)
        events, response = await client.until_response()
        await trio.testing.wait_all_tasks_blocked()
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert (events, response) == ([], reply(2, 2, "[echo turn 2] hello\n"))
    # one fdatasync covers the turn's accepted, started and completed records
    assert [line.split(b'"kind":"')[1].split(b'"')[0]
            for line in _journal.written(journal.path.read_bytes()).splitlines()[-3:]] == [
        b"accepted", b"started", b"completed"]
    await client.ms.aclose()
    return steps, journal.flushes - flushes


@pytest.mark.usefixtures("no_worker_errors")
async def test_an_idle_sessions_prompt_takes_one_step_of_its_own_and_flushes_once(
    nursery: trio.Nursery, journal: Journal
) -> None:
    steps, flushes = await _prompt_steps(World(nursery, agent=_WaitingEcho(), journal=journal),
                                         journal)
    # the connection's reader starts the prompt itself (no task to handle it) and reads on;
    # the turn runs as one step: its first (and only) chunk takes its free lock without a
    # checkpoint, the outcome's inline flush needs no wait, and the answer fits in the socket
    assert "_handle_counted" not in steps.steps
    assert steps.steps["serve_connection"] == 1
    assert steps.steps["_execute_answered"] == 1
    assert flushes == 1


@pytest.mark.usefixtures("no_worker_errors")
async def test_an_immediate_agents_prompt_takes_no_step_of_its_own(
    nursery: trio.Nursery, journal: Journal
) -> None:
    steps, flushes = await _prompt_steps(World(nursery, journal=journal), journal)
    # the echo agent's turns never wait: the reader runs the turn and answers, in its one step
    assert EchoAgent.immediate is True
    assert "_handle_counted" not in steps.steps
    assert "_execute_answered" not in steps.steps
    assert steps.steps["serve_connection"] == 1
    assert flushes == 1


@pytest.mark.usefixtures("no_worker_errors")
async def test_a_turn_run_by_the_reader_is_still_cancelled_by_a_cancel(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    agent = _ImmediateGated()
    agent.gate("slow")
    w = World(nursery, agent=agent)
    await w.serving()
    client = await w.attached(grant("g1"), client_id="c")
    other = await w.attached(grant("g1"), client_id="d")
    await client.prompt(1, "slow")
    await agent.started["slow"].wait()
    await other.send(1, "cancel")  # the session's running turn
    assert await other.receive() == Response(id=1, ok=True, result={"cancelled": True})
    _events, response = await client.until_response()
    assert failure(response)[:2] == (1, "command_cancelled")
    await client.prompt(2, "next")  # the session serves on (a cancelled turn does not count)
    assert (await client.until_response())[1] == reply(2, 1, "reply 1: next")


@pytest.mark.usefixtures("no_worker_errors")
async def test_a_prompt_with_a_request_pipelined_behind_it_is_not_run_by_the_reader(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The reader runs an immediate turn itself only when nothing else waits in its buffer:
    a request pipelined behind the prompt (here a ping, read in the same receive) is answered
    while the turn runs, not after it (a turn that waits despite its declaration shows it)."""
    agent = _ImmediateGated()
    release = agent.gate("slow")
    w = World(nursery, agent=agent)
    await w.serving()
    client = await w.attached(grant("g1"), client_id="c")
    both = (encode(Request(id=1, op="prompt", client_id="c", args={"text": "slow"}))
            + encode(Request(id=2, op="ping", client_id="c", args={})))
    await client.ms.send_raw(both)  # one write: the reader reads both at once
    await agent.started["slow"].wait()
    with trio.fail_after(1):
        pong = await client.receive()
    assert isinstance(pong, Response)
    assert (pong.id, pong.ok) == (2, True)
    release.set()
    _events, response = await client.until_response()
    assert response == reply(1, 1, "reply 1: slow")


@pytest.mark.usefixtures("no_worker_errors")
async def test_a_turn_run_by_the_reader_outlives_its_dropped_connection(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    agent = _ImmediateGated()
    release = agent.gate("slow")
    w = World(nursery, agent=agent)
    old = await w.serving()
    await old.prompt(70, "slow", client_id="c", command_id=7)
    await agent.started["slow"].wait()
    # a newer supervisor authenticates: the old one's connection (whose reader runs the turn)
    # is dropped, and its cancellation must not abandon the accepted turn
    new = await w.supervisor(w.owner("g2", 200))
    await trio.testing.wait_all_tasks_blocked()
    assert agent.prompts == ["slow"]
    release.set()
    await trio.testing.wait_all_tasks_blocked()
    assert w.core.turns_run == 1
    # the resend on the new supervisor gets the turn's result; nothing ran twice
    await new.prompt(71, "slow", client_id="c", command_id=7)
    expected = {"session": SESSION, "turn": 1, "reply": "reply 1: slow", "bytes": 13}
    assert await new.response(71) == Response(id=71, ok=True, result=expected)
    assert agent.prompts == ["slow"]


class _ImmediateOnce(_ImmediateGated):
    """An immediate agent whose turns must not run twice: each runs once its acceptance is
    on disk."""

    replayable = False


@pytest.mark.usefixtures("no_worker_errors")
async def test_a_turn_run_by_the_reader_waits_for_its_acceptance_shielded_from_its_connection(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, journal: Journal,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait before a non-replayable turn (its acceptance made durable) is outside the
    turn's own scope: the connection dropped meanwhile must not abandon the accepted command
    (a resend would then wait for ever on a turn that never runs)."""
    agent = _ImmediateOnce()
    w = World(nursery, agent=agent, journal=journal)
    old = await w.serving()
    gate, waiting = trio.Event(), trio.Event()
    sync = journal.sync

    async def held(seq: int, *, inline: bool = False) -> None:
        waiting.set()
        await gate.wait()
        await sync(seq, inline=inline)

    monkeypatch.setattr(journal, "sync", held)
    await old.prompt(70, "once", client_id="c", command_id=7)
    await waiting.wait()
    assert agent.prompts == []  # not run before its acceptance is durable
    new = await w.supervisor(w.owner("g2", 200))  # the old connection is dropped
    await trio.testing.wait_all_tasks_blocked()
    gate.set()
    await trio.testing.wait_all_tasks_blocked()
    assert agent.prompts == ["once"]
    assert w.core.turns_run == 1
    await new.prompt(71, "once", client_id="c", command_id=7)
    expected = {"session": SESSION, "turn": 1, "reply": "reply 1: once", "bytes": 13}
    assert await new.response(71) == Response(id=71, ok=True, result=expected)
    assert agent.prompts == ["once"]


@pytest.mark.usefixtures("no_worker_errors")
async def test_a_turn_run_by_the_reader_enters_one_cancel_scope(
    nursery: trio.Nursery, journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own scope is its shield: no second scope around it (each costs microseconds)."""
    w = World(nursery, journal=journal)
    await w.serving()
    client = await _socket_client(w)
    await client.send(1, "prompt", text="warm", stream=False)
    assert await client.until_response() == ([], reply(1, 1, "[echo turn 1] warm\n"))
    made: list[trio.CancelScope] = []  # by the worker (not by the test's own timeouts)
    scope = trio.CancelScope
    package = os.path.dirname(trio_agentd.__file__)

    def counted(**kwargs: Any) -> trio.CancelScope:
        made_here = scope(**kwargs)
        if sys._getframe(1).f_code.co_filename.startswith(package):
            made.append(made_here)
        return made_here

    monkeypatch.setattr(trio, "CancelScope", counted)
    await client.send(2, "prompt", text="hello", stream=False)
    assert await client.until_response() == ([], reply(2, 2, "[echo turn 2] hello\n"))
    monkeypatch.undo()
    assert len(made) == 1
    assert made[0].shield
    await client.ms.aclose()


async def test_a_last_send_with_room_is_no_trip_through_the_scheduler() -> None:
    ours, theirs = trio.socket.socketpair()
    async with trio.SocketStream(ours) as a, trio.SocketStream(theirs) as b:
        sender = MessageStream(a)
        response = Response(id=1, ok=True, result={"reply": "x"})

        async def answer() -> None:
            await sender.send_last(response)

        steps = Steps()
        trio.lowlevel.add_instrument(steps)
        try:
            async with trio.open_nursery() as nursery:  # noqa: ASYNC112 (its own task: steps counted)
                nursery.start_soon(answer)
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert steps.steps["answer"] == 1  # (send: 2, the second only to end the task)
        assert await MessageStream(b).receive() == response


async def test_a_last_send_without_room_waits_for_the_reader() -> None:
    ours, theirs = trio.socket.socketpair()
    async with trio.SocketStream(ours) as a, trio.SocketStream(theirs) as b:
        sender = MessageStream(a)
        big = Response(id=1, ok=True, result={"reply": "x" * (4 << 20)})  # past any buffer
        sent = trio.Event()

        async def send() -> None:
            await sender.send_last(big)
            sent.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            assert not sent.is_set()  # backpressure: nothing dropped, nothing buffered
            assert await MessageStream(b, limit=8 << 20).receive() == big
        assert sent.is_set()


_BIG = Response(id=1, ok=True, result={"reply": "x" * (4 << 20)})  # past any socket buffer
_SMALL = Response(id=2, ok=True, result={"reply": "y"})


async def _two_senders(send: Any, receiver: Any) -> list[Any]:
    """A frame too big for the socket, and another sent while the first waits for room: what
    the receiver reads (each frame must arrive whole, the first first)."""
    big_waits = trio.Event()

    async def big() -> None:
        await send(_BIG)

    async def small() -> None:
        await big_waits.wait()
        await send(_SMALL)

    got = []
    big_sent = trio.Event()

    async def big_then_mark() -> None:
        await big()
        big_sent.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(big_then_mark)
        await trio.testing.wait_all_tasks_blocked()
        assert not big_sent.is_set()  # part of it sent, waiting for room (else: no test)
        big_waits.set()
        nursery.start_soon(small)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(2):
            got.append(await receiver.receive())
    return got


@contextlib.asynccontextmanager
async def _client_stream(tmp_path: Path) -> AsyncIterator[tuple[Any, trio.SocketStream]]:
    """The async client's frame stream on a real Unix socket (Trio's socket, sent on
    directly), and the Trio stream at its other end."""
    from trio_agentd._aio import MessageStream as ClientStream
    from trio_agentd._aio import connect_unix

    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    with listener:
        await listener.bind(str(tmp_path / "s"))
        listener.listen(1)
        stream = await connect_unix(str(tmp_path / "s"))
        accepted, _ = await listener.accept()
        async with stream, trio.SocketStream(accepted) as b:
            sender = ClientStream(stream)
            assert sender.can_tell_closed
            yield sender, b


async def _room_then_another(send: Any, b: trio.SocketStream) -> bytes:
    """A frame waiting for room holds the send lock; the reader makes room, and another frame
    is sent before that one's writer runs again (no checkpoint in between): all the reader
    gets. The second must not go first, into the middle of the first, though the socket would
    take it now."""
    got = bytearray()
    total = len(encode(_BIG)) + len(encode(_SMALL))
    go = trio.Event()

    async def drain() -> None:
        await go.wait()
        while len(got) < total:
            got.extend(await b.receive_some(1 << 20))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, _BIG)
        nursery.start_soon(drain)
        await trio.testing.wait_all_tasks_blocked()
        got.extend(os.read(b.socket.fileno(), 65536))  # room, its writer not yet woken
        go.set()
        await send(_SMALL)
    return bytes(got)


async def test_a_last_send_waits_for_a_frame_that_holds_the_lock_even_with_room() -> None:
    ours, theirs = trio.socket.socketpair()
    async with trio.SocketStream(ours) as a, trio.SocketStream(theirs) as b:
        sender = MessageStream(a)
        assert await _room_then_another(sender.send_last, b) == encode(_BIG) + encode(_SMALL)


async def test_a_clients_send_waits_for_a_frame_that_holds_the_lock_even_with_room(
    tmp_path: Path,
) -> None:
    async with _client_stream(tmp_path) as (sender, b):
        assert await _room_then_another(sender.send, b) == encode(_BIG) + encode(_SMALL)


async def test_a_last_send_never_splits_another_frame_waiting_for_room() -> None:
    ours, theirs = trio.socket.socketpair()
    async with trio.SocketStream(ours) as a, trio.SocketStream(theirs) as b:
        sender = MessageStream(a)
        assert await _two_senders(sender.send_last, MessageStream(b, limit=8 << 20)) == [
            _BIG, _SMALL]


async def test_a_clients_send_never_splits_another_frame_waiting_for_room(
    tmp_path: Path,
) -> None:
    async with _client_stream(tmp_path) as (sender, b):
        assert await _two_senders(sender.send, MessageStream(b, limit=8 << 20)) == [
            _BIG, _SMALL]


def test_synced_flushes_inline_when_nothing_else_does(journal: Journal) -> None:
    seq = journal.append(b'{"kind":"started","client_id":"c","id":1}\n')
    assert journal.synced(seq) is True  # no flusher runs: flushed here
    assert journal.flushes == 1
    assert journal.synced(seq) is True  # durable already: no second flush
    assert journal.flushes == 1


async def test_synced_leaves_a_flush_in_progress_to_the_flusher(
    nursery: trio.Nursery, journal: Journal, monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    flushing = trio.Event()
    token = trio.lowlevel.current_trio_token()
    real = os.fdatasync

    def slow(fd: int) -> None:  # the flusher's flush, in its thread, until released
        token.run_sync_soon(flushing.set)
        release.wait(5.0)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)
    nursery.start_soon(journal.run_flusher)
    await trio.testing.wait_all_tasks_blocked()
    assert journal._flusher_running
    first = journal.append(b'{"kind":"started","client_id":"c","id":1}\n')
    done = trio.Event()

    async def wait_first() -> None:
        await journal.sync(first)
        done.set()

    nursery.start_soon(wait_first)
    with trio.fail_after(5.0):
        await flushing.wait()
    assert journal._flushing
    second = journal.append(b'{"kind":"started","client_id":"c","id":2}\n')
    # a flush is under way: waiting is the flusher's business, even for an inline caller
    assert journal.synced(second, inline=True) is False
    assert journal.flushes == 0
    release.set()
    with trio.fail_after(5.0):
        await done.wait()
        await journal.sync(second)
    assert journal.synced(second, inline=True) is True


def test_synced_leaves_a_backlog_to_sync(journal: Journal) -> None:
    journal.backlog.append(b'{"kind":"started","client_id":"c","id":1}\n')
    seq = journal.append(b'{"kind":"started","client_id":"c","id":2}\n')
    assert journal.backlog == []  # (the append wrote it first)
    journal.backlog.append(b'{"kind":"started","client_id":"c","id":3}\n')
    # sync writes the backlog and waits for it too: synced leaves that to it
    assert journal.synced(seq) is False
    assert journal.backlog != []


def test_synced_raises_for_a_record_whose_flush_failed(
    journal: Journal, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seq = journal.append(b'{"kind":"started","client_id":"c","id":1}\n')

    def failing(_fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with caplog.at_level(logging.ERROR, "trio_agentd.worker"), pytest.raises(AgentdError) as info:
        journal.synced(seq)
    assert info.value.code == "storage_error"
    assert "a write or flush failed: EIO" in caplog.text


async def _reader_steps(nursery: trio.Nursery, responses: int) -> int:
    """The reader's steps to hand over ``responses`` responses that arrive in one read."""
    ours, theirs = memory_stream_pair()
    conn = _Connection(_trio_framed(ours), None)
    receivers: list[Inbox[Response | Event]] = []
    for rid in range(1, responses + 1):
        inbox: Inbox[Response | Event] = Inbox(4, trio.Event)
        conn.pending[rid] = inbox
        receivers.append(inbox)
    await theirs.send_all(b"".join(encode(Response(id=rid, ok=True, result=rid))
                                   for rid in range(1, responses + 1)))
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        nursery.start_soon(conn.run_reader)
        got = [await recv.get() for recv in receivers]
        await trio.testing.wait_all_tasks_blocked()
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert [r.result for r in got if isinstance(r, Response)] == list(range(1, responses + 1))
    await theirs.aclose()
    for recv in receivers:
        recv.abandon()
    return steps.steps["run_reader"]


async def test_the_client_reader_hands_a_burst_of_responses_over_without_a_step_each(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    # a channel with room takes its response at once: no trip through the scheduler each
    assert await _reader_steps(nursery, 4) == await _reader_steps(nursery, 1)


async def test_the_client_reader_still_waits_for_a_full_channel(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ours, theirs = memory_stream_pair()
    conn = _Connection(_trio_framed(ours), None)
    recv: Inbox[Response | Event] = Inbox(1, trio.Event)
    conn.pending[1] = recv
    await theirs.send_all(b"".join(encode(Response(id=1, ok=True, result=n)) for n in range(3)))
    nursery.start_soon(conn.run_reader)
    await trio.testing.wait_all_tasks_blocked()
    # backpressure: the reader holds the rest until the consumer reads (nothing dropped)
    assert [await recv.get() for _ in range(3)] == [
        Response(id=1, ok=True, result=n) for n in range(3)]
    await theirs.aclose()
    recv.abandon()


async def test_an_attached_session_gets_its_connection_without_the_attach_lock(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    from trio_agentd._client import Client
    from trio_agentd._paths import Layout
    from trio_agentd.timing import DEFAULT_TIMING

    client = Client(nursery, Layout(home="/h", socket="/s/d.sock", registry="/r"),
                    DEFAULT_TIMING, autostart=False)
    ours, _theirs = memory_stream_pair()
    conn = _Connection(_trio_framed(ours), None, route={"session": "s1"})
    client._direct["s1"] = conn
    async with client._attach_lock:  # another prompt is attaching a session meanwhile
        with trio.move_on_after(1.0):
            assert await client._attached("s1", {"session": "s1"}) is conn
            return
    pytest.fail("the attached session waited for the attach lock")


async def test_a_prompt_on_a_direct_route_costs_its_caller_one_step_and_no_other_task_any(
) -> None:
    """The client's side of a sequential prompt over a real socket, on Trio: the caller's frame
    goes out with no trip through the run loop, and the caller reads its answer itself (no
    reader task hands it over), so its task steps once per prompt (woken by the worker's bytes)
    and no other task steps at all."""
    from tests.component.test_client_backends import FakePeer, client_with

    async def answer(peer: FakePeer, req: Request) -> None:
        await peer.reply(int(req.id or 0), reply=req.args["text"])

    prompts = 20
    steps = Steps()
    async with client_with(answer) as (client, _peer):
        await client.request("prompt", {"session": "s1", "text": "warm"})  # routed, attached
        del client._attached  # the client's own from here: the route is attached already

        caller = trio.lowlevel.current_task().name.rsplit(".", 1)[-1]
        trio.lowlevel.add_instrument(steps)
        try:
            for i in range(prompts):
                result = await client.request("prompt", {"session": "s1", "text": f"p{i}"})
                assert result["reply"] == f"p{i}"
        finally:
            trio.lowlevel.remove_instrument(steps)
    assert steps.steps[caller] == prompts
    # the fake worker's own tasks besides (they answer in this process)
    assert set(steps.steps) == {caller, "serve", "answer"}, steps.steps


@pytest.mark.usefixtures("no_worker_errors")
async def test_a_replayable_turns_acceptance_and_start_are_one_write(
    nursery: trio.Nursery, journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_agentd import _fs, _workerjournal

    w = World(nursery, journal=journal)
    await w.serving()
    client = await _socket_client(w)
    writes: list[bytes] = []
    real = _fs.write_all

    def recording(fd: int, data: bytes) -> None:
        writes.append(bytes(data))
        real(fd, data)

    monkeypatch.setattr(_workerjournal, "write_all", recording)
    await client.send(1, "prompt", text="hello", stream=False)
    assert await client.until_response() == ([], reply(1, 1, "[echo turn 1] hello\n"))
    kinds = [[line.split(b'"kind":"')[1].split(b'"')[0] for line in data.splitlines()]
             for data in writes]
    assert kinds == [[b"accepted", b"started"], [b"completed"]]
    await client.ms.aclose()


def test_records_appended_together_are_one_write_and_each_counts(
    journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_agentd import _fs, _workerjournal

    writes: list[bytes] = []
    real = _fs.write_all

    def recording(fd: int, data: bytes) -> None:
        writes.append(bytes(data))
        real(fd, data)

    monkeypatch.setattr(_workerjournal, "write_all", recording)
    accepted = _journal.accepted("c", 1, "prompt", {"text": "x"})
    started = _journal.started("c", 1)
    assert journal.append(accepted, started) == 2  # the last one's sequence number
    assert writes == [accepted + started]
    assert ("c", "1") in journal.state.accepted
    assert ("c", "1") in journal.state.started
    assert journal.synced(2)
    assert _journal.written(journal.path.read_bytes()) == accepted + started


def test_records_appended_together_that_cannot_be_written_leave_nothing(
    journal: Journal, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from trio_agentd import _journal, _workerjournal

    def full(_fd: int, _data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_workerjournal, "write_all", full)
    accepted = _journal.accepted("c", 1, "prompt", {"text": "x"})
    started = _journal.started("c", 1)
    with caplog.at_level(logging.ERROR, "trio_agentd.worker"), pytest.raises(AgentdError):
        journal.append(accepted, started)
    assert journal.written == 0
    assert journal.state.accepted == {}
    assert journal.state.started == set()
    assert journal.backlog == []
    # an outcome's records are kept (applied, written again before the next record)
    done = _journal.completed("c", 1, {"reply": "x"})
    with caplog.at_level(logging.ERROR, "trio_agentd.worker"), pytest.raises(AgentdError):
        journal.append(started, done, keep=True)
    assert journal.backlog == [started, done]
    assert ("c", "1") in journal.state.completed
    monkeypatch.undo()
    assert journal.append(_journal.started("c", 2)) == 3
    assert journal.backlog == []
    assert _journal.written(journal.path.read_bytes()) == started + done + _journal.started("c", 2)


async def test_a_drained_socket_is_read_once_per_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a read has emptied the socket, the next waits for it to be readable and reads
    once: no read that finds nothing before each frame."""
    ours, theirs = trio.socket.socketpair()
    async with trio.SocketStream(ours) as a, trio.SocketStream(theirs) as b:
        receiver = MessageStream(b)
        await a.send_all(encode(Request(id=0, op="ping", client_id="c")))
        assert await receiver.receive() == Request(id=0, op="ping", client_id="c")
        reads: list[int] = []
        real = os.read

        def counting(fd: int, n: int) -> bytes:
            data = real(fd, n)
            reads.append(len(data))
            return data

        monkeypatch.setattr(os, "read", counting)
        for i in range(1, 4):
            frame = encode(Request(id=i, op="ping", client_id="c"))

            async def later(frame: bytes = frame) -> None:
                await trio.testing.wait_all_tasks_blocked()
                await a.send_all(frame)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(later)
                assert await receiver.receive() == Request(id=i, op="ping", client_id="c")
            assert reads == [len(frame)]  # one read, with the frame
            reads.clear()
        await a.aclose()
        assert await receiver.receive() is None  # end of stream


async def test_a_drained_socket_closed_under_its_reader_is_a_closed_resource() -> None:
    ours, theirs = trio.socket.socketpair()
    async with trio.SocketStream(ours) as a, trio.SocketStream(theirs) as b:
        receiver = MessageStream(b)
        await a.send_all(b'{"type":"request","id":1,"op":"ping"}\n')
        assert await receiver.receive_line() is not None  # the read emptied the socket
        raised: list[BaseException] = []

        async def receive() -> None:
            try:
                await receiver.receive_line()
            except trio.ClosedResourceError as exc:
                raised.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            await b.aclose()
        assert len(raised) == 1


async def test_a_drained_socket_whose_peer_resets_it_is_a_broken_resource() -> None:
    import socket as _socket
    import struct

    ours, theirs = trio.socket.socketpair(_socket.AF_UNIX)
    async with trio.SocketStream(ours) as a, trio.SocketStream(theirs) as b:
        receiver = MessageStream(b)
        await a.send_all(b'{"type":"request","id":1,"op":"ping"}\n')
        assert await receiver.receive_line() is not None
        # the peer goes away leaving data unread: a reset on the next read (Unix sockets
        # report it as ECONNRESET)
        await b.send_all(b"unread by the peer\n")
        a.socket.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, struct.pack("ii", 1, 0))
        await a.aclose()
        with pytest.raises(trio.BrokenResourceError):
            await receiver.receive_line()


def _leading(stream: trio.abc.Stream, *rids: int, size: int = 4) -> tuple[
    _Connection, list[Inbox[Response | Event]]
]:
    """A connection read by its requests (no reader task), with ``rids`` pending."""
    conn = _Connection(_trio_framed(stream), None)
    conn.leads = True
    inboxes: list[Inbox[Response | Event]] = []
    for rid in rids:
        inbox: Inbox[Response | Event] = Inbox(size, trio.Event)
        conn.pending[rid] = inbox
        inboxes.append(inbox)
    return conn, inboxes


async def test_a_request_that_got_its_answer_hands_the_reading_to_one_still_waiting(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ours, theirs = memory_stream_pair()
    conn, (first, second) = _leading(ours, 1, 2)
    got: dict[int, object] = {}

    async def wait_for(rid: int, inbox: Inbox[Response | Event]) -> None:
        msg = await conn.next_for(inbox)
        assert isinstance(msg, Response)
        got[rid] = (msg.result, trio.current_time())

    nursery.start_soon(wait_for, 1, first)
    await trio.testing.wait_all_tasks_blocked()
    assert conn.reading  # the first request reads
    nursery.start_soon(wait_for, 2, second)
    await trio.testing.wait_all_tasks_blocked()
    await theirs.send_all(encode(Response(id=1, ok=True, result="one")))
    await trio.testing.wait_all_tasks_blocked()
    assert got == {1: ("one", 0.0)}
    await trio.sleep(5)
    # the second request reads now: its answer, coming later, is not left unread
    await theirs.send_all(encode(Response(id=2, ok=True, result="two")))
    with trio.fail_after(1):
        while 2 not in got:
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(0.1)
    assert got[2] == ("two", 5.0)
    assert not conn.reading
    await theirs.aclose()


async def test_a_request_cancelled_while_reading_for_another_loses_none_of_its_messages(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The reading request holds a message for another whose inbox is full: cancelled then
    (its caller gave up), it leaves the message in that inbox, past the bound by one."""
    ours, theirs = memory_stream_pair()
    conn, (slow, reader) = _leading(ours, 1, 2, size=1)
    events = [Event(id=1, event={"kind": "chunk", "n": n}) for n in range(3)]
    await theirs.send_all(b"".join(encode(e) for e in events))
    with trio.move_on_after(1) as scope:
        await conn.next_for(reader)  # reads for request 1: one fits, the next waits for room
    assert scope.cancelled_caught
    assert not conn.reading
    assert [slow.take(), slow.take()] == events[:2]
    # the third is still on the wire, for whoever reads next
    assert await conn.next_for(slow) == events[2]
    await theirs.aclose()


async def test_a_request_cancelled_in_the_middle_of_another_ones_chunk_leaves_it_whole(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    ours, theirs = memory_stream_pair()
    conn, (other, reader) = _leading(ours, 1, 2)
    data = bytes(range(256)) * 512
    header = encode_raw_event(1, {"kind": "chunk", "stream": "stdout", "at": 0}, data)
    await theirs.send_all(header + data[:5000])
    with trio.move_on_after(1) as scope:
        await conn.next_for(reader)  # reading request 1's chunk when its caller gives up
    assert scope.cancelled_caught
    await theirs.send_all(data[5000:])
    msg = await conn.next_for(other)
    assert isinstance(msg, Event)
    assert msg.event["data"] == data
    await theirs.aclose()
