"""The data plane on MockClock: clients attached to a WorkerCore by a supervisor's grant.

A fake supervisor authenticates over one in-memory stream; fake clients read the worker hello,
present an ``Attach(grant)`` and send requests as :class:`trio_agentd._client.Client` does on
a direct route (``client_id`` + its own request id, which is the journal's command id). The
worker's wall clock follows the virtual clock, so grant expiry is exact.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd._errors import AgentdError
from trio_agentd._grant import make_grant
from trio_agentd._ownership import OwnerRecord
from trio_agentd._protocol import (
    APP_VERSION,
    Attach,
    Auth,
    AuthOk,
    Dropped,
    ErrorBody,
    Event,
    Message,
    Notice,
    Request,
    Response,
    WorkerHello,
    decode,
    encode,
)
from trio_agentd._stream import MessageStream
from trio_agentd._workercore import WorkerCore
from trio_agentd._workerjournal import Journal
from trio_agentd.agents import Agent, EchoAgent, TurnContext
from trio_agentd.testing import MemoryRegistry, memory_stream_pair
from trio_agentd.timing import DEFAULT_TIMING

SESSION = "s1"
SOCKET = "/run/s.sock"
TOKEN = "worker-token"
WALL0 = 1_800_000_000.0  # the worker's wall clock at virtual time 0
TTL = 600.0
HELLO = WorkerHello(session=SESSION, pid=4242, start_id="boot:4242", app_version=APP_VERSION)
ADMITTED = AuthOk(session=SESSION, pid=4242)
REPLACED = (
    "this route's supervisor no longer owns the session — ask it for a new route"
)

pytestmark = [pytest.mark.timeout(10), pytest.mark.usefixtures("no_worker_errors")]


# --- helpers ---------------------------------------------------------------------------------


class GatedAgent:
    """Records every prompt it runs; a gated prompt waits for its event before replying."""

    replayable = True

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.gates: dict[str, trio.Event] = {}
        self.started: dict[str, trio.Event] = {}

    def gate(self, prompt: str) -> trio.Event:
        self.gates[prompt] = trio.Event()
        self.started[prompt] = trio.Event()
        return self.gates[prompt]

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        self.prompts.append(prompt)
        if prompt in self.gates:
            self.started[prompt].set()
            await self.gates[prompt].wait()
        yield f"reply {ctx.turn}: {prompt}"


class Peers:
    """SO_PEERCRED for in-memory streams: ``None`` (unknown) unless a test set one."""

    def __init__(self) -> None:
        self.pids: dict[int, int] = {}

    def __call__(self, stream: trio.abc.Stream) -> int | None:
        return self.pids.get(id(stream))


class World:
    """One worker core, its registry, its peers and a wall clock that follows MockClock."""

    def __init__(
        self, nursery: trio.Nursery, *, agent: Agent | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.nursery = nursery
        self.registry = MemoryRegistry()
        self.peers = Peers()
        self.core = WorkerCore(
            session_id=SESSION,
            agent=agent or EchoAgent(),
            token=TOKEN,
            supervisor_socket=SOCKET,
            read_record=self.registry.read_record,
            read_start_id=self.registry.read_start_id,
            journal=journal,
            transcript=None,
            cwd=Path("/"),
            peer_pid=self.peers,
            pid=4242,
            start_id="boot:4242",
            wall_clock=lambda: WALL0 + trio.current_time(),
            boot_id="boot-test",
        )

    async def start(self) -> None:
        await self.nursery.start(self.core.serve)

    async def serving(self) -> SupervisorEnd:
        """The core started and serving supervisor generation g1 (pid 100): where most tests
        begin."""
        await self.start()
        return await self.supervisor(self.owner("g1", 100))

    def owner(self, generation: str, pid: int) -> OwnerRecord:
        return self.registry.add_owner(
            generation=generation, pid=pid, start_id=f"boot:{pid}", socket=SOCKET
        )

    def _open(self, *, peer: int | None = None) -> trio.abc.Stream:
        ours, theirs = memory_stream_pair()
        if peer is not None:
            self.peers.pids[id(theirs)] = peer
        self.nursery.start_soon(self.core.serve_connection, theirs)
        return ours

    async def supervisor(self, rec: OwnerRecord) -> SupervisorEnd:
        sup = SupervisorEnd(self._open())
        assert await sup.ms.receive() == HELLO
        await sup.ms.send(Auth(token=TOKEN, generation=rec.generation, pid=rec.pid,
                               start_id=rec.start_id, socket=SOCKET))
        assert await sup.ms.receive() == ADMITTED
        self.nursery.start_soon(sup.pump)
        return sup

    async def client(
        self, grant: str, *, client_id: str = "client-1", peer: int | None = None
    ) -> tuple[ClientEnd, Message | None]:
        """Attach with ``grant``; the client and the worker's answer to the attach."""
        c = ClientEnd(self._open(peer=peer), client_id)
        assert await c.ms.receive() == HELLO
        await c.ms.send(Attach(grant=grant))
        return c, await c.ms.receive()

    async def attached(self, grant: str, *, client_id: str = "client-1") -> ClientEnd:
        c, answer = await self.client(grant, client_id=client_id)
        assert answer == ADMITTED
        return c


