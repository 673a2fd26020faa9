"""``follow`` (``trio-agentd logs -f``) on MockClock: a follower gets a turn as it streams, from
any client; one that does not read never slows the turn and is let go, bounded."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd._followers import Followers
from trio_agentd._protocol import Attach, ErrorBody, Event, Response
from trio_agentd.agents import TurnContext

from .test_direct_route import ADMITTED, HELLO, ClientEnd, World, grant

pytestmark = pytest.mark.timeout(10)

GEN = "gen-a"


class Pieces:
    """Yields ``count`` pieces of ``size`` bytes; the first ``hold`` pieces, then a gate."""

    replayable = True

    def __init__(self, count: int, size: int, hold: int | None = None) -> None:
        self.count, self.size, self.hold = count, size, hold
        self.gate = trio.Event()
        self.held = trio.Event()

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        for i in range(self.count):
            if i == self.hold:
                self.held.set()
                await self.gate.wait()
            yield chr(ord("a") + i % 26) * self.size


async def _world(nursery: trio.Nursery, agent: Any) -> tuple[World, ClientEnd, ClientEnd]:
    world = World(nursery, agent=agent)
    await world.start()
    await world.supervisor(world.owner(GEN, 100))
    prompter = await world.attached(grant(GEN), client_id="prompter")
    follower = await world.attached(grant(GEN), client_id="follower")
    return world, prompter, follower


def _events(msgs: list[Any]) -> list[dict[str, Any]]:
    out = []
    for m in msgs:
        assert isinstance(m, Event), m
        ev = dict(m.event)
        if ev.get("kind") == "chunk":
            ev["data"] = base64.b64decode(ev["data"]).decode()
        out.append(ev)
    return out


async def test_a_follower_sees_the_turn_as_it_streams(autojump_clock: Any) -> None:
    agent = Pieces(count=3, size=2, hold=2)
    async with trio.open_nursery() as nursery:
        _world_, prompter, follower = await _world(nursery, agent)
        await follower.send(1, "follow")
        assert _events([await follower.receive()]) == [
            {"kind": "following", "session": "s1", "pid": 4242, "turns": 0}]
        await prompter.prompt(7, "go")
        await agent.held.wait()
        # two pieces streamed while the turn still runs (held at its gate)
        got = _events([await follower.receive() for _ in range(3)])
        assert got == [
            {"kind": "turn_started", "turn": 1, "command": ["prompter", "7"], "prompt": None},
            {"kind": "chunk", "turn": 1, "command": ["prompter", "7"], "at": 0, "data": "aa"},
            {"kind": "chunk", "turn": 1, "command": ["prompter", "7"], "at": 2, "data": "bb"},
        ]
        # a second follower, arriving mid-turn, is caught up first
        late = await _world_.attached(grant(GEN), client_id="late")
        await late.send(1, "follow")
        assert _events([await late.receive() for _ in range(3)]) == [
            got[0], {**got[1], "data": "aabb"},
            {"kind": "following", "session": "s1", "pid": 4242, "turns": 0}]
        agent.gate.set()
        _evs, answer = await prompter.until_response()
        assert answer.ok
        rest = _events([await follower.receive() for _ in range(2)])
        assert rest == [
            {"kind": "chunk", "turn": 1, "command": ["prompter", "7"], "at": 4, "data": "cc"},
            {"kind": "turn_done", "turns": 1},
        ]
        assert _events([await late.receive() for _ in range(2)]) == rest
        nursery.cancel_scope.cancel()


async def test_a_follower_that_does_not_read_never_slows_the_turn(autojump_clock: Any) -> None:
    agent = Pieces(count=40, size=1000)
    async with trio.open_nursery() as nursery:
        world, prompter, _ = await _world(nursery, agent)
        world.core.followers = Followers(max_bytes=10_000)
        # a reader that does not read: every send to it waits (no buffer in between)
        ours, theirs = trio.testing.lockstep_stream_pair()
        nursery.start_soon(world.core.serve_connection, theirs)
        follower = ClientEnd(ours, "follower")
        assert await follower.receive() == HELLO
        await follower.ms.send(Attach(grant=grant(GEN)))
        assert await follower.receive() == ADMITTED
        await follower.send(1, "follow")
        # the follower reads nothing from here on; the turn runs to its end at once
        await prompter.prompt(7, "go")
        _evs, answer = await prompter.until_response()
        assert answer.ok
        assert answer.result["bytes"] == 40_000
        assert trio.current_time() == 0.0
        queued = [f for f in world.core.followers.all]
        assert len(queued) == 1
        assert queued[0].dropped
        assert len(queued[0].queue) == 0  # its buffer was freed
        # when it reads again: what it had been sent, then one line saying why it was let go
        while True:
            msg = await follower.receive()
            if isinstance(msg, Response):
                break
        assert not msg.ok
        assert isinstance(msg.error, ErrorBody)
        assert msg.error.code == "follower_behind"
        assert "fell more than 10000 bytes behind the output of session s1" in msg.error.message
        nursery.cancel_scope.cancel()
