"""Footprint: idle CPU and memory at 100 sessions, and how many sessions one supervisor holds.

One private daemon, sessions created by prompting (``prompt`` to a new session id creates it with
the echo agent, as ``trio-agentd -p -s ID`` does) from a pool of blocking clients (the CLI's
``SyncClient``), in batches.

- **idle cost**: 100 idle sessions; after a short settle, a window of 30 s (quick: 10 s) in which
  nobody sends a command. CPU = utime + stime deltas from ``/proc/<pid>/stat`` of the supervisor
  (pid from the registry's owner record) and of every worker (pids from the worker descriptors
  under ``<home>/daemons/*/workers/*.json``), each identity-checked by its start id, as % of one
  core over the window. ``stat`` counts in clock ticks (10 ms); as a finer cross-check the window
  is also cut into 5 s slices measured on each process's CPU-time clock (ns).
- **memory**: supervisor RSS/PSS/USS at 100 sessions, and each worker's RSS/PSS/USS
  (``psutil.Process.memory_full_info``); median/min/max over workers.
- **scale**: keep creating sessions, in batches of 50, until the first failure or 1,000 (quick:
  stop at the 100 above); then every session must answer one more prompt. Reported: how many,
  how long the creation took (the idle window is not counted), and the memory then, measured
  as above: supervisor RSS, and the total PSS of the supervisor, every worker and the fork
  template (each shared page counted once in all); as a cross-check, how much the machine's
  ``MemAvailable`` fell from before the first session to then (other users of the machine
  move it too).

Usage: ``python -m benchmarks.footprint [--quick] [--scale N]``. The last line of stdout is the
JSON result.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from trio_agentd._paths import Layout
from trio_agentd._syncclient import SyncClient

from ._common import Env, echo_ok, machine, summary
from .recovery import BenchError, Pool, _bench_env, _ours, _supervisor, _wait, _workers

THREADS = 8
BATCH = 50
BATCH_TIMEOUT = 180.0
SLICE = 5.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
MB = 1024 * 1024

GOALS = {"idle_cpu_pct": 2.0, "supervisor_rss_mb": 50.0, "worker_pss_mb": 20.0,
         "worker_pss_per_session_mb": 6.0,
         "scale_sessions": 1000, "scale_supervisor_rss_mb": 60.0, "scale_total_mb": 8192.0}
SCALE = 1000  # sessions the full run creates at most


# --- sessions --------------------------------------------------------------------------------


def _prompt_all(layout: Layout, sessions: list[str], text: str, pools: list[Pool],
                timeout: float = BATCH_TIMEOUT) -> tuple[set[str], dict[str, str]]:
    """Prompt every session once from ``THREADS`` client threads; (answered, errors by session).

    Unlike :meth:`recovery.Pool.run` this keeps going after a failure and reports both sides, so
    the scale figure can count what succeeded before the first failure.
    """
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for s in sessions:
        todo.put(s)
    answered: set[str] = set()
    errors: dict[str, str] = {}
    lock = threading.Lock()
    pool = Pool(layout)  # only for its stop(): the threads' clients get registered there
    pools.append(pool)

    def work(client: SyncClient) -> None:
        while not pool.stopping:
            try:
                s = todo.get_nowait()
            except queue.Empty:
                return
            try:
                r = client.request("prompt", {"session": s, "text": text})
                if not echo_ok(r, text):
                    raise BenchError(f"wrong answer {r!r}")
            except Exception as exc:
                with lock:
                    errors[s] = f"{type(exc).__name__}: {exc}"
                continue
            with lock:
                answered.add(s)

    threads = []
    for _ in range(min(THREADS, len(sessions))):
        client = SyncClient(layout)
        pool.clients.append(client)
        t = threading.Thread(target=work, args=(client,), daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        pool.stop()
        with lock:
            missing = [s for s in sessions if s not in answered and s not in errors]
            for s in missing:
                errors[s] = f"no answer within {timeout:g} s"
    with lock:
        return set(answered), dict(errors)


def _names(start: int, stop: int) -> list[str]:
    return [f"f{i:04d}" for i in range(start, stop)]


# --- /proc -------------------------------------------------------------------------------------


def _stat_ticks(pid: int) -> tuple[int, str] | None:
    """(utime + stime in clock ticks, start time) of ``pid``; ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            tail = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(tail[11]) + int(tail[12]), tail[19].decode()