def grant(generation: str, *, session: str = SESSION, token: str = TOKEN,
          expires_at: float = WALL0 + TTL) -> str:
    return make_grant(token, session, generation, expires_at)


class SupervisorEnd:
    """The supervisor's side: every message after AuthOk is logged (notices included)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.ms = MessageStream(stream)
        self.log: list[tuple[float, Message | None]] = []
        self.closed = trio.Event()
        self.changed = trio.Event()
        self._scope = trio.CancelScope()

    async def pump(self) -> None:
        with self._scope:
            while True:
                try:
                    msg = await self.ms.receive()
                except trio.ClosedResourceError:
                    if self._scope.cancel_called:
                        return  # close() closed it under a receive already woken by data
                    raise
                self.log.append((trio.current_time(), msg))
                self.changed.set()
                self.changed = trio.Event()
                if msg is None:
                    self.closed.set()
                    return

    def notices(self) -> list[Notice]:
        return [m for _t, m in self.log if isinstance(m, Notice)]

    async def wait_notices(self, n: int) -> list[Notice]:
        with trio.fail_after(1.0):
            while len(self.notices()) < n:
                await self.changed.wait()
        return self.notices()

    async def prompt(self, link_id: int, text: str, *, client_id: str,
                     command_id: Any) -> None:
        """A prompt as the supervisor relays it: its own link id, the client's command id."""
        await self.ms.send(Request(id=link_id, op="prompt", client_id=client_id,
                                   args={"text": text, "command_id": command_id}))

    async def response(self, link_id: int) -> Response:
        with trio.fail_after(1.0):
            while True:
                for _t, m in self.log:
                    if isinstance(m, Response) and m.id == link_id:
                        return m
                assert not self.closed.is_set(), self.log
                await self.changed.wait()

    async def close(self) -> None:
        """The supervisor process died (kill -9): its end of the connection just closes."""
        self._scope.cancel()
        await self.ms.aclose()


class ClientEnd:
    """A client's direct route, driven by hand."""

    def __init__(self, stream: trio.abc.Stream, client_id: str) -> None:
        self.ms = MessageStream(stream)
        self.client_id = client_id

    async def send(self, rid: int, op: str, **args: Any) -> None:
        await self.ms.send(Request(id=rid, op=op, client_id=self.client_id, args=args))

    async def prompt(self, rid: int, text: str) -> None:
        # as Client._prompt_direct: no command_id, the request id is the command id
        await self.send(rid, "prompt", text=text, stream=True)

    async def receive(self) -> Message | None:
        with trio.fail_after(1.0):
            return await self.ms.receive()

    async def until_response(self) -> tuple[list[Event], Response]:
        events: list[Event] = []
        while True:
            msg = await self.receive()
            assert msg is not None, events
            if isinstance(msg, Event):
                events.append(msg)
                continue
            assert isinstance(msg, Response), msg
            return events, msg


def chunk(rid: int, text: str, at: int = 0) -> Event:
    """A chunk event as it arrives: its bytes base64-encoded, with their offset."""
    data = base64.b64encode(text.encode()).decode()
    return Event(id=rid, event={"kind": "chunk", "at": at, "data": data})


def reply(rid: int, turn: int, text: str) -> Response:
    return Response(id=rid, ok=True, result={"session": SESSION, "turn": turn, "reply": text,
                                             "bytes": len(text.encode())})


def refused(rid: int, message: str = REPLACED) -> tuple[int, str, str]:
    return (rid, "grant_refused", message)


def failure(msg: Message | None) -> tuple[Any, str, str]:
    assert isinstance(msg, Response), msg
    assert not msg.ok, msg
    assert isinstance(msg.error, ErrorBody), msg
    return (msg.id, msg.error.code, msg.error.message)


