"""The whole Supervisor on MockClock: fake workers, clients over in-memory streams.

``Supervisor(config, worker_ops=machine.for_supervisor, listener=MemoryListener())`` runs the
real supervisor — startup, the owner record and registry in a temporary dir, every op, its
loops — with fake worker processes (``FakeWorkerOps``: real ``WorkerCore``s over memory
streams, re-fencing against the supervisor's real registry through a ``FakeWatcher``) and
clients that connect in memory. Every wait is a trio wait, so each rule is asserted at its
exact virtual time: the self-check, the idle sweep and eviction, the liveness ping and the
hung-worker schedule, the shutdown drain, and the worker's re-fence on a registry event.

Times are read from the ``Timing`` in use, never hard-coded.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd._errors import ErrorCode
from trio_agentd._protocol import ErrorBody, Response
from trio_agentd._recovery import Mode
from trio_agentd.agents import Agent, TurnContext
from trio_agentd.testing import FakeProcess, MemoryClient
from trio_agentd.timing import DEFAULT_TIMING, Timing

from .conftest import advance_to, supervisor_world

pytestmark = pytest.mark.timeout(60)


def next_tick(t: float, period: float) -> float:
    """The first multiple of ``period`` after ``t`` (a loop started at 0 that sleeps
    ``period`` between rounds wakes then)."""
    tick = 0.0
    while tick <= t:
        tick += period  # the same additions as the loop's deadlines: bit-exact
    return tick


def reply(turn: int, text: str) -> dict[str, Any]:
    r = f"[echo turn {turn}] {text}\n"
    return {"session": "s1", "turn": turn, "reply": r, "bytes": len(r.encode())}


def error_code(response: Response) -> str:
    assert not response.ok
    assert isinstance(response.error, ErrorBody)
    return response.error.code


def received(p: FakeProcess, op: str) -> list[float]:
    """When the worker read a request ``op`` from any connection."""
    return [t for t, what in p.received if what == op]


class Timed:
    """A request in the background: its response (or end of connection), and when."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.at: float | None = None
        self.response: Response | None = None
        self.closed = False

    async def run(self, c: MemoryClient, op: str, args: dict[str, Any],
                  request_id: int | None = None) -> None:
        try:
            self.response = await c.request(op, args, request_id=request_id)
        except trio.EndOfChannel:
            self.closed = True
        self.at = trio.current_time()
        self.done.set()


def _sleepy(seconds: float) -> Callable[[], Agent]:
    class SleepyAgent:
        replayable = False

        async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
            await trio.sleep(seconds)
            yield f"slept: {prompt}"

    return SleepyAgent


# --- the self-check ------------------------------------------------------------------------