def _cpu_ns(pid: int) -> int | None:
    """CPU time of ``pid`` in ns, all its threads (exited ones too): its process CPU-time clock
    (``clock_gettime`` on ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``); ``None`` if gone."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except OSError:
        return None


def _pids(env: Env, sessions: int) -> tuple[int, dict[str, int]]:
    """The supervisor (owner record) and every worker (descriptors), identity-checked."""
    sup = _supervisor(env)
    if sup is None:
        raise BenchError("no live supervisor in the registry")
    workers = _workers(env)
    if len(workers) != sessions:
        raise BenchError(f"{len(workers)} worker descriptors, expected {sessions}")
    strangers = [s for s, (pid, sid) in workers.items() if not _ours(env, pid, sid)]
    if strangers:
        raise BenchError(f"descriptors name processes that are not ours: {strangers[:5]}")
    return sup[0], {s: pid for s, (pid, _sid) in workers.items()}


def idle_cpu(env: Env, sessions: int, window: float) -> dict[str, Any]:
    sup, workers = _pids(env, sessions)
    pids = [sup, *workers.values()]
    threads = sum(len(os.listdir(f"/proc/{p}/task")) for p in pids)
    start = {p: _stat_ticks(p) for p in pids}
    slices: list[float] = []
    sup_slices: list[float] = []
    t0 = time.perf_counter()
    ns0 = {p: _cpu_ns(p) or 0 for p in pids}
    first, ts = ns0, t0
    while (now := time.perf_counter()) - t0 < window - 1e-3:
        time.sleep(min(SLICE, window - (now - t0)))
        ns1 = {p: _cpu_ns(p) or 0 for p in pids}
        t1 = time.perf_counter()
        slices.append(100 * sum(ns1[p] - ns0[p] for p in pids) / 1e9 / (t1 - ts))
        sup_slices.append(100 * (ns1[sup] - ns0[sup]) / 1e9 / (t1 - ts))
        ns0, ts = ns1, t1
    clock_total = 100 * sum(ns0[p] - first[p] for p in pids) / 1e9 / (ts - t0)
    end = {p: _stat_ticks(p) for p in pids}
    wall = time.perf_counter() - t0
    changed = [p for p in pids if start[p] is None or end[p] is None
               or start[p][1] != end[p][1]]  # type: ignore[index]
    if changed:
        raise BenchError(f"{len(changed)} processes exited or were replaced during the window")

    def used(p: int) -> float:
        a, b = start[p], end[p]
        assert a is not None
        assert b is not None
        return (b[0] - a[0]) / CLK_TCK

    per_worker = [100 * used(p) / wall for p in workers.values()]
    total = 100 * sum(used(p) for p in pids) / wall
    return {"sessions": sessions, "window_s": round(wall, 2), "processes": len(pids),
            "threads": threads,
            "total_pct": round(total, 3),
            "supervisor_pct": round(100 * used(sup) / wall, 3),
            "workers_pct": round(sum(per_worker), 3),
            "per_worker_pct": summary(per_worker, 1.0),
            "clock_total_pct": round(clock_total, 3),
            "slice_s": SLICE,
            "slices_total_pct": summary(slices, 1.0),
            "slices_supervisor_pct": summary(sup_slices, 1.0),
            "slices_samples_pct": [round(x, 3) for x in slices],
            "goal_pct": GOALS["idle_cpu_pct"]}


def memory(env: Env, sessions: int) -> dict[str, Any]:
    sup, workers = _pids(env, sessions)
    s = psutil.Process(sup).memory_full_info()
    rss: list[float] = []
    pss: list[float] = []
    uss: list[float] = []
    for pid in workers.values():
        with contextlib.suppress(psutil.Error):
            m = psutil.Process(pid).memory_full_info()
            rss.append(m.rss / MB)
            pss.append(m.pss / MB)
            uss.append(m.uss / MB)
    if len(rss) != sessions:
        raise BenchError(f"read the memory of {len(rss)} of {sessions} workers")
    # the supervisor's other children (its worker fork template) count in the total
    others = 0.0
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(sup).children():
            if child.pid not in workers.values():
                with contextlib.suppress(psutil.Error):
                    others += child.memory_full_info().pss / MB
    return {"sessions": sessions,
            "supervisor_rss_mb": round(s.rss / MB, 2), "supervisor_pss_mb": round(s.pss / MB, 2),
            "supervisor_uss_mb": round(s.uss / MB, 2),
            "worker_rss_mb": summary(rss, 1.0), "worker_pss_mb": summary(pss, 1.0),
            "worker_pss_mean_mb": round(sum(pss) / len(pss), 3) if pss else None,
            "worker_uss_mb": summary(uss, 1.0),
            "other_children_pss_mb": round(others, 2),
            "total_pss_mb": round(s.pss / MB + sum(pss) + others, 1),
            "goal_supervisor_rss_mb": GOALS["supervisor_rss_mb"],
            "goal_worker_pss_mb": GOALS["worker_pss_mb"]}


# --- the figure ----------------------------------------------------------------------------------


def _create(layout: Layout, names: list[str], pools: list[Pool], log: Callable[[str], None],
            before: int = 0) -> tuple[list[str], str | None, float]:
    """Create ``names`` in batches until the first failure; (created, first error, seconds)."""
    created: list[str] = []
    t0 = time.perf_counter()
    for i in range(0, len(names), BATCH):
        batch = names[i:i + BATCH]
        ok, errors = _prompt_all(layout, batch, "hi", pools)
        created += [s for s in batch if s in ok]
        log(f"  {before + len(created):4d} sessions ({time.perf_counter() - t0:6.1f} s)")
        if errors:
            s, e = sorted(errors.items())[0]
            return created, f"{len(errors)} of {len(batch)} failed in the batch, e.g. {s}: {e}", \
                time.perf_counter() - t0
    return created, None, time.perf_counter() - t0


def run(quick: bool = False, sessions: int = 100, window: float | None = None,
        scale_to: int | None = None) -> dict[str, Any]:
    window = window if window is not None else (10.0 if quick else 30.0)
    scale_to = scale_to if scale_to is not None else (sessions if quick else SCALE)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    pools: list[Pool] = []
    out: dict[str, Any] = {}
    with _bench_env(pools) as (env, layout):
        available_before = _mem_available_mb()
        _first, err, first_s = _create(layout, _names(0, sessions), pools, log)
        if err is not None:
            raise BenchError(f"creating {sessions} sessions: {err}")
        # let start-up work (imports, first re-fences, journal flushes) finish first
        _wait(lambda: len(_workers(env)) == sessions, "every worker descriptor", 30)
        time.sleep(3.0)
        log(f"  idle window: {window:g} s with {sessions} sessions")
        out["idle"] = idle_cpu(env, sessions, window)
        out["memory"] = memory(env, sessions)
        created, err, more_s = _create(layout, _names(sessions, scale_to), pools, log,
                                       sessions)
        count = sessions + len(created)
        names = _names(0, sessions) + created
        t0 = time.perf_counter()
        ok, errors = _prompt_all(layout, names, "again", pools)
        answer_s = time.perf_counter() - t0
        sup = _supervisor(env)
        sup_rss = psutil.Process(sup[0]).memory_info().rss / MB if sup else float("nan")
        log(f"  scale: {count} sessions, {len(ok)} answered again in {answer_s:.1f} s")
        # as at 100: every descriptor names its worker first (one run read 999 of 1,000 just
        # after all had answered; a descriptor that never does fails the figure here)
        t1 = time.perf_counter()
        _wait(lambda: len(_workers(env)) == count, "every worker descriptor", 30)
        waited = time.perf_counter() - t1
        if waited > 0.05:
            log(f"  scale: waited {waited:.2f} s for every descriptor to name its worker")
        at_scale = memory(env, count)
        available_after = _mem_available_mb()
        log(f"  scale: supervisor RSS {at_scale['supervisor_rss_mb']:.1f} MB, total PSS"
            f" {at_scale['total_pss_mb']:.0f} MB, MemAvailable fell"
            f" {available_before - available_after:.0f} MB")
        out["scale"] = {"target": scale_to, "sessions": count, "first_failure": err,
                        "create_s": round(first_s + more_s, 2),
                        "sessions_per_s": round(count / (first_s + more_s), 1),
                        "answered_again": len(ok), "answer_again_s": round(answer_s, 2),
                        "answer_errors": dict(sorted(errors.items())[:5]),
                        "supervisor_rss_mb": round(sup_rss, 1),
                        "descriptors": len(_workers(env)),
                        "descriptors_wait_s": round(waited, 3),
                        "memory": at_scale,
                        "mem_available_drop_mb": round(available_before - available_after),
                        "goal_sessions": GOALS["scale_sessions"],
                        "goal_supervisor_rss_mb": GOALS["scale_supervisor_rss_mb"],
                        "goal_total_mb": GOALS["scale_total_mb"]}
    return out


def _mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise BenchError("no MemAvailable in /proc/meminfo")


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.footprint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 s idle window, no scale beyond 100")
    p.add_argument("--scale", type=int, metavar="N", help=f"sessions at most (default {SCALE})")
    a = p.parse_args()
    res = run(a.quick, scale_to=a.scale)
    print(f"machine: {machine()}")
    i, m, s = res["idle"], res["memory"], res["scale"]
    print(f"idle, {i['sessions']} sessions, {i['window_s']:.0f} s: {i['total_pct']:.2f} % of one"
          f" core (supervisor {i['supervisor_pct']:.2f} %, workers {i['workers_pct']:.2f} %);"
          f" 5 s slices median {i['slices_total_pct']['median']:.2f} %")
    w = m["worker_pss_mb"]
    print(f"memory at {m['sessions']}: supervisor RSS {m['supervisor_rss_mb']:.1f} MB; worker PSS"
          f" median {w['median']:.1f} MB (min {w['min']:.1f}, max {w['max']:.1f}), RSS median"
          f" {m['worker_rss_mb']['median']:.1f} MB")
    print(f"scale: {s['sessions']} sessions in {s['create_s']:.1f} s, {s['answered_again']}"
          f" answered again; first failure: {s['first_failure']}; supervisor RSS"
          f" {s['memory']['supervisor_rss_mb']:.1f} MB, total PSS"
          f" {s['memory']['total_pss_mb']:.0f} MB")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
