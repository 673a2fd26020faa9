"""What one session costs the supervisor, which keeps thousands: its handle in slots, its waited-on
values small while nobody waits, no copy of its creating client's environment once a worker ran
(the session's metadata holds it); and :class:`WatchedValue` keeps ``AsyncValue``'s meaning."""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path

import trio
import trio.testing

from trio_agentd._handle import WorkerHandle
from trio_agentd._recovery import Mode
from trio_agentd._watched import WatchedValue
from trio_agentd.testing import FakeWorkerOps, open_fake_supervisor

# bytes a new handle allocates at most (measured: about 2.0 KB; with an instance dict and two
# trio_util.AsyncValue it was 6.8 KB)
HANDLE_BYTES_MAX = 3000


def _bytes_per_handle(ops: FakeWorkerOps, n: int) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        handles = [WorkerHandle(ops, f"s{i:04d}", "echo", "/") for i in range(n)]
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(handles) == n
    return (after - before) / n


async def test_a_handle_has_no_instance_dict_and_stays_small() -> None:
    async with trio.open_nursery() as nursery:
        ops = FakeWorkerOps(nursery)
        h = WorkerHandle(ops, "s1", "echo", "/")
        assert not hasattr(h, "__dict__")
        assert _bytes_per_handle(ops, 200) <= HANDLE_BYTES_MAX
        nursery.cancel_scope.cancel()


async def test_a_ready_session_keeps_no_copy_of_its_creating_clients_environment(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with open_fake_supervisor(tmp_path) as fake:
        r = await fake.request("prompt", {"session": "s1", "text": "hi",
                                          "env": {"FOO": "bar", "HOME": "/home/x"}})
        assert r.ok
        h = fake.sup.sessions["s1"]
        assert h.mode.value is Mode.READY
        assert h.env is None
        meta = json.loads((fake.sup.layout.session_dir("s1") / "session.json").read_bytes())
        assert meta["env"] == {"FOO": "bar", "HOME": "/home/x"}
        # a later start reads it there (the process layer's rule): a respawn keeps it
        first = h.pid
        fake.machine.processes[-1].die()
        assert (await fake.prompt("again")).ok
        assert h.pid != first
        assert h.env is None
        assert json.loads((fake.sup.layout.session_dir("s1") / "session.json").read_bytes()
                          )["env"] == {"FOO": "bar", "HOME": "/home/x"}

def test_an_idle_watched_value_is_two_slots() -> None:
    v = WatchedValue(Mode.STOPPED)
    assert not hasattr(v, "__dict__")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        values = [WatchedValue(i) for i in range(100)]
        per_value = (tracemalloc.get_traced_memory()[0] - before) / len(values)
    finally:
        tracemalloc.stop()
    assert per_value <= 100  # trio_util.AsyncValue: about 1.5 KB


async def test_wait_value_returns_at_once_if_it_holds() -> None:
    v = WatchedValue(1)
    assert await v.wait_value(1) == 1
    assert await v.wait_value(lambda x: x > 0) == 1


async def test_a_waiter_is_woken_by_a_value_that_passes_by(
    autojump_clock: trio.testing.MockClock,
) -> None:
    v = WatchedValue(0)
    got: list[int] = []

    async def waiter() -> None:
        got.append(await v.wait_value(2))

    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        v.value = 1
        v.value = 2
        v.value = 3  # before the waiter runs: it still gets the value that matched
    assert got == [2]
    assert v._waiters is None


async def test_wait_transition_sees_a_change_not_an_equal_value(
    autojump_clock: trio.testing.MockClock,
) -> None:
    v = WatchedValue("a")
    got: list[tuple[str, str]] = []

    async def waiter() -> None:
        got.append(await v.wait_transition())

    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        v.value = "a"  # equal: no change
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        v.value = "b"
    assert got == [("b", "a")]


async def test_a_cancelled_waiter_is_forgotten(autojump_clock: trio.testing.MockClock) -> None:
    v = WatchedValue(0)
    with trio.move_on_after(1):
        await v.wait_value(5)
    assert v._waiters is None
    v.value = 5  # nobody to wake
    assert v.value == 5
