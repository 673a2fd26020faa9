"""WorkerCore on MockClock: authentication, the re-fence loop, revocation, in-flight dedup.

Everything here waits only inside trio (memory streams, the in-memory registry, gated fake
agents), so ``autojump_clock`` never skips a real wait and every virtual time is exact.
The supervisor side of each connection is driven by hand with :class:`MessageStream`.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd._ownership import OwnerRecord, Phase
from trio_agentd._protocol import (
    APP_VERSION,
    Auth,
    AuthOk,
    Dropped,
    Event,
    Message,
    Notice,
    Request,
    Response,
    WorkerHello,
)
from trio_agentd._stream import MessageStream
from trio_agentd._workercore import WorkerCore
from trio_agentd._workerjournal import Journal
from trio_agentd.agents import TurnContext
from trio_agentd.testing import MemoryRegistry, make_worker_core, memory_stream_pair

SOCKET = "/run/s.sock"
TOKEN = "worker-token"
STALE = "supervisor_generation_stale"
HELLO = WorkerHello(session="s1", pid=4242, start_id="boot:4242", app_version=APP_VERSION)

# a broken re-fence loop ticks forever in virtual time: bound each test in real time
pytestmark = [pytest.mark.timeout(10), pytest.mark.usefixtures("no_worker_errors")]


# --- helpers ---------------------------------------------------------------------------------


class GatedAgent:
    """A fake agent that records every prompt it runs; a gated prompt waits for its event."""

    replayable = True

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.gates: dict[str, trio.Event] = {}
        self.started: dict[str, trio.Event] = {}

    def gate(self, prompt: str) -> trio.Event:
        """Hold the turn for ``prompt`` until the returned event is set."""
        self.gates[prompt] = trio.Event()
        self.started[prompt] = trio.Event()
        return self.gates[prompt]

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        self.prompts.append(prompt)
        if prompt in self.gates:
            self.started[prompt].set()
            await self.gates[prompt].wait()
        yield f"reply {ctx.turn}: {prompt}"


class SupervisorEnd:
    """The supervisor's side of one worker connection; every message is logged with its time."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.ms = MessageStream(stream)
        self.log: list[tuple[float, Message | None]] = []  # None marks end of stream
        self.notices: list[tuple[float, Notice]] = []
        self.closed = trio.Event()

    async def receive(self) -> Message | None:
        """The next message, apart from turn notices (kept in ``notices``)."""
        msg = await self.ms.receive()
        while isinstance(msg, Notice):
            self.notices.append((trio.current_time(), msg))
            msg = await self.ms.receive()
        self.log.append((trio.current_time(), msg))
        if msg is None:
            self.closed.set()
        return msg

    async def wait_closed(self) -> None:
        """Wait (at most one virtual second) until the worker closed the connection."""
        with trio.fail_after(1.0):
            await self.closed.wait()

    async def pump(self) -> None:
        """Log everything until the worker closes the connection."""
        while await self.receive() is not None:
            pass

    async def authenticate(
        self,
        *,
        generation: str,
        pid: int,
        start_id: str | None,
        token: str = TOKEN,
        socket: str = SOCKET,
    ) -> Message | None:
        """Read the worker hello, send the claim, return the worker's answer."""
        assert await self.receive() == HELLO
        await self.ms.send(
            Auth(token=token, generation=generation, pid=pid, start_id=start_id, socket=socket)
        )
        return await self.receive()

    async def prompt(
        self, request_id: int, text: str, *, command_id: str, client_id: str = "client-1"
    ) -> None:
        await self.ms.send(
            Request(
                id=request_id,
                op="prompt",
                client_id=client_id,
                args={"text": text, "command_id": command_id},
            )
        )

    def messages(self) -> list[Message | None]:
        return [msg for _at, msg in self.log]


def connect(nursery: trio.Nursery, core: WorkerCore) -> SupervisorEnd:
    """Open an in-memory connection and let the worker serve its end."""
    supervisor_side, worker_side = memory_stream_pair()
    nursery.start_soon(core.serve_connection, worker_side)
    return SupervisorEnd(supervisor_side)