def grant_refused(message: str) -> Dropped:
    return Dropped(code="grant_refused", message=message)


async def advance_to(clock: trio.testing.MockClock, when: float) -> None:
    clock.jump(when - trio.current_time())
    await trio.testing.wait_all_tasks_blocked()
    assert trio.current_time() == when


# --- (1) a valid grant: prompts go straight to the worker -----------------------------------


async def test_client_with_a_valid_grant_prompts_directly_and_supervisor_hears_the_turns(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    sup = await w.serving()
    client = await w.attached(grant("g1"))

    await client.prompt(1, "hello")
    assert await client.until_response() == (
        [chunk(1, "[echo turn 1] hello\n")], reply(1, 1, "[echo turn 1] hello\n")
    )
    await client.prompt(2, "again")
    assert await client.until_response() == (
        [chunk(2, "[echo turn 2] again\n")], reply(2, 2, "[echo turn 2] again\n")
    )
    await client.send(3, "status")
    assert await client.receive() == Response(
        id=3, ok=True, result={"session": SESSION, "pid": 4242, "turns": 2, "busy": False}
    )
    await client.send(4, "ping")
    msg = await client.receive()
    assert isinstance(msg, Response)
    assert msg.ok

    # the supervisor never saw the prompts, only the worker's notices of its turns
    # (turn_started carries the turns done before it): the first turn's start and end at
    # once, then one notice per notice_interval, the latest (the second turn's start was
    # replaced by its end before its turn to go came)
    assert await sup.wait_notices(3) == [
        Notice(kind="turn_started", turn=0), Notice(kind="turn_done", turn=1),
        Notice(kind="turn_done", turn=2),
    ]
    assert [t for t, _m in sup.log] == [0.0, 0.0, DEFAULT_TIMING.notice_interval]
    assert all(isinstance(m, Notice) for _t, m in sup.log)
    assert w.core.turns_run == 2


async def test_a_streamed_off_prompt_gets_only_the_response(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    await w.serving()
    client = await w.attached(grant("g1"))
    await client.send(1, "prompt", text="quiet", stream=False)
    assert await client.until_response() == ([], reply(1, 1, "[echo turn 1] quiet\n"))


async def test_back_to_back_prompts_cost_the_supervisor_a_notice_per_interval(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Ten prompts answered at once: the supervisor hears the first turn's start and end,
    then the latest state once ``notice_interval`` has passed — not twenty notices; a lone
    turn after a quiet spell is told at once again."""
    w = World(nursery)
    sup = await w.serving()
    client = await w.attached(grant("g1"))
    for i in range(1, 11):
        await client.send(i, "prompt", text=f"p{i}", stream=False)
        assert await client.until_response() == ([], reply(i, i, f"[echo turn {i}] p{i}\n"))
    assert trio.current_time() == 0.0  # no prompt waited for a notice
    interval = DEFAULT_TIMING.notice_interval
    # two went at once (which two depends on how the tasks interleave: a notice replaced
    # before it went is not sent), then the latest state once the interval had passed
    notices = await sup.wait_notices(3)
    await trio.sleep(2 * interval)  # quiet: nothing more comes, and two may go at once again
    assert sup.notices() == notices
    assert [t for t, _m in sup.log] == [0.0, 0.0, interval]
    assert notices[-1] == Notice(kind="turn_done", turn=10)
    assert [n.turn for n in notices] == sorted(n.turn for n in notices)
    start = trio.current_time()
    await client.send(11, "prompt", text="p11", stream=False)
    await client.until_response()
    # a lone turn after a quiet spell: its end is told at once, never held
    await trio.testing.wait_all_tasks_blocked()
    assert sup.notices()[-1] == Notice(kind="turn_done", turn=11)
    assert [t for t, _m in sup.log][3:] == [start] * (len(sup.log) - 3)


# --- (2) grants that do not admit ------------------------------------------------------------

NOT_ISSUED = "grant not issued for this session by its supervisor"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda: grant("g1", session="s2"), NOT_ISSUED, id="another-session"),
        pytest.param(lambda: grant("g1", token="other-token"), NOT_ISSUED, id="another-token"),
        pytest.param(lambda: grant("g1")[:-1] + ("0" if grant("g1")[-1] != "0" else "1"),
                     NOT_ISSUED, id="tampered-mac"),
        pytest.param(lambda: grant("g1").replace(str(int((WALL0 + TTL) * 1000)),
                                                 str(int((WALL0 + 2 * TTL) * 1000))),
                     NOT_ISSUED, id="tampered-expiry"),
        pytest.param(lambda: grant("g0"),
                     "grant of supervisor generation g0, which this worker no longer serves",
                     id="unknown-generation"),
        pytest.param(lambda: grant("g1", expires_at=WALL0), "grant expired", id="expired"),
        pytest.param(lambda: "not a grant", "malformed grant", id="malformed"),
    ],
)
async def test_grant_that_does_not_admit_is_dropped_with_grant_refused(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, make: Any, message: str
) -> None:
    w = World(nursery)
    await w.serving()
    client, answer = await w.client(make())
    assert answer == grant_refused(message)
    assert await client.receive() is None
    # the worker goes on: a good grant is admitted
    good = await w.attached(grant("g1"))
    await good.prompt(1, "hi")
    assert (await good.until_response())[1] == reply(1, 1, "[echo turn 1] hi\n")


async def test_no_grant_is_honoured_before_any_supervisor_authenticated(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    await w.start()
    w.owner("g1", 100)
    client, answer = await w.client(grant("g1"))
    assert answer == grant_refused(
        "grant of supervisor generation g1, which this worker no longer serves"
    )
    assert await client.receive() is None


async def test_grant_expiry_is_exact_on_the_worker_wall_clock(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    await w.serving()
    g = grant("g1", expires_at=WALL0 + 10.0)
    await advance_to(autojump_clock, 9.5)
    early, answer = await w.client(g)
    assert answer == ADMITTED
    await advance_to(autojump_clock, 10.0)
    _late, answer = await w.client(g)
    assert answer == grant_refused("grant expired")
    # an admitted route is not cut at its grant's expiry: the grant admits, the fence keeps it
    await early.prompt(1, "after expiry")
    assert (await early.until_response())[1] == reply(1, 1, "[echo turn 1] after expiry\n")


async def test_peer_of_another_uid_is_refused_even_with_a_valid_grant(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    await w.serving()
    client, answer = await w.client(grant("g1"), peer=-1)
    assert answer == grant_refused("a process of another uid may not use this worker")
    assert await client.receive() is None
    assert w.core.turns_run == 0
    # a peer of our uid (its pid known) is admitted
    _ours, answer = await w.client(grant("g1"), peer=5555)
    assert answer == ADMITTED


async def test_digit_like_expiry_is_refused_as_malformed_not_a_crash(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    await w.serving()
    _client, answer = await w.client(f"g1.\u00b2.{'0' * 64}")
    assert answer == grant_refused("malformed grant")


# --- (3) a replaced supervisor's grants die --------------------------------------------------


async def test_grant_of_a_replaced_supervisor_is_refused_at_the_next_command(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    old_sup = await w.serving()
    old_grant = grant("g1")
    client = await w.attached(old_grant)
    await client.prompt(1, "before")
    assert (await client.until_response())[1] == reply(1, 1, "[echo turn 1] before\n")

    await advance_to(autojump_clock, 0.1)
    new_sup = await w.supervisor(w.owner("g2", 200))
    with trio.fail_after(1):
        await old_sup.closed.wait()
    # the attached route lives on until its next command, which is refused; then it closes
    await client.prompt(2, "after")
    assert failure(await client.receive()) == refused(2)
    assert await client.receive() is None
    # a fresh attach with the old grant is refused outright, although it has not expired
    _c, answer = await w.client(old_grant)
    assert answer == grant_refused(
        "grant of supervisor generation g1, which this worker no longer serves"
    )
    # the new supervisor's grant works, and the refused prompt never ran
    again = await w.attached(grant("g2"))
    await again.prompt(2, "after")
    assert (await again.until_response())[1] == reply(2, 2, "[echo turn 2] after\n")
    assert w.core.turns_run == 2
    assert await new_sup.wait_notices(2) == [
        Notice(kind="turn_started", turn=1), Notice(kind="turn_done", turn=2)
    ]


async def test_prompt_queued_on_a_route_whose_supervisor_is_replaced_never_runs(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    agent = GatedAgent()
    release = agent.gate("first")
    w = World(nursery, agent=agent)
    await w.serving()
    holder = await w.attached(grant("g1"), client_id="holder")
    queued = await w.attached(grant("g1"), client_id="queued")
    await holder.prompt(1, "first")
    await agent.started["first"].wait()
    await queued.prompt(1, "second")
    await trio.testing.wait_all_tasks_blocked()

    await w.supervisor(w.owner("g2", 200))
    release.set()
    assert failure(await queued.receive()) == refused(
        1, "the route's supervisor was replaced while the prompt waited — ask the supervisor"
        " for a new route")
    assert await queued.receive() is None
    assert agent.prompts == ["first"]
    # the turn that was running finishes and answers, though its route is now stale
    assert (await holder.until_response())[1] == reply(1, 1, "reply 1: first")


async def test_same_supervisor_reconnecting_keeps_its_routes(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    await w.start()
    rec = w.owner("g1", 100)
    first = await w.supervisor(rec)
    client = await w.attached(grant("g1"))
    await first.close()
    await w.supervisor(rec)  # the same supervisor, a new link
    await client.prompt(1, "still mine")
    assert (await client.until_response())[1] == reply(1, 1, "[echo turn 1] still mine\n")


# --- (4) a supervisor killed -9 leaves its routes served ------------------------------------


@pytest.mark.parametrize("how", ["deleted", "replaced-pid", "replaced-generation"])
async def test_routes_outlive_a_killed_supervisor_until_its_record_goes(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, how: str
) -> None:
    w = World(nursery)
    await w.start()
    rec = w.owner("g1", 100)
    sup = await w.supervisor(rec)
    client = await w.attached(grant("g1"))
    await client.prompt(1, "one")
    assert (await client.until_response())[1] == reply(1, 1, "[echo turn 1] one\n")

    # kill -9: the connection closes; the record stays on disk, unchanged
    await sup.close()
    await advance_to(autojump_clock, 1.0)  # four re-fence ticks
    assert w.core.current is None
    await client.prompt(2, "two")
    assert (await client.until_response())[1] == reply(2, 2, "[echo turn 2] two\n")
    # ... and a client that got its grant before the kill can still attach
    late = await w.attached(grant("g1"), client_id="late")
    await late.prompt(1, "three")
    assert (await late.until_response())[1] == reply(1, 3, "[echo turn 3] three\n")

    # the record goes (a new supervisor took over, or the dead one was cleaned up)
    match how:
        case "deleted":
            w.registry.delete("g1")
        case "replaced-pid":
            w.registry.replace(rec, pid=101, start_id="boot:101")
        case "replaced-generation":
            w.registry.replace(rec, generation="g1-successor")
    await advance_to(autojump_clock, 1.1)
    await client.prompt(3, "four")
    assert failure(await client.receive()) == refused(3)
    assert await client.receive() is None
    await late.send(2, "status")
    assert failure(await late.receive()) == refused(2)
    _c, answer = await w.client(grant("g1"))
    assert isinstance(answer, Dropped)
    assert answer.code == "grant_refused"
    assert w.core.turns_run == 3


# --- (5) exactly once across the supervisor link and the direct route -----------------------


@pytest.mark.parametrize("first", ["supervisor", "direct"])
async def test_same_command_over_both_paths_while_running_runs_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, first: str
) -> None:
    agent = GatedAgent()
    release = agent.gate("hello")
    w = World(nursery, agent=agent)
    sup = await w.serving()
    client = await w.attached(grant("g1"), client_id="c")

    # the client's request 7: relayed by the supervisor as its link request 70 with
    # command_id 7, and sent on the direct route as request 7
    if first == "supervisor":
        await sup.prompt(70, "hello", client_id="c", command_id=7)
        await agent.started["hello"].wait()
        await client.prompt(7, "hello")
    else:
        await client.prompt(7, "hello")
        await agent.started["hello"].wait()
        await sup.prompt(70, "hello", client_id="c", command_id=7)
    await trio.testing.wait_all_tasks_blocked()
    release.set()

    expected = {"session": SESSION, "turn": 1, "reply": "reply 1: hello", "bytes": 14}
    sup_response = await sup.response(70)
    assert sup_response == Response(id=70, ok=True, result=expected)
    events, response = await client.until_response()
    assert response == reply(7, 1, "reply 1: hello")
    # the chunks follow the newest request for the command
    assert events == ([chunk(7, "reply 1: hello")] if first == "supervisor" else [])
    assert agent.prompts == ["hello"]
    assert w.core.turns_run == 1


@pytest.mark.parametrize("first", ["supervisor", "direct"])
async def test_same_command_over_both_paths_after_completion_gets_the_journalled_result(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, tmp_path: Path, first: str
) -> None:
    agent = GatedAgent()
    journal = Journal(tmp_path / "s1.jsonl")
    try:
        w = World(nursery, agent=agent, journal=journal)
        await w.start()
        sup = await w.supervisor(w.owner("g1", 100))
        client = await w.attached(grant("g1"), client_id="c")
        expected = {"session": SESSION, "turn": 1, "reply": "reply 1: hello", "bytes": 14}
        if first == "supervisor":
            await sup.prompt(70, "hello", client_id="c", command_id=7)
            assert await sup.response(70) == Response(id=70, ok=True, result=expected)
            await client.prompt(7, "hello")
            # the journalled result, with its output again (from the start), nothing run again
            assert await client.until_response() == (
                [chunk(7, "reply 1: hello")], reply(7, 1, "reply 1: hello")
            )
        else:
            await client.prompt(7, "hello")
            assert await client.until_response() == (
                [chunk(7, "reply 1: hello")], reply(7, 1, "reply 1: hello")
            )
            await sup.prompt(70, "hello", client_id="c", command_id=7)
            assert await sup.response(70) == Response(id=70, ok=True, result=expected)
        assert agent.prompts == ["hello"]
        assert w.core.turns_run == 1
        # another client's request 7 is another command
        other = await w.attached(grant("g1"), client_id="other")
        await other.prompt(7, "hello")
        assert (await other.until_response())[1] == reply(7, 2, "reply 2: hello")
        assert agent.prompts == ["hello", "hello"]
    finally:
        journal.close()


# --- (6) a direct route cannot administer the worker -----------------------------------------


@pytest.mark.parametrize("op", ["stop", "shutdown", "kill_session", "route"])
async def test_stop_and_other_ops_are_refused_on_a_direct_route(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, op: str
) -> None:
    w = World(nursery)
    await w.serving()
    client = await w.attached(grant("g1"))
    await client.send(1, op)
    assert failure(await client.receive()) == (
        1, "unknown_op", f"op {op!r} is not served on a direct route"
    )
    await trio.testing.wait_all_tasks_blocked()
    assert not w.core.stop_requested.is_set()
    # the route stays open and the worker serves on
    await client.prompt(2, "still up")
    assert (await client.until_response())[1] == reply(2, 1, "[echo turn 1] still up\n")


# --- (7) a notice that cannot be delivered must not tear the supervisor's stream -------------


class StallingStream(trio.abc.Stream):
    """The worker's end of a supervisor connection whose socket buffer fills up: with
    ``stall`` set, a send writes the first half of its bytes and then blocks (as ``send_all``
    on a nearly full Unix socket does)."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.stall = False
        self.stalled = trio.Event()
        self.closed = False
        self.incoming, self._incoming = trio.open_memory_channel[bytes](16)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed:
            raise trio.ClosedResourceError
        await trio.lowlevel.checkpoint()
        if self.stall:
            self.sent += bytes(data[: len(data) // 2])
            self.stalled.set()
            await trio.sleep_forever()
        self.sent += bytes(data)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            return await self._incoming.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return b""

    async def aclose(self) -> None:
        self.closed = True
        await trio.lowlevel.checkpoint()

    def frames(self) -> list[bytes]:
        """The complete lines written so far."""
        return bytes(self.sent).split(b"\n")[:-1]


async def test_a_notice_cut_by_its_timeout_never_leaves_a_torn_frame(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    w = World(nursery)
    await w.start()
    rec = w.owner("g1", 100)
    stream = StallingStream()
    nursery.start_soon(w.core.serve_connection, stream)
    await stream.incoming.send(encode(Auth(token=TOKEN, generation="g1", pid=rec.pid,
                                           start_id=rec.start_id, socket=SOCKET)))
    await trio.testing.wait_all_tasks_blocked()
    assert [decode(f) for f in stream.frames()] == [HELLO, ADMITTED]

    client = await w.attached(grant("g1"))
    stream.stall = True  # the supervisor stops reading: its socket buffer is full
    await client.prompt(1, "one")
    assert (await client.until_response())[1] == reply(1, 1, "[echo turn 1] one\n")
    await stream.stalled.wait()
    stream.stall = False  # ... and it reads again
    await advance_to(autojump_clock, 1.0)  # every notice's send was given up by now
    await client.prompt(2, "two")
    assert (await client.until_response())[1] == reply(2, 2, "[echo turn 2] two\n")
    await trio.testing.wait_all_tasks_blocked()
    # every line the supervisor can read is a whole frame (or the worker closed the stream)
    for frame in stream.frames():
        try:
            decode(frame)
        except AgentdError:
            pytest.fail(f"torn frame on the supervisor's stream: {frame!r}")
