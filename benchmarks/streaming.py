"""Streaming: big output through one session and through 16 at once, and the memory it costs.

(a) **one session**: the bench venv's CLI, ``trio-agentd -p -s s1 --agent shell -- 'head -c
SIZE /dev/zero' > /dev/null``, timed as a whole process after a warm-up prompt on the same
session, interleaved with the plain pipe ``head -c SIZE /dev/zero | cat > /dev/null`` (A B A B
…); the figure is the ratio of their throughputs (medians). The CPU seconds the supervisor, the
worker and the CLI spent on each stream are reported as a profile hint.

(b) **16 sessions at once**: 16 such CLI processes, each its own session, spawned together; the
clock runs from the first spawn to the last exit; aggregate throughput against 16 plain pipes
spawned together, interleaved the same way. A third arm, interleaved with both, writes the same
bytes into 16 files on the daemon's filesystem (``head -c SIZE /dev/zero > FILE``, 16 at once):
a turn keeps its output past 64 KiB in a file (a resend of a finished command gets its whole
answer), so that is what keeping the bytes costs at the least, with no socket and no Python.

(c) **memory**: an in-process Trio client (``stream_prompt_bytes``, the direct route) streams
SIZE bytes from a shell session, once reading as fast as it can and once reading 1 MB, pausing
10 s, then reading the rest. ``VmRSS`` of the supervisor and of the session's worker is sampled
every 50 ms from ``/proc/PID/status``; the figure is the growth of the peak over the RSS just
before the prompt.

A turn's output past 64 KiB is kept in a file in the session's dir (for a resend); this figure
deletes those files after each stream so that gigabytes do not pile up in the temp dir.

Usage: ``python -m benchmarks.streaming [--quick]``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

import trio_agentd

from ._common import (
    Env,
    cpu_s,
    inherited,
    machine,
    private_env,
    run_timed,
    summary,
    vm_rss_kb,
    wait_timed,
)
from .recovery import BenchError, _supervisor, _workers

MB = 1_000_000
SAMPLE_S = 0.05


def _cmd(size: int) -> str:
    return f"head -c {size} /dev/zero"


def _drop_outputs(env: Env) -> None:
    """Delete the kept output files of finished turns (gigabytes of zeros in the temp dir)."""
    for p in env.home.glob("**/output/*.out"):
        p.unlink(missing_ok=True)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _pipe(size: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(["/bin/sh", "-c", f"{_cmd(size)} | cat > /dev/null"], check=True,
                   stdin=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _cli_stream(env: Env, session: str, size: int) -> float:
    err = env.root / "stream.err"
    with open(err, "wb") as e:
        dt, rc = run_timed(env.cli("-p", "-s", session, "--agent", "shell", "--", _cmd(size)),
                           env=env.env, stderr=e, limit=1800)
    if rc != 0:
        raise BenchError(f"the CLI stream exited {rc}: {err.read_bytes()[-300:]!r}")
    return dt


def _check_bytes(env: Env, session: str, size: int) -> None:
    """One stream of ``size`` bytes through the CLI, counted: every byte arrives, once."""
    done = subprocess.run(env.cli("-p", "-s", session, "--agent", "shell", "--", _cmd(size)),
                          env=env.env, stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=600)
    if done.returncode != 0 or done.stdout != b"\0" * size:
        raise BenchError(f"the CLI stream of {size} bytes gave {len(done.stdout)} bytes, exit "
                         f"{done.returncode}")


def one_session(size: int, reps: int) -> dict[str, Any]:
    pipe: list[float] = []
    cli: list[float] = []
    cpu: dict[str, list[float]] = {"supervisor": [], "worker": [], "cli": []}
    with private_env() as env:
        env.run("-p", "-s", "s1", "--agent", "shell", "--", "echo warm")
        _check_bytes(env, "s1", 3 * MB + 17)
        env.run("-p", "-s", "s1", "--agent", "shell", "--", "echo warm")  # the warm-up
        sup = _supervisor(env)
        if sup is None:
            raise BenchError("no supervisor")
        wpid = _workers(env)["s1"][0]
        for rep in range(reps):
            pipe.append(_pipe(size))
            before = (cpu_s(sup[0]) or 0.0, cpu_s(wpid) or 0.0, _children_cpu())
            cli.append(_cli_stream(env, "s1", size))
            after = (cpu_s(sup[0]) or 0.0, cpu_s(wpid) or 0.0, _children_cpu())
            cpu["supervisor"].append(after[0] - before[0])
            cpu["worker"].append(after[1] - before[1])
            cpu["cli"].append(after[2] - before[2])
            _drop_outputs(env)
            print(f"  one session, {size / MB:,.0f} MB, rep {rep + 1}/{reps}: pipe "
                  f"{size / pipe[-1] / MB:,.0f} MB/s, trio-agentd {size / cli[-1] / MB:,.0f} MB/s",
                  file=sys.stderr)
        env.run("shutdown")
    mbps_pipe = [size / t / MB for t in pipe]
    mbps_cli = [size / t / MB for t in cli]
    med_pipe = summary(mbps_pipe, 1.0)
    med_cli = summary(mbps_cli, 1.0)
    return {"bytes": size, "pipe_MBps": med_pipe, "cli_MBps": med_cli,
            "pipe_s": summary(pipe, 1.0), "cli_s": summary(cli, 1.0),
            "ratio": med_cli["median"] / med_pipe["median"],
            "cpu_s": {k: summary(v, 1.0) for k, v in cpu.items()},
            "samples_cli_s": [round(x, 3) for x in cli],
            "samples_pipe_s": [round(x, 3) for x in pipe]}


def many_sessions(count: int, size: int, reps: int) -> dict[str, Any]:
    pipe: list[float] = []
    to_file: list[float] = []
    cli: list[float] = []
    sessions = [f"m{i:02d}" for i in range(count)]
    with private_env() as env:
        for s in sessions:
            env.run("-p", "-s", s, "--agent", "shell", "--", "echo warm")
        for rep in range(reps):
            t0 = time.perf_counter()
            procs = [subprocess.Popen(["/bin/sh", "-c", f"{_cmd(size)} | cat > /dev/null"],
                                      stdin=subprocess.DEVNULL) for _ in sessions]
            pipe.append(max(wait_timed(procs, t0, 1800)))
            if any(p.returncode != 0 for p in procs):
                raise BenchError("a plain pipe failed")
            floors = [env.home / f"floor-{s}.out" for s in sessions]
            t0 = time.perf_counter()
            procs = [subprocess.Popen(["/bin/sh", "-c", f'{_cmd(size)} > "{f}"'],
                                      stdin=subprocess.DEVNULL) for f in floors]
            to_file.append(max(wait_timed(procs, t0, 1800)))
            for f in floors:
                f.unlink(missing_ok=True)
            if any(p.returncode != 0 for p in procs):
                raise BenchError("a plain write to a file failed")
            t0 = time.perf_counter()
            procs = [subprocess.Popen(env.cli("-p", "-s", s, "--agent", "shell", "--",
                                              _cmd(size)), env=env.env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for s in sessions]
            cli.append(max(wait_timed(procs, t0, 1800)))
            codes = [p.returncode for p in procs]
            if any(codes):
                raise BenchError(f"CLI streams exited {codes}")
            _drop_outputs(env)
            total = count * size / MB
            print(f"  {count} sessions x {size / MB:,.0f} MB, rep {rep + 1}/{reps}: pipes "
                  f"{total / pipe[-1]:,.0f} MB/s, into files {total / to_file[-1]:,.0f} MB/s, "
                  f"trio-agentd {total / cli[-1]:,.0f} MB/s", file=sys.stderr)
        env.run("shutdown")
    total = count * size / MB
    agg_pipe = summary([total / t for t in pipe], 1.0)
    agg_file = summary([total / t for t in to_file], 1.0)
    agg_cli = summary([total / t for t in cli], 1.0)
    return {"sessions": count, "bytes_each": size, "pipe_MBps": agg_pipe, "cli_MBps": agg_cli,
            "file_MBps": agg_file, "ratio": agg_cli["median"] / agg_pipe["median"],
            "file_ratio": agg_file["median"] / agg_pipe["median"],
            "samples_cli_s": [round(x, 3) for x in cli],
            "samples_file_s": [round(x, 3) for x in to_file],
            "samples_pipe_s": [round(x, 3) for x in pipe]}


# --- memory ----------------------------------------------------------------------------------


async def _memory_case(env: Env, size: int, pause: float) -> dict[str, Any]:
    async with trio_agentd.open_client(env.socket, home=str(env.home),
                                       registry=str(env.registry)) as client:
        session = "mem"
        await client.prompt_bytes(session, "echo warm", agent="shell")
        sup = _supervisor(env)
        if sup is None:
            raise BenchError("no supervisor")
        pids = {"supervisor": sup[0], "worker": _workers(env)[session][0],
                "client": os.getpid()}
        base: dict[str, list[int]] = {k: [] for k in pids}
        for _ in range(10):
            for k, pid in pids.items():
                if (kb := vm_rss_kb(pid)) is not None:
                    base[k].append(kb)
            await trio.sleep(SAMPLE_S)
        baseline = {k: sorted(v)[len(v) // 2] for k, v in base.items() if v}
        peak = dict(baseline)
        samples = 0
        got = 0
        reroutes0, reconnects0 = client.reroutes, client.reconnects
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:

            async def sample() -> None:
                nonlocal samples
                while True:
                    for k, pid in pids.items():
                        kb = vm_rss_kb(pid)
                        if kb is not None and kb > peak.get(k, 0):
                            peak[k] = kb
                    samples += 1
                    await trio.sleep(SAMPLE_S)

            nursery.start_soon(sample)
            paused = pause <= 0
            async for data in client.stream_prompt_bytes(session, _cmd(size), agent="shell"):
                got += len(data)
                if not paused and got >= MB:
                    paused = True
                    await trio.sleep(pause)
            nursery.cancel_scope.cancel()
        seconds = time.perf_counter() - t0
        if got != size:
            raise BenchError(f"streamed {got} bytes, expected {size}")
        return {"bytes": got, "pause_s": pause, "seconds": round(seconds, 2),
                "MBps": round(size / seconds / MB, 1), "samples": samples,
                "baseline_mb": {k: round(v / 1024, 1) for k, v in baseline.items()},
                "peak_mb": {k: round(v / 1024, 1) for k, v in peak.items()},
                "growth_mb": {k: round((peak[k] - baseline[k]) / 1024, 1) for k in baseline},
                "reroutes": client.reroutes - reroutes0,
                "reconnects": client.reconnects - reconnects0}


def memory(size: int, pause: float, reps: int) -> dict[str, Any]:
    cases: dict[str, list[dict[str, Any]]] = {"reading": [], "paused": []}
    with private_env() as env, inherited(env):
        for rep in range(reps):
            for name, p in (("reading", 0.0), ("paused", pause)):
                r = trio.run(_memory_case, env, size, p)
                cases[name].append(r)
                _drop_outputs(env)
                print(f"  memory, {name}, rep {rep + 1}/{reps}: growth {r['growth_mb']} MB, "
                      f"{r['MBps']} MB/s", file=sys.stderr)
        env.run("shutdown")
    out: dict[str, Any] = {"bytes": size, "pause_s": pause, "sample_s": SAMPLE_S,
                           "cases": cases}
    for name, rs in cases.items():
        out[name] = {k: summary([r["growth_mb"][k] for r in rs], 1.0)
                     for k in ("supervisor", "worker", "client")}
        out[name]["MBps"] = summary([r["MBps"] for r in rs], 1.0)
    return out


def run(quick: bool) -> dict[str, Any]:
    size = 100 * MB if quick else 1000 * MB
    out: dict[str, Any] = {}
    errors: dict[str, str] = {}
    parts: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("one", lambda: one_session(size, 2 if quick else 3)),
        ("many", lambda: many_sessions(16, (25 if quick else 250) * MB, 1 if quick else 3)),
        ("memory", lambda: memory(size, 10.0, 1 if quick else 2)),
    ]
    for name, fn in parts:
        try:
            out[name] = fn()
        except Exception as exc:  # one part failing keeps the others
            errors[name] = f"{type(exc).__name__}: {exc}"
    if not out:
        raise BenchError("; ".join(errors.values()))
    out["errors"] = errors
    return out


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    print(f"machine: {machine()}")
    print(json.dumps(run(quick), default=str))