async def connect_owner(
    nursery: trio.Nursery, core: WorkerCore, rec: OwnerRecord
) -> SupervisorEnd:
    """Connect as the supervisor that owns ``rec`` and check that the worker accepts it."""
    sup = connect(nursery, core)
    answer = await sup.authenticate(generation=rec.generation, pid=rec.pid, start_id=rec.start_id)
    assert answer == AuthOk(session="s1", pid=4242)
    return sup


async def advance_to(clock: trio.testing.MockClock, when: float) -> None:
    """Jump the virtual clock to ``when`` (before the next deadline) and let everything settle."""
    clock.jump(when - trio.current_time())
    await trio.testing.wait_all_tasks_blocked()
    assert trio.current_time() == when


def dropped(message: str) -> Dropped:
    return Dropped(code=STALE, message=message)


def reply(request_id: int, turn: int, text: str) -> Response:
    return Response(
        id=request_id, ok=True,
        result={"session": "s1", "turn": turn, "reply": text, "bytes": len(text.encode())},
    )


def chunk(request_id: int, text: str, at: int = 0) -> Event:
    """A chunk event as it arrives: its bytes base64-encoded, with their offset."""
    data = base64.b64encode(text.encode()).decode()
    return Event(id=request_id, event={"kind": "chunk", "at": at, "data": data})


# --- (1) the re-fence loop -------------------------------------------------------------------


def _lose_claim(registry: MemoryRegistry, rec: OwnerRecord, how: str) -> str:
    """Make ``rec``'s supervisor lose its claim; return the reason the worker will give."""
    match how:
        case "other-pid":
            registry.replace(rec, pid=rec.pid + 1)
            return "record-replaced"
        case "other-generation":
            registry.replace(rec, generation=rec.generation + "-successor")
            return "record-replaced"
        case "other-start-id":
            registry.replace(rec, start_id="boot:reused")
            return "record-replaced"
        case "deleted":
            registry.delete(rec.generation)
            return "record-missing"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["other-pid", "other-generation", "other-start-id", "deleted"])
