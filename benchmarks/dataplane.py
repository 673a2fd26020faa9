"""The data plane after a supervisor ``kill -9``: routed prompts and streams must not notice.

(a) **streams**: N shell sessions (N = 100; quick: 50) each stream numbered lines for about 3 s
(``seq`` in 10 bursts, 0.3 s apart: lines 1..10000), all consumed at once by one in-process
Trio client's ``stream_prompt_bytes``. Once every stream has delivered its first bytes, the
supervisor gets ``kill -9``. Counted: streams that finished before the kill (the kill must land
mid-stream), streams that failed, streams whose lines have a gap or a duplicate, bytes lost or
doubled, and the client's resends (``reroutes`` and ``reconnects``). Goal: all 0.

(b) **routed sessions**: N echo sessions (N = 10, 50, 100, 200, 300) all prompted once by one
Trio client (so it holds every session's route and a connection to its worker). Then the
supervisor gets ``kill -9`` and the same client prompts every session at once; the clock runs
from the kill until each answered. No supervisor is started meanwhile: the routed sessions must
not need one. Checked: every answer is right, the client never rerouted or reconnected, every
worker kept its pid. Between repetitions a supervisor is autostarted again (it adopts the
workers) and the client routes every session again (a route is bound to the supervisor
generation that granted it), outside the clock, so that there is a supervisor to kill.

Every process started is killed by pid (found by a marker in its environment), also on errors.
Usage: ``python -m benchmarks.dataplane [--quick]``.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import sys
import time
from collections import Counter
from typing import Any

import trio

import trio_agentd
from trio_agentd._paths import Layout
from trio_agentd._syncclient import SyncClient

from ._common import Env, echo_ok, machine, summary
from .recovery import BenchError, Pool, _bench_env, _no_strays, _supervisor, _wait, _workers

LINES = 10_000
BURSTS = 10
SCRIPT = ("for b in 0 1 2 3 4 5 6 7 8 9; do seq $((b*1000+1)) $((b*1000+1000)); sleep 0.3; "
          "done")
EXPECTED = b"".join(f"{i}\n".encode() for i in range(1, LINES + 1))
CONCURRENCY = 32  # prompts in flight while setting sessions up


def _open(env: Env) -> Any:
    return trio_agentd.open_client(env.socket, home=str(env.home), registry=str(env.registry))


async def _each(items: list[str], fn: Any, limit: int = CONCURRENCY) -> None:
    sem = trio.Semaphore(limit)

    async def one(item: str) -> None:
        async with sem:
            await fn(item)

    async with trio.open_nursery() as n:
        for item in items:
            n.start_soon(one, item)


def _restart_supervisor(env: Env, layout: Layout) -> int:
    """Autostart a supervisor (it adopts the workers) and wait for autostart losers to exit."""
    c = SyncClient(layout)
    try:
        c.request("sessions")
    finally:
        c.close()
    new = _wait(lambda: _supervisor(env), "the new supervisor")
    _wait(lambda: _no_strays(env, new[0]), "autostart losers to exit", 30)
    return int(new[0])


def _damage(data: bytes) -> dict[str, int]:
    """Gaps, duplicates, bytes lost and doubled in a stream of numbered lines."""
    if data == EXPECTED:
        return {"gaps": 0, "duplicates": 0, "bytes_lost": 0, "bytes_doubled": 0,
                "out_of_order": 0}
    want = Counter(EXPECTED.split(b"\n")[:-1])
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" if the data ends its last line
    got = Counter(lines)
    missing = want - got
    extra = got - want
    nums = [int(x) for x in lines if x.isdigit()]
    return {"gaps": sum(missing.values()), "duplicates": sum(extra.values()),
            "bytes_lost": sum((len(k) + 1) * v for k, v in missing.items()),
            "bytes_doubled": sum((len(k) + 1) * v for k, v in extra.items()) + len(tail),
            "out_of_order": sum(1 for a, b in itertools.pairwise(nums) if b <= a)}


# --- (a) kill -9 while streaming ---------------------------------------------------------------


async def _streams_once(env: Env, client: trio_agentd.Client, sessions: list[str],
                        rep: int) -> dict[str, Any]:
    sup = _supervisor(env)
    if sup is None:
        raise BenchError("no supervisor to kill")
    data: dict[str, bytearray] = {s: bytearray() for s in sessions}
    failed: dict[str, str] = {}
    finished_at: dict[str, float] = {}
    started = trio.Event()
    first = 0
    r0, c0 = client.reroutes, client.reconnects

    async def stream(s: str) -> None:
        nonlocal first
        seen = False
        try:
            async for piece in client.stream_prompt_bytes(s, SCRIPT, agent="shell"):
                data[s] += piece
                if not seen:
                    seen = True
                    first += 1
                    if first == len(sessions):
                        started.set()
        except trio_agentd.AgentdError as exc:
            failed[s] = f"{exc.code}: {exc.message}"
        finally:
            finished_at[s] = time.perf_counter()
            if not seen:
                first += 1
                if first == len(sessions):
                    started.set()

    t0 = time.perf_counter()
    t_kill = 0.0
    with trio.fail_after(300):
        async with trio.open_nursery() as n:
            for s in sessions:
                n.start_soon(stream, s)
            await started.wait()
            t_kill = time.perf_counter()
            os.kill(sup[0], signal.SIGKILL)
    t_end = time.perf_counter()
    damage = {s: _damage(bytes(d)) for s, d in data.items()}
    bad = sorted(s for s, d in damage.items() if d["gaps"] or d["duplicates"] or d["bytes_doubled"]
                 or d["out_of_order"])
    return {
        "streams": len(sessions),
        "kill_after_s": round(t_kill - t0, 3),
        "all_done_after_kill_s": round(t_end - t_kill, 3),
        "finished_before_kill": sum(1 for t in finished_at.values() if t <= t_kill),
        "failed": len(failed), "failures": dict(list(failed.items())[:5]),
        "damaged": len(bad), "damaged_examples": {s: damage[s] for s in bad[:5]},
        "bytes_lost": sum(d["bytes_lost"] for d in damage.values()),
        "bytes_doubled": sum(d["bytes_doubled"] for d in damage.values()),
        "bytes_expected": len(EXPECTED) * len(sessions),
        "bytes_received": sum(len(d) for d in data.values()),
        "reroutes": client.reroutes - r0, "reconnects": client.reconnects - c0,
    }


def streams_kill(n: int, reps: int) -> dict[str, Any]:
    pools: list[Pool] = []
    runs: list[dict[str, Any]] = []
    with _bench_env(pools) as (env, layout):
        sessions = [f"st{i:03d}" for i in range(n)]

        async def main() -> None:
            async with _open(env) as client:
                async def warm(s: str) -> None:
                    out = await client.prompt_bytes(s, "echo warm", agent="shell")
                    if out != b"warm\n":
                        raise BenchError(f"{s}: wrong warm-up answer {out!r}")

                await _each(sessions, warm)
                for rep in range(reps):
                    if rep:
                        # the next supervisor adopts the workers; a route names its supervisor
                        # generation, so the client routes every session again (not measured)
                        await trio.to_thread.run_sync(_restart_supervisor, env, layout)
                        await _each(sessions, warm)
                    r = await _streams_once(env, client, sessions, rep)
                    runs.append(r)
                    print(f"  streams: {n} streams, kill at {r['kill_after_s']} s, rep "
                          f"{rep + 1}/{reps}: {r['failed']} failed, {r['damaged']} damaged, "
                          f"{r['reroutes']} reroutes, {r['reconnects']} reconnects, "
                          f"{r['finished_before_kill']} done before the kill", file=sys.stderr)

        trio.run(main)
    keys = ("failed", "damaged", "bytes_lost", "bytes_doubled", "reroutes", "reconnects",
            "finished_before_kill")
    return {"sessions": n, "lines": LINES, "reps": runs,
            "total": {k: sum(int(r[k]) for r in runs) for k in keys},
            "interrupted": sum(int(r["damaged"]) + int(r["failed"]) for r in runs),
            "resends": sum(int(r["reroutes"]) + int(r["reconnects"]) for r in runs)}


# --- (b) routed sessions after kill -9 ---------------------------------------------------------


def routed_kill(n: int, reps: int) -> dict[str, Any]:
    pools: list[Pool] = []
    first: list[float] = []
    every: list[float] = []
    alive: list[float] = []
    with _bench_env(pools) as (env, layout):
        sessions = [f"r{i:03d}" for i in range(n)]

        async def main() -> None:
            async with _open(env) as client:
                async def route(s: str) -> None:
                    r = await client.request("prompt", {"session": s, "text": "route",
                                                        "stream": False})
                    if not echo_ok(r, "route"):
                        raise BenchError(f"{s}: wrong answer {r!r}")

                t0 = time.perf_counter()
                await _each(sessions, route)
                print(f"  routed: {n} sessions created and routed in "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
                workers = _workers(env)
                for rep in range(reps):
                    if rep:
                        # as in streams_kill: a new supervisor, then every session routed again
                        await trio.to_thread.run_sync(_restart_supervisor, env, layout)
                        await _each(sessions, route)
                    sup = _supervisor(env)
                    if sup is None:
                        raise BenchError("no supervisor to kill")
                    r0, c0 = client.reroutes, client.reconnects
                    text = f"after kill {rep}"
                    done: list[float] = []

                    async def ask(s: str, text: str = text, done: list[float] = done) -> None:
                        r = await client.request("prompt", {"session": s, "text": text,
                                                            "stream": False})
                        done.append(time.perf_counter())
                        if not echo_ok(r, text):
                            raise BenchError(f"{s}: wrong answer {r!r}")

                    # the same prompts with the supervisor alive: what N answers cost anyway
                    calm: list[float] = []
                    t_calm = time.perf_counter()
                    with trio.fail_after(120):
                        await _each(sessions, functools.partial(
                            ask, text=f"before kill {rep}", done=calm), limit=len(sessions))
                    alive.append(max(calm) - t_calm)
                    t_kill = time.perf_counter()
                    os.kill(sup[0], signal.SIGKILL)
                    with trio.fail_after(120):
                        await _each(sessions, ask, limit=len(sessions))
                    first.append(min(done) - t_kill)
                    every.append(max(done) - t_kill)
                    if (client.reroutes, client.reconnects) != (r0, c0):
                        raise BenchError(f"the client went back to the supervisor: "
                                         f"{client.reroutes - r0} reroutes, "
                                         f"{client.reconnects - c0} reconnects")
                    if _supervisor(env) is not None:
                        raise BenchError("a supervisor was started during the measurement")
                    now = _workers(env)
                    if now != workers:
                        moved = sorted(s for s in sessions if now.get(s) != workers.get(s))
                        raise BenchError(f"{len(moved)} workers changed: {moved[:5]}")
                    print(f"  routed: N={n:3d} rep {rep + 1}/{reps}: first answer "
                          f"{first[-1] * 1000:6.1f} ms, all {n} {every[-1] * 1000:6.1f} ms "
                          f"(no kill: {alive[-1] * 1000:6.1f} ms)",
                          file=sys.stderr)

        trio.run(main)
    return {"sessions": n, "first_answer_ms": summary(first), "all_answered_ms": summary(every),
            "all_answered_no_kill_ms": summary(alive),
            "samples_all_ms": [round(x * 1000, 1) for x in every], "reroutes": 0,
            "reconnects": 0, "workers_kept": True}


def run(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": []}
    t0 = time.monotonic()
    try:
        out["streams"] = streams_kill(50 if quick else 100, 1 if quick else 3)
    except Exception as exc:
        out["errors"].append({"part": "streams", "error": f"{type(exc).__name__}: {exc}"})
    rows = []
    for n in ([10, 50, 100] if quick else [10, 50, 100, 200, 300]):
        try:
            rows.append(routed_kill(n, 2 if quick else (5 if n <= 100 else 3)))
        except Exception as exc:
            out["errors"].append({"part": "routed", "sessions": n,
                                  "error": f"{type(exc).__name__}: {exc}"})
    out["routed"] = rows
    out["total_s"] = round(time.monotonic() - t0, 1)
    if "streams" not in out and not rows:
        raise BenchError("; ".join(e["error"] for e in out["errors"]))
    return out


if __name__ == "__main__":
    print(f"machine: {machine()}")
    print(json.dumps(run("--quick" in sys.argv), default=str))
