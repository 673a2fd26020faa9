"""Cold start and concurrent launches: whole ``trio-agentd -p hi`` processes, no daemon running.

(a) **cold start**: a fresh private env per repetition (no daemon, no state); the clock runs from
spawning ``trio-agentd -p hi`` to its exit, i.e. the client autostarts a supervisor, the
supervisor spawns the session's worker, the reply is printed. ``python -c pass`` is timed
interleaved, as a gauge of machine noise.

(b) **concurrent launches**: N ``trio-agentd -p hi`` processes spawned back to back on a fresh
socket (N = 15 and 64, interleaved); the clock runs from the first spawn to the last exit.
Checks: every process exits 0 with an echo reply, the turns are exactly 1..N (one session, no
prompt lost or run twice), one ``*.owner`` record, one live supervisor process once autostart
losers (if any) have exited.

Usage: ``python -m benchmarks.startup [--quick]``. The last line of stdout is the result as JSON.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trio_agentd._identity import read_start_id

from ._common import Env, _our_pids, machine, private_env, run_timed, summary, timed
from .peers import _reap, _subreaper
from .recovery import BenchError, _supervisor, _workers

COLD_GOAL_MS = 400.0
_REPLY = re.compile(r"^\[echo turn (\d+)\] hi$")


def _daemon_pids(env: Env) -> list[int]:
    """Live supervisor processes of this env (the CLI's ``daemon`` subcommand)."""
    out = []
    for pid in _our_pids(env.marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"daemon" in argv and state not in (b"Z", b"X"):
            out.append(pid)
    return out


def _turn(path: Path) -> int:
    text = path.read_text(errors="replace").strip()
    m = _REPLY.match(text)
    if m is None:
        raise BenchError(f"unexpected output {text[:200]!r}")
    return int(m.group(1))


def cold_once(env: Env) -> float:
    """Seconds for one ``trio-agentd -p hi`` with no daemon; checks the reply."""
    out = env.root / "cold.out"
    with open(out, "wb") as f:
        dt, rc = run_timed(env.cli("-p", "hi"), env=env.env, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0 or _turn(out) != 1:
        raise BenchError(f"cold start exited {rc}: {out.read_text(errors='replace')[:300]!r}")
    return dt


def cold_start(reps: int) -> dict[str, Any]:
    samples: list[float] = []
    base: list[float] = []
    for _ in range(reps):
        base.append(timed([sys.executable, "-c", "pass"]))
        with private_env() as env:
            samples.append(cold_once(env))
        print(f"  cold start: {samples[-1] * 1000:6.1f} ms", file=sys.stderr)
    return {"cold_start_ms": summary(samples), "python_c_pass_ms": summary(base),
            "samples_ms": [round(x * 1000, 1) for x in samples], "goal_ms": COLD_GOAL_MS}


def concurrent_once(n: int) -> dict[str, Any]:
    """``n`` CLI prompts at once on a fresh socket; wall time and the one-supervisor checks."""
    with private_env() as env:
        outs = [env.root / f"c{i}.out" for i in range(n)]
        files = [open(p, "wb") for p in outs]  # noqa: SIM115 - closed below, all at once
        try:
            t0 = time.perf_counter()
            procs = [subprocess.Popen(env.cli("-p", "hi"), env=env.env,
                                      stdin=subprocess.DEVNULL, stdout=f,
                                      stderr=subprocess.STDOUT) for f in files]
            spawned = time.perf_counter() - t0
            ends: dict[int, float] = {}
            deadline = time.monotonic() + 120
            while len(ends) < n:
                for i, p in enumerate(procs):
                    if i not in ends and p.poll() is not None:
                        ends[i] = time.perf_counter() - t0
                if time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    raise BenchError(f"{n - len(ends)} of {n} clients still running after 120 s")
                time.sleep(0.002)
        finally:
            for f in files:
                f.close()
        wall = max(ends.values())
        at_end = len(_daemon_pids(env))
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            i, rc = failed[0]
            raise BenchError(f"{len(failed)} of {n} clients failed, e.g. exit {rc}: "
                             f"{outs[i].read_text(errors='replace')[:300]!r}")
        turns = sorted(_turn(p) for p in outs)
        if turns != list(range(1, n + 1)):
            raise BenchError(f"turns are not 1..{n}: {turns}")
        records = sorted(p.name for p in env.registry.glob("*.owner"))
        owner = _supervisor(env)
        settle = time.monotonic() + 15
        live = _daemon_pids(env)
        while len(live) > 1 and time.monotonic() < settle:
            time.sleep(0.05)
            live = _daemon_pids(env)
        ok = len(records) == 1 and owner is not None and live == [owner[0]]
        if not ok:
            raise BenchError(f"not exactly one supervisor: owner records {records}, owner "
                             f"{owner}, live supervisor pids {live}")
        return {"clients": n, "wall_s": wall, "spawn_s": spawned,
                "median_exit_s": sorted(ends.values())[n // 2],
                "supervisors_at_last_exit": at_end, "owner_records": len(records),
                "live_supervisors": len(live)}


def concurrent(sizes: tuple[int, ...], reps: int) -> list[dict[str, Any]]:
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    for rep in range(reps):
        for n in sizes:
            r = concurrent_once(n)
            runs[n].append(r)
            print(f"  {n} launches at once, rep {rep + 1}/{reps}: all done in"
                  f" {r['wall_s'] * 1000:6.0f} ms, one supervisor", file=sys.stderr)
    return [{"clients": n, "reps": len(rs), "all_succeeded": True, "one_supervisor": True,
             "wall_ms": summary([r["wall_s"] for r in rs]),
             "median_exit_ms": summary([r["median_exit_s"] for r in rs]),
             "spawn_ms": summary([r["spawn_s"] for r in rs]),
             "max_supervisors_at_last_exit": max(r["supervisors_at_last_exit"] for r in rs)}
            for n, rs in runs.items()]


# one client process: ``n`` new sessions at once, each answering its first prompt
_LAUNCH = """
import sys, trio, trio_agentd
N = int(sys.argv[1])
async def main():
    async with trio_agentd.open_client() as c:
        async def one(i):
            reply = await c.prompt(f"b{i}", f"hi{i}")
            assert reply == f"[echo turn 1] hi{i}\\n", reply
        async with trio.open_nursery() as n:
            for i in range(N):
                n.start_soon(one, i)
trio.run(main)
"""


def bulk_once(env: Env, n: int) -> tuple[float, float]:
    """(launch, stop) seconds: from no daemon, one client process creating ``n`` sessions at
    once until each answered its first prompt (the client autostarts the supervisor); then
    ``trio-agentd shutdown`` until the supervisor and every worker are gone."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _LAUNCH, str(n)], env=env.env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    launch = time.perf_counter() - t0
    if out.returncode != 0:
        raise BenchError(f"launching {n} sessions exited {out.returncode}: {out.stderr[-400:]!r}")
    deadline = time.monotonic() + 10  # descriptors are committed in groups, just after
    while len(workers := _workers(env)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    sup = _supervisor(env)
    if sup is None or len(workers) != n:
        raise BenchError(f"after the launch: supervisor {sup}, {len(workers)} of {n} workers")
    procs = [sup, *workers.values()]
    t0 = time.perf_counter()
    subprocess.run(env.cli("shutdown"), env=env.env, stdin=subprocess.DEVNULL,
                   capture_output=True, timeout=120, check=True)
    deadline = time.monotonic() + 60
    while any(read_start_id(pid) == sid for pid, sid in procs):
        if time.monotonic() > deadline:
            raise BenchError("processes left 60 s after `trio-agentd shutdown`")
        for pid, _sid in procs:
            _reap(pid)  # ours as their subreaper: gone once exited, as init reaps them
        time.sleep(0.002)
    return launch, time.perf_counter() - t0


def bulk(n: int, reps: int) -> dict[str, Any]:
    """As the peers' figures (``peers._stop_and_wait``), under this process as the child
    subreaper: the supervisor, orphaned once the launching client exits, is reaped here as soon
    as it exits, as init does on an ordinary machine (this machine's pid 1 reaps an orphan about
    1.5 s late, which the peers' figures do not count either)."""
    launch: list[float] = []
    stop: list[float] = []
    for rep in range(reps):
        with _subreaper(), private_env() as env:
            a, b = bulk_once(env, n)
        launch.append(a)
        stop.append(b)
        print(f"  {n} sessions, rep {rep + 1}/{reps}: launch {a * 1000:6.0f} ms, shutdown"
              f" {b * 1000:6.0f} ms", file=sys.stderr)
    return {"sessions": n, "launch_ms": summary(launch), "stop_ms": summary(stop)}


def run(quick: bool = False) -> dict[str, Any]:
    return {"cold": cold_start(5 if quick else 10),
            "concurrent": concurrent((15, 64), 2 if quick else 3),
            "bulk": bulk(100, 1 if quick else 3)}


def main() -> None:
    res = run("--quick" in sys.argv[1:])
    print(f"machine: {machine()}")
    c = res["cold"]["cold_start_ms"]
    b = res["cold"]["python_c_pass_ms"]
    print(f"cold start (no daemon → reply printed): median {c['median']:.1f} ms, min"
          f" {c['min']:.1f}, max {c['max']:.1f} (n={c['n']:.0f}; goal ≤ {COLD_GOAL_MS:.0f} ms);"
          f" python -c pass median {b['median']:.1f} ms")
    for r in res["concurrent"]:
        w = r["wall_ms"]
        print(f"{r['clients']:3d} launches at once: all succeeded, one supervisor; wall median"
              f" {w['median']:.0f} ms, min {w['min']:.0f}, max {w['max']:.0f} (n={w['n']:.0f})")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
