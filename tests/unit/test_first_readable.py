"""``first_readable``: the first of several fds to turn readable, with one wait and no task."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import trio
import trio.lowlevel
import trio.testing

from trio_agentd.agents._exec import first_readable


class _Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.count = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


@pytest.fixture
def pipes() -> Iterator[list[tuple[int, int]]]:
    made = [os.pipe() for _ in range(3)]
    try:
        yield made
    finally:
        for r, w in made:
            os.close(r)
            os.close(w)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_the_first_ready_fd_is_found_without_a_task_per_fd(
    pipes: list[tuple[int, int]],
) -> None:
    spawns = _Spawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        reads = [r for r, _w in pipes]
        async with trio.open_nursery() as nursery:
            found: list[int] = []

            async def wait() -> None:
                found.append(await first_readable(reads))

            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            before = spawns.count
            os.write(pipes[1][1], b"x")
        assert found == [reads[1]]
        assert spawns.count == before  # the wait itself started no task
        os.write(pipes[2][1], b"y")
        assert await first_readable(reads) == reads[1]  # both ready: the first in the list
        os.read(reads[1], 1)
        assert await first_readable(reads) == reads[2]
    finally:
        trio.lowlevel.remove_instrument(spawns)


async def test_a_cancelled_wait_leaves_no_descriptor_behind(
    pipes: list[tuple[int, int]],
) -> None:
    reads = [r for r, _w in pipes]
    before = _open_fds()
    with trio.move_on_after(0.01):
        await first_readable(reads)
    assert _open_fds() == before
    os.write(pipes[0][1], b"x")  # and the fds still work for the next wait
    assert await first_readable(reads) == reads[0]
    assert _open_fds() == before
