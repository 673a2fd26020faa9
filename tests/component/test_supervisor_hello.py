"""The hello every connection gets first: the same frame each time, built once (``ps`` probes
every supervisor of the user, so each answer should cost a supervisor little)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._protocol import Hello
from trio_agentd._supervisor import Supervisor

from .conftest import supervisor_world


async def test_each_client_gets_the_same_hello_built_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[Hello] = []
    real = Supervisor.hello

    def counted(self: Supervisor) -> Hello:
        built.append(real(self))
        return built[-1]

    monkeypatch.setattr(Supervisor, "hello", counted)
    async with supervisor_world(tmp_path, run_dir) as world:
        hellos = []
        for _ in range(3):
            c = await world.client()
            hellos.append(c.hello)
            await c.aclose()
    assert len(built) == 1
    assert hellos == [built[0]] * 3
    assert (hellos[0].generation, hellos[0].socket) == (world.sup.generation,
                                                         world.sup.layout.socket)