async def test_refence_drops_a_stale_supervisor_at_the_next_tick(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, how: str
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    core = make_worker_core(registry)
    await nursery.start(core.serve)
    assert trio.current_time() == 0.0

    sup1 = await connect_owner(nursery, core, rec1)
    assert trio.current_time() == 0.0
    nursery.start_soon(sup1.pump)

    await advance_to(autojump_clock, 0.10)
    reason = _lose_claim(registry, rec1, how)

    # nothing happens between ticks: the claim is only re-checked every refence_interval
    await advance_to(autojump_clock, 0.24)
    assert sup1.log[2:] == []
    assert len(core.conns) == 1
    assert core.current is core.conns[0]

    await sup1.wait_closed()
    assert sup1.log[2:] == [
        (0.25, dropped(f"supervisor lost its claim: {reason}")),
        (0.25, None),
    ]
    assert core.conns == []
    assert core.current is None

    # the next tick is at 0.50: a newer supervisor's record deleted at 0.30 is noticed there
    rec2 = registry.add_owner(generation="g2", pid=200, start_id="boot:200")
    sup2 = await connect_owner(nursery, core, rec2)
    assert trio.current_time() == 0.25
    nursery.start_soon(sup2.pump)
    await advance_to(autojump_clock, 0.30)
    registry.delete("g2")
    await advance_to(autojump_clock, 0.49)
    assert sup2.log[2:] == []
    await sup2.wait_closed()
    assert sup2.log[2:] == [
        (0.50, dropped("supervisor lost its claim: record-missing")),
        (0.50, None),
    ]

    # the session survived both: the next valid supervisor is served
    rec3 = registry.add_owner(generation="g3", pid=300, start_id="boot:300")
    sup3 = await connect_owner(nursery, core, rec3)
    await sup3.prompt(7, "still here", command_id="c1")
    assert await sup3.receive() == chunk(7, "[echo turn 1] still here\n")
    assert await sup3.receive() == reply(7, 1, "[echo turn 1] still here\n")
    assert trio.current_time() == 0.50
    assert core.turns_run == 1


@pytest.mark.parametrize("op", ["prompt", "status", "ping"])
async def test_refence_before_every_command_drops_without_waiting_for_the_tick(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, op: str
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    agent = GatedAgent()
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)
    sup1 = await connect_owner(nursery, core, rec1)

    await advance_to(autojump_clock, 0.10)
    registry.replace(rec1, pid=999)
    await sup1.ms.send(
        Request(id=1, op=op, client_id="client-1", args={"text": "no", "command_id": "c1"})
    )
    await sup1.pump()
    assert sup1.log[2:] == [
        (0.10, dropped("supervisor claim no longer valid")),
        (0.10, None),
    ]
    assert agent.prompts == []
    assert core.turns_run == 0


async def test_refence_drops_a_supervisor_whose_process_is_gone(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    core = make_worker_core(registry)
    await nursery.start(core.serve)
    sup1 = await connect_owner(nursery, core, rec1)
    nursery.start_soon(sup1.pump)

    # the supervisor process died and its pid was reused: a new record byte-for-byte (phase
    # change) forces the start-id re-read, which no longer matches
    await advance_to(autojump_clock, 0.10)
    registry.start_ids[100] = "boot:reused"
    registry.replace(rec1, phase=Phase.STOPPING)
    await sup1.wait_closed()
    assert sup1.log[2:] == [
        (0.25, dropped("supervisor lost its claim: supervisor-gone")),
        (0.25, None),
    ]


# --- (2) revocation by a newer supervisor ----------------------------------------------------


async def test_newer_supervisor_revokes_the_older_connection_and_its_pending_prompt(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    rec2 = registry.add_owner(generation="g2", pid=200, start_id="boot:200")
    agent = GatedAgent()
    release_p1 = agent.gate("p1")
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)

    old = await connect_owner(nursery, core, rec1)
    nursery.start_soon(old.pump)
    await old.prompt(1, "p1", command_id="c1")
    await agent.started["p1"].wait()
    await old.prompt(2, "p2", command_id="c2")
    await trio.testing.wait_all_tasks_blocked()
    # p1 holds the turn, p2 waits for it
    assert agent.prompts == ["p1"]
    assert core.status() == {"session": "s1", "pid": 4242, "turns": 0, "busy": True}

    await advance_to(autojump_clock, 0.10)
    new = await connect_owner(nursery, core, rec2)
    await old.wait_closed()
    assert old.log[2:] == [
        (0.10, dropped("superseded by a newer supervisor")),
        (0.10, None),
    ]
    assert len(core.conns) == 1
    assert core.current is core.conns[0]

    # p1 was accepted: it finishes in the worker even though its connection is gone
    release_p1.set()
    await new.prompt(1, "p3", command_id="c3")
    assert await new.receive() == chunk(1, "reply 2: p3")
    assert await new.receive() == reply(1, 2, "reply 2: p3")
    assert trio.current_time() == 0.10
    # ... and p2, pending when its supervisor was revoked, never ran
    assert agent.prompts == ["p1", "p3"]
    assert core.turns_run == 2
    assert old.log[2:] == [
        (0.10, dropped("superseded by a newer supervisor")),
        (0.10, None),
    ]


async def test_an_old_supervisor_that_stopped_reading_cannot_wedge_the_session(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    rec2 = registry.add_owner(generation="g2", pid=200, start_id="boot:200")
    agent = GatedAgent()
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)

    # a lockstep stream has no buffer: a send waits until the peer reads it
    old_side, worker_side = trio.testing.lockstep_stream_pair()
    nursery.start_soon(core.serve_connection, worker_side)
    old = SupervisorEnd(old_side)
    answer = await old.authenticate(generation="g1", pid=100, start_id="boot:100")
    assert answer == AuthOk(session="s1", pid=4242)
    await old.prompt(1, "p1", command_id="c1")
    await trio.testing.wait_all_tasks_blocked()
    # ... and the old supervisor never reads again: p1's first chunk is stuck in send_all
    assert agent.prompts == ["p1"]
    assert core.turns_run == 0

    await advance_to(autojump_clock, 0.10)
    new = await connect_owner(nursery, core, rec2)
    # the Dropped to the old connection is given up after its 0.2 s bound (time computed as
    # trio computes the deadline: 0.10 + 0.2)
    assert trio.current_time() == 0.10 + 0.2
    await new.prompt(1, "p2", command_id="c2")
    assert await new.receive() == chunk(1, "reply 2: p2")
    assert await new.receive() == reply(1, 2, "reply 2: p2")
    assert agent.prompts == ["p1", "p2"]
    assert core.turns_run == 2
    assert old.log[2:] == []
    assert rec1.generation not in {c.fence.claim.generation for c in core.conns}


async def test_prompt_queued_while_its_supervisor_loses_the_claim_never_runs(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    agent = GatedAgent()
    release_p1 = agent.gate("p1")
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)
    sup = await connect_owner(nursery, core, rec1)
    nursery.start_soon(sup.pump)

    await sup.prompt(1, "p1", command_id="c1")
    await agent.started["p1"].wait()
    await sup.prompt(2, "p2", command_id="c2")
    await trio.testing.wait_all_tasks_blocked()
    await advance_to(autojump_clock, 0.10)
    registry.replace(rec1, pid=999)
    # the turn frees before the next re-fence tick: p2 must be re-validated as it starts
    release_p1.set()
    await sup.wait_closed()

    assert agent.prompts == ["p1"]
    assert core.turns_run == 1
    head = [(0.10, chunk(1, "reply 1: p1"))]
    tail = [(0.10, dropped("supervisor claim no longer valid")), (0.10, None)]
    # p1's response and p2's drop are ready in the same scheduler batch, whose order trio
    # randomises: p1's response is sent only if it goes first
    assert sup.log[2:] in (head + tail, [*head, (0.10, reply(1, 1, "reply 1: p1")), *tail])


# --- (3) steady-state cost -------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 3])
async def test_steady_state_refence_costs_one_record_read_per_tick(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, workers: int
) -> None:
    registry = MemoryRegistry()
    rec = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    cores = [make_worker_core(registry, session_id="s1") for _ in range(workers)]
    for core in cores:
        await nursery.start(core.serve)
        await connect_owner(nursery, core, rec)
    # the first successful check (at authentication) read the record and the start id once
    assert (registry.record_reads, registry.start_id_reads) == (workers, workers)

    for tick in range(1, 9):
        await advance_to(autojump_clock, 0.25 * tick)
        assert registry.record_reads == workers + workers * tick
        assert registry.start_id_reads == workers

    # a changed record (same owner, new phase and timestamp) costs one start-id read per
    # connection at the next tick, and then the steady state resumes
    await advance_to(autojump_clock, 2.10)
    registry.replace(rec, phase=Phase.STOPPING, updated_at="2026-01-01T00:00:02Z")
    for tick in range(9, 13):
        await advance_to(autojump_clock, 0.25 * tick)
        assert registry.record_reads == workers + workers * tick
        assert registry.start_id_reads == 2 * workers
    assert all(len(core.conns) == 1 for core in cores)


# --- (4) dedup of a command in flight --------------------------------------------------------


async def responses_to(sup: SupervisorEnd, ids: set[int]) -> dict[Any, Response]:
    """Read until a response arrived for every request id in ``ids`` (events are skipped)."""
    responses: dict[Any, Response] = {}
    while set(responses) != ids:
        msg = await sup.receive()
        assert msg is not None, sup.log
        if isinstance(msg, Response):
            responses[msg.id] = msg
    return responses


def _split(messages: list[Message | None]) -> tuple[list[Event], dict[Any, Response]]:
    events = [m for m in messages if isinstance(m, Event)]
    responses = {m.id: m for m in messages if isinstance(m, Response)}
    assert len(events) + len(responses) == len(messages)
    return events, responses


async def test_retry_on_the_same_connection_while_running_shares_the_result(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    agent = GatedAgent()
    release = agent.gate("hello")
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)
    sup = await connect_owner(nursery, core, rec1)

    await sup.prompt(1, "hello", command_id="c1")
    await agent.started["hello"].wait()
    await advance_to(autojump_clock, 0.10)
    await sup.prompt(2, "hello", command_id="c1")
    await trio.testing.wait_all_tasks_blocked()
    release.set()
    received = [await sup.receive() for _ in range(3)]
    assert trio.current_time() == 0.10

    events, responses = _split(received)
    # the chunks follow the newest request for the command
    assert events == [chunk(2, "reply 1: hello")]
    assert responses == {1: reply(1, 1, "reply 1: hello"), 2: reply(2, 1, "reply 1: hello")}
    assert agent.prompts == ["hello"]
    assert core.turns_run == 1


async def test_retry_from_a_new_supervisor_while_running_shares_the_result(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    rec2 = registry.add_owner(generation="g2", pid=200, start_id="boot:200")
    agent = GatedAgent()
    release = agent.gate("hello")
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)
    old = await connect_owner(nursery, core, rec1)
    nursery.start_soon(old.pump)

    await old.prompt(1, "hello", command_id="c1")
    await agent.started["hello"].wait()
    await advance_to(autojump_clock, 0.10)
    new = await connect_owner(nursery, core, rec2)
    await new.prompt(50, "hello", command_id="c1")
    await trio.testing.wait_all_tasks_blocked()
    release.set()
    assert await new.receive() == chunk(50, "reply 1: hello")
    assert await new.receive() == reply(50, 1, "reply 1: hello")
    assert trio.current_time() == 0.10
    assert agent.prompts == ["hello"]
    assert core.turns_run == 1
    assert old.messages()[2:] == [dropped("superseded by a newer supervisor"), None]


async def test_retry_after_completion_returns_the_stored_result_without_a_journal(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    agent = GatedAgent()
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)
    sup = await connect_owner(nursery, core, rec1)

    await sup.prompt(1, "hello", command_id="c1")
    assert await sup.receive() == chunk(1, "reply 1: hello")
    assert await sup.receive() == reply(1, 1, "reply 1: hello")
    await sup.prompt(2, "hello", command_id="c1")
    # the stored result, output and all: nothing ran again
    assert await sup.receive() == chunk(2, "reply 1: hello")
    assert await sup.receive() == reply(2, 1, "reply 1: hello")
    # another client's command with the same id is a different command
    await sup.prompt(3, "hello", command_id="c1", client_id="client-2")
    assert await sup.receive() == chunk(3, "reply 2: hello")
    assert await sup.receive() == reply(3, 2, "reply 2: hello")
    assert agent.prompts == ["hello", "hello"]
    assert core.turns_run == 2
    assert trio.current_time() == 0.0


async def test_retry_while_queued_behind_another_turn_runs_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    agent = GatedAgent()
    release = agent.gate("first")
    core = make_worker_core(registry, agent=agent)
    await nursery.start(core.serve)
    sup = await connect_owner(nursery, core, rec1)

    await sup.prompt(1, "first", command_id="c1")
    await agent.started["first"].wait()
    await sup.prompt(2, "second", command_id="c2")
    await trio.testing.wait_all_tasks_blocked()
    await sup.prompt(3, "second", command_id="c2")  # the client's retry of c2
    await trio.testing.wait_all_tasks_blocked()
    release.set()
    responses = await responses_to(sup, {1, 2, 3})
    assert responses == {
        1: reply(1, 1, "reply 1: first"),
        2: reply(2, 2, "reply 2: second"),
        3: reply(3, 2, "reply 2: second"),
    }
    assert agent.prompts == ["first", "second"]
    assert core.turns_run == 2


async def test_journaled_retry_while_queued_behind_another_turn_runs_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, tmp_path: Path
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    agent = GatedAgent()
    release = agent.gate("first")
    core = make_worker_core(registry, agent=agent)
    journal = core.journal = Journal(tmp_path / "s1.jsonl")
    try:
        await nursery.start(core.serve)
        sup = await connect_owner(nursery, core, rec1)

        await sup.prompt(1, "first", command_id="c1")
        await agent.started["first"].wait()
        await sup.prompt(2, "second", command_id="c2")
        await trio.testing.wait_all_tasks_blocked()
        await sup.prompt(3, "second", command_id="c2")
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        responses = await responses_to(sup, {1, 2, 3})

        assert responses == {
            1: reply(1, 1, "reply 1: first"),
            2: reply(2, 2, "reply 2: second"),
            3: reply(3, 2, "reply 2: second"),
        }
        assert agent.prompts == ["first", "second"]
        assert core.turns_run == 2
    finally:
        journal.close()


# --- (5) authentication refusals -------------------------------------------------------------


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        pytest.param(
            {"token": "not-the-token"}, "bad worker token", id="bad-token"
        ),
        pytest.param(
            {"socket": "/run/other.sock"},
            "supervisor socket /run/other.sock is not this worker's /run/s.sock",
            id="wrong-socket",
        ),
        pytest.param(
            {"generation": "g-unknown"},
            "supervisor claim rejected: record-missing",
            id="record-missing",
        ),
        pytest.param(
            {"pid": 101},
            "supervisor claim rejected: record-replaced",
            id="claim-differs-from-record",
        ),
        pytest.param(
            {"pid": 102, "generation": "g-dead", "start_id": "boot:102"},
            "supervisor claim rejected: supervisor-gone",
            id="supervisor-process-gone",
        ),
    ],
)
async def test_auth_refusal_drops_and_closes_and_the_session_goes_on(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    claim: dict[str, Any],
    message: str,
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    dead = registry.add_owner(generation="g-dead", pid=102, start_id="boot:102")
    registry.start_ids[dead.pid] = "boot:reused"
    core = make_worker_core(registry)
    await nursery.start(core.serve)

    fields: dict[str, Any] = {
        "generation": "g1", "pid": 100, "start_id": "boot:100", **claim
    }
    refused = connect(nursery, core)
    assert await refused.authenticate(**fields) == dropped(message)
    assert await refused.receive() is None
    assert refused.log == [(0.0, HELLO), (0.0, dropped(message)), (0.0, None)]
    assert core.conns == []
    assert core.current is None

    sup = await connect_owner(nursery, core, rec1)
    await sup.prompt(1, "hi", command_id="c1")
    assert await sup.receive() == chunk(1, "[echo turn 1] hi\n")
    assert await sup.receive() == reply(1, 1, "[echo turn 1] hi\n")
    assert trio.current_time() == 0.0


async def test_unauthenticated_connection_is_closed_quietly_at_auth_timeout(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = MemoryRegistry()
    rec1 = registry.add_owner(generation="g1", pid=100, start_id="boot:100")
    core = make_worker_core(registry)
    await nursery.start(core.serve)

    silent_side, worker_side = memory_stream_pair()
    silent = SupervisorEnd(silent_side)
    nursery.start_soon(silent.pump)
    await core.serve_connection(worker_side)
    await silent.wait_closed()
    assert silent.log == [(0.0, HELLO), (2.0, None)]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []

    sup = await connect_owner(nursery, core, rec1)
    await sup.prompt(1, "hi", command_id="c1")
    assert await sup.receive() == chunk(1, "[echo turn 1] hi\n")
    assert await sup.receive() == reply(1, 1, "[echo turn 1] hi\n")
    assert trio.current_time() == 2.0