async def test_a_deleted_owner_record_is_restored_at_the_next_self_check_tick(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    async with supervisor_world(tmp_path, run_dir) as w:
        period = w.timing.self_check_interval
        before = w.record.read_bytes()
        deleted_at = 4.5 * period  # between two ticks, with no command coming
        await advance_to(deleted_at)
        w.record.unlink()  # a temp cleaner
        tick = next_tick(deleted_at, period)
        assert tick == 5 * period

        await advance_to(tick - period / 4)
        assert not w.record.exists()
        assert w.sup.ownership.statistics().restores == 0

        await advance_to(tick)
        assert w.record.exists()  # restored by the idle supervisor itself, at the tick
        assert w.sup.ownership.statistics().restores == 1
        assert w.sup.ownership.check() is None
        restored = json.loads(w.record.read_bytes())
        assert restored["generation"] == json.loads(before)["generation"]
        assert restored["token"] == json.loads(before)["token"]


async def test_a_revoked_supervisor_stops_at_the_next_tick_and_leaves_its_worker_running(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    async with supervisor_world(tmp_path, run_dir) as w:
        period = w.timing.self_check_interval
        assert (await w.prompt("hi")).result == reply(1, "hi")
        p = w.machine.processes[0]
        revoked_at = 4.5 * period
        await advance_to(revoked_at)
        # what doctor --fix does to a wedged supervisor: a tombstone, the record gone
        w.sup.ownership.registry.revoke(w.sup.generation)
        w.record.unlink()

        await w.sup.stopped.wait()
        assert trio.current_time() == next_tick(revoked_at, period)
        assert w.listener.closed_at == next_tick(revoked_at, period)
        with pytest.raises(ConnectionRefusedError):
            await w.client()
        # the worker is left for the next supervisor: alive, never signalled or told to stop,
        # and its descriptor says it is ready to be adopted
        assert p.alive
        assert p.signals == []
        assert received(p, "stop") == []
        assert w.descriptor()["lifecycle"] == "ready"
        assert w.descriptor()["pid"] == p.pid


async def test_state_dirs_deleted_under_the_supervisor_are_written_again_at_the_next_tick(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    async with supervisor_world(tmp_path, run_dir) as w:
        period = w.timing.self_check_interval
        assert (await w.prompt("hi")).ok
        L = w.sup.layout
        descriptor = w.descriptor()
        token = L.token_path("s1").read_bytes()
        deleted_at = 6.5 * period
        await advance_to(deleted_at)
        shutil.rmtree(L.workers_dir)

        await advance_to(next_tick(deleted_at, period) - period / 4)
        assert not L.workers_dir.exists()
        await advance_to(next_tick(deleted_at, period))
        again = w.descriptor()
        assert {k: again[k] for k in ("pid", "start_id", "lifecycle", "token_sha256")} == {
            k: descriptor[k] for k in ("pid", "start_id", "lifecycle", "token_sha256")}
        assert L.token_path("s1").read_bytes() == token


# --- the idle sweep ------------------------------------------------------------------------

def eviction_timing() -> Timing:
    return dataclasses.replace(DEFAULT_TIMING, idle_eviction=30.0, idle_sweep_period=10.0)


async def test_an_idle_session_is_evicted_at_the_first_sweep_after_its_idle_time(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    t = eviction_timing()
    async with supervisor_world(tmp_path, run_dir, timing=t) as w:
        assert (await w.prompt("hi")).result == reply(1, "hi")  # ends at 0: idle since then
        p = w.machine.processes[0]
        evict_at = next_tick(t.idle_eviction - t.idle_sweep_period / 2, t.idle_sweep_period)
        assert evict_at >= t.idle_eviction

        await advance_to(evict_at - t.idle_sweep_period)
        assert p.alive
        assert received(p, "stop") == []
        await advance_to(evict_at)
        # asked over its link (if idle, then for good): no signal, its exit confirmed
        assert received(p, "stop") == [evict_at]
        assert not p.alive
        assert p.signals == []
        c = await w.client()
        listed = (await c.request("sessions")).result
        assert [(s["session"], s["state"], s["pid"]) for s in listed] == [("s1", "evicted", None)]
        desc = w.descriptor()
        assert (desc["lifecycle"], desc["stop_reason"]) == ("stopped", "evict")

        # the next prompt starts a fresh worker at once
        await advance_to(evict_at + 1)
        assert (await c.request("prompt", {"session": "s1", "text": "back"})).ok
        assert trio.current_time() == evict_at + 1
        assert [e for e in w.machine.events if e[1].startswith("spawn")] == [
            (0.0, f"spawn {p.pid}"), (evict_at + 1, f"spawn {w.machine.processes[1].pid}")]
        await c.aclose()


async def test_a_turn_longer_than_the_idle_time_is_not_evicted_and_idle_counts_from_its_end(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    t = eviction_timing()
    turn = t.idle_eviction + t.idle_sweep_period * 1.5  # ends between two sweeps
    async with supervisor_world(tmp_path, run_dir, timing=t,
                                agent_factory=_sleepy(turn)) as w:
        c = await w.client()
        long_turn = Timed()
        w.nursery.start_soon(long_turn.run, c, "prompt", {"session": "s1", "text": "slow"})
        await long_turn.done.wait()
        assert long_turn.at == turn
        assert long_turn.response is not None
        assert long_turn.response.ok
        p = w.machine.processes[0]
        assert received(p, "stop") == []  # not at t.idle_eviction, with its turn running

        evict_at = next_tick(turn + t.idle_eviction, t.idle_sweep_period)
        await advance_to(evict_at - t.idle_sweep_period)
        assert received(p, "stop") == []
        await advance_to(evict_at)
        assert received(p, "stop") == [evict_at]
        assert not p.alive
        await c.aclose()


# --- liveness: a hung worker ---------------------------------------------------------------

def respawn_time(unresponsive_at: float, t: Timing) -> tuple[list[float], float]:
    """The connects of the unreachable-worker schedule after a link closed as unresponsive at
    ``unresponsive_at`` (a stopped worker: each connect hangs for the adopt timeout), and when
    the worker is killed and respawned (TERM stays pending while it is stopped)."""
    connects = []
    now = unresponsive_at
    for delay in t.worker_retry_delays:
        now += delay
        connects.append(now)
        now += t.adopt_connect_timeout
    for _ in range(t.max_deferred_recovery_rounds):
        now += t.deferred_recovery_recheck
        connects.append(now)
        now += t.adopt_connect_timeout
    return connects, now + t.stop_grace


async def test_a_stopped_worker_fails_its_prompt_unresponsive_and_is_respawned_on_schedule(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    async with supervisor_world(tmp_path, run_dir) as w:
        t = w.timing
        assert (await w.prompt("hi")).result == reply(1, "hi")
        await trio.testing.wait_all_tasks_blocked()
        p = w.machine.processes[0]
        p.freeze()  # SIGSTOP right after its last word (t=0): its connections stay open

        c = await w.client("b")
        stuck = Timed()
        w.nursery.start_soon(stuck.run, c, "prompt", {"session": "s1", "text": "anyone?"}, 7)
        await stuck.done.wait()
        unresponsive_at = t.link_ping_interval + t.link_ping_timeout
        assert stuck.at == unresponsive_at
        assert stuck.response is not None
        assert error_code(stuck.response) == ErrorCode.WORKER_UNRESPONSIVE
        await trio.testing.wait_all_tasks_blocked()
        listed = (await (await w.client()).request("sessions")).result
        assert [(s["session"], s["state"]) for s in listed] == [("s1", "recovering")]

        # a prompt sent during the recovery gets the same answer after the ping timeout
        late = Timed()
        w.nursery.start_soon(late.run, await w.client("c"), "prompt",
                             {"session": "s1", "text": "hello?"})
        await late.done.wait()
        assert late.at == unresponsive_at + t.link_ping_timeout
        assert late.response is not None
        assert error_code(late.response) == ErrorCode.WORKER_UNRESPONSIVE

        # then the schedule of a worker that cannot be reached: reconnects, deferred rounds,
        # TERM (pending while stopped), KILL after the grace, and a respawn
        connects, respawned_at = respawn_time(unresponsive_at, t)
        h = w.sup.sessions["s1"]
        await h.mode.wait_value(Mode.STARTING)
        await h.mode.wait_value(Mode.READY)
        assert trio.current_time() == respawned_at
        new = w.machine.processes[1]
        assert [at for at, what in w.machine.events if what == f"connect {p.pid}"] == [
            0.0, *connects]
        assert [e for e in w.machine.events if not e[1].startswith("connect")][-3:] == [
            (respawned_at - t.stop_grace, f"signal SIGTERM {p.pid}"),
            (respawned_at, f"signal SIGKILL {p.pid}"),
            (respawned_at, f"spawn {new.pid}"),
        ]
        assert not p.alive

        # the client resends the same command: the fresh worker answers it
        again = await c.request("prompt", {"session": "s1", "text": "anyone?"}, request_id=7)
        assert again.result == reply(1, "anyone?")
        listed = (await (await w.client()).request("sessions")).result
        assert [(s["state"], s["pid"], s["restarts"]) for s in listed] == [
            ("ready", new.pid, 1)]


# --- the shutdown drain --------------------------------------------------------------------

async def test_shutdown_drains_the_command_in_flight_then_stops_the_workers(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    turn = DEFAULT_TIMING.stop_grace / 2
    async with supervisor_world(tmp_path, run_dir, agent_factory=_sleepy(turn)) as w:
        a, other = await w.client("a"), await w.client("other")
        in_flight = Timed()
        w.nursery.start_soon(in_flight.run, a, "prompt", {"session": "s1", "text": "finish me"})
        shutdown_at = turn / 4
        await advance_to(shutdown_at)

        stop = await (await w.client("op")).request("shutdown", {"stop_workers": True})
        assert stop.ok
        assert stop.result["stop_workers"] is True
        assert trio.current_time() == shutdown_at
        await trio.testing.wait_all_tasks_blocked()
        # no new connections from now on, and no new commands on open ones
        assert w.listener.closed_at == shutdown_at
        with pytest.raises(ConnectionRefusedError):
            await w.client()
        assert error_code(await other.request("status")) == ErrorCode.SHUTTING_DOWN

        # the command in flight finishes and is answered; then the worker is asked to stop
        await in_flight.done.wait()
        assert in_flight.at == turn
        assert in_flight.response is not None
        assert in_flight.response.result["reply"] == "slept: finish me"
        await w.sup.stopped.wait()
        assert trio.current_time() == turn
        p = w.machine.processes[0]
        assert received(p, "stop") == [turn]
        assert not p.alive
        assert p.signals == []
        desc = w.descriptor()
        assert (desc["lifecycle"], desc["stop_reason"]) == ("stopped", "shutdown")
        assert not w.record.parent.exists()  # the record is released


async def test_the_drain_waits_no_longer_than_the_stop_grace_and_the_turn_runs_on(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    turn = DEFAULT_TIMING.stop_grace * 3
    async with supervisor_world(tmp_path, run_dir, agent_factory=_sleepy(turn)) as w:
        t = w.timing
        in_flight = Timed()
        w.nursery.start_soon(in_flight.run, await w.client("a"), "prompt",
                             {"session": "s1", "text": "long"})
        shutdown_at = 1.0
        await advance_to(shutdown_at)
        w.sup.request_shutdown(stop_workers=False)  # SIGTERM: workers are left running

        await in_flight.done.wait()
        assert in_flight.at == shutdown_at + t.stop_grace
        assert in_flight.closed  # given up on: its connection closes unanswered
        await w.sup.stopped.wait()
        assert trio.current_time() == shutdown_at + t.stop_grace
        p = w.machine.processes[0]
        assert p.alive  # for the next supervisor to adopt; its turn goes on
        assert p.signals == []
        assert received(p, "stop") == []
        assert w.descriptor()["lifecycle"] == "ready"


# --- the worker's re-fence on a registry change --------------------------------------------

async def test_a_registry_event_makes_the_worker_drop_a_claim_at_once_and_the_link_heals(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    async with supervisor_world(tmp_path, run_dir) as w:
        period = w.timing.self_check_interval
        assert (await w.prompt("hi")).result == reply(1, "hi")
        p = w.machine.processes[0]
        h = w.sup.sessions["s1"]
        assert p.watcher is not None
        reg = w.sup.layout.registry
        assert p.watcher.watched == {reg, reg / f"{w.sup.generation}.owner"}

        deleted_at = 4.5 * period
        await advance_to(deleted_at)
        w.record.unlink()
        w.machine.registry_changed()  # inotify: IN_DELETE in the watched record dir
        await trio.testing.wait_all_tasks_blocked()
        # the worker re-fenced at once, found the claim gone and dropped the supervisor
        assert p.watcher.wakeups == 1
        assert (deleted_at, "link lost") in h.log
        assert h.mode.value is Mode.RECOVERING

        # the self-check restores the record at its next tick; the next reconnect after it
        # is authenticated again: the same worker, never respawned
        restored_at = next_tick(deleted_at, period)
        await h.mode.wait_value(Mode.READY)
        connects = [at for at, what in w.machine.events if what == f"connect {p.pid}"]
        assert connects[-1] >= restored_at
        assert all(at < restored_at for at in connects[1:-1])
        assert trio.current_time() == connects[-1]
        assert w.sup.ownership.statistics().restores == 1
        assert len(w.machine.processes) == 1
        assert p.alive
        assert p.signals == []
        assert h.restarts == 0
        assert (await w.prompt("again")).result == reply(2, "again")


async def test_without_an_event_the_worker_finds_a_lost_claim_at_its_fallback_poll(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path
) -> None:
    # no self-heal (the record stays gone), and link pings rarer than the fallback poll (a
    # ping re-checks the claim too): the drop can only come from the fallback
    t = dataclasses.replace(DEFAULT_TIMING, link_ping_interval=3600.0)
    async with supervisor_world(tmp_path, run_dir, timing=t, self_heal=False) as w:
        period = t.self_check_interval
        assert (await w.prompt("hi")).result == reply(1, "hi")
        p = w.machine.processes[0]
        h = w.sup.sessions["s1"]
        deleted_at = 4.5 * period
        assert deleted_at < t.refence_fallback
        await advance_to(deleted_at)
        w.record.unlink()  # a change inotify did not report

        await advance_to(t.refence_fallback - period)
        assert not any(what == "link lost" for _, what in h.log)
        assert p.watcher is not None
        assert p.watcher.wakeups == 0
        await advance_to(t.refence_fallback)
        assert (t.refence_fallback, "link lost") in h.log
        assert w.sup.ownership.statistics().restores == 0
