"""Prompt round trip (in-process Trio client, echo agent, durable journal), its server CPU, and
throughput.

The round trip is measured with its floors, in the same run and interleaved with it (floor run,
prompt run, floor run, …):

- **hop**: one request/response over a Unix socket between two Trio processes (a tiny echo
  server, :mod:`benchmarks._floor`, run by this venv's python), a message the size of a prompt;
- **fdatasync**: one small append to a file in the daemon's home dir plus ``os.fdatasync``, the
  durability each prompt's journal needs;
- **relay chain**: the two together, as a prompt does them now. A prompt goes from the client
  straight to its session's worker over the direct route (the supervisor is not on the path),
  and the worker makes one record durable before it answers; so the floor is a tiny Trio server
  (:mod:`benchmarks._floor` with a journal file) that, per request line, appends one small
  record, ``fdatasync``-s it and writes one response line. Its round trip, and its CPU per
  request (utime + stime of the server process over the run, from ``/proc/PID/stat``, divided
  by the requests) are what a prompt cannot go below.

**Server CPU per prompt**: utime + stime of the supervisor (pid from its hello) and of the
session's worker (pid from ``sessions``), from ``/proc/PID/stat``, before and after the run,
divided by the prompts of the run.

The prompts go over the direct route (the Trio client asks the supervisor for the route once,
then talks to the session's worker); the client's ``reroutes``/``reconnects`` are reported.

Throughput: 64 concurrent clients (tasks of one process) over 8 sessions for one window; and 8
and 64 client *processes* (:mod:`benchmarks._load`) over 8 sessions, against the same number of
client processes over 8 relay-chain floor servers (one per session, each with its journal),
with the server CPU per prompt of each: windows of the two taking turns (``PAIRS`` of each,
their processes started for each window); the share of the floor is the median of the pairs'
ratios.

Usage: ``python -m benchmarks.roundtrip [N] [SECONDS]`` — N sequential prompts (default
10,000), then the throughput windows of SECONDS each (default 20).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import trio

import trio_agentd

from ._common import Env, echo_ok, machine, private_env


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def _stats(samples: list[float], **extra: float) -> dict[str, float]:
    return {"p50": _pct(samples, 0.5), "p99": _pct(samples, 0.99),
            "mean": statistics.fmean(samples) * 1000, "n": float(len(samples)), **extra}


def _cpu(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds, from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        tail = f.read().rsplit(b")", 1)[1].split()
    return (int(tail[11]) + int(tail[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_of(pids: list[int]) -> float:
    return sum(_cpu(p) for p in pids)


async def _server_pids(client: trio_agentd.Client, sessions: list[str]) -> list[int]:
    """The supervisor's pid (its hello) and the workers' of ``sessions`` (``sessions`` op)."""
    rows = await client.request("sessions")
    pids = {r["session"]: r["pid"] for r in rows if isinstance(r.get("pid"), int)}
    missing = [s for s in sessions if s not in pids]
    if missing:
        raise RuntimeError(f"no worker pid for sessions {missing}")
    return [client.hello.pid, *(pids[s] for s in sessions)]


async def _sequential(env: Env, n: int) -> dict[str, float]:
    async with trio_agentd.open_client(
        env.socket, home=env.env["TRIO_AGENTD_HOME"], registry=env.env["TRIO_AGENTD_REGISTRY_DIR"]
    ) as client:
        for _ in range(50):
            await client.request("prompt", {"session": "rt", "text": "warm", "stream": False})
        r = await client.request("prompt", {"session": "rt", "text": "check", "stream": False})
        if not echo_ok(r, "check"):
            raise RuntimeError(f"wrong answer {r!r}")
        pids = await _server_pids(client, ["rt"])
        samples = []
        cpu0, sup0 = _cpu_of(pids), _cpu(pids[0])
        for i in range(n):
            t0 = time.perf_counter()
            await client.request("prompt", {"session": "rt", "text": f"p{i}", "stream": False})
            samples.append(time.perf_counter() - t0)
        cpu1, sup1 = _cpu_of(pids), _cpu(pids[0])
        return _stats(samples, reroutes=float(client.reroutes),
                      reconnects=float(client.reconnects),
                      cpu_ms=(cpu1 - cpu0) / n * 1000,
                      supervisor_cpu_ms=(sup1 - sup0) / n * 1000)


# a prompt request as the client sends it, roughly: the hop moves as many bytes each way
_MSG = (b'{"type":"request","id":123,"op":"prompt","client_id":"0123456789abcdef",'
        b'"args":{"text":"p1234","stream":false}}\n')


async def _hop(path: str, n: int) -> dict[str, float]:
    stream = await trio.open_unix_socket(path)
    async with stream:
        samples = []
        for i in range(n + 50):
            t0 = time.perf_counter()
            await stream.send_all(_MSG)
            got = 0
            while got < len(_MSG):
                data = await stream.receive_some(65536)
                if not data:
                    raise RuntimeError("the echo server closed the connection")
                got += len(data)
            if i >= 50:  # the first 50 warm up, as the prompts do
                samples.append(time.perf_counter() - t0)
    return _stats(samples)


async def _relay(path: str, pid: int, n: int) -> dict[str, float]:
    """Sequential requests to a relay-chain floor server: round trip and its CPU per request."""
    stream = await trio.open_unix_socket(path)
    async with stream:
        samples = []
        cpu0 = 0.0
        for i in range(n + 50):
            if i == 50:  # the first 50 warm up, as the prompts do
                cpu0 = _cpu(pid)
            t0 = time.perf_counter()
            await stream.send_all(_MSG)
            got = b""
            while not got.endswith(b"\n"):
                data = await stream.receive_some(65536)
                if not data:
                    raise RuntimeError("the relay floor server closed the connection")
                got += data
            if i >= 50:
                samples.append(time.perf_counter() - t0)
        return _stats(samples, cpu_ms=(_cpu(pid) - cpu0) / n * 1000)


def _fdatasync(directory: str, n: int, *, ahead: bool = False) -> dict[str, float]:
    """One small record written and ``fdatasync``-ed, ``n`` times: appended (the floor), or
    (``ahead``) written into zeros written and flushed before, as the worker's journal does
    (its size and block map do not change, so no inode is written)."""
    path = os.path.join(directory, "floor-fdatasync.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if ahead else os.O_APPEND), 0o600)
    line = b'{"rec":"accepted","id":"0123456789abcdef/123","text":"p1234"}\n'
    samples = []
    try:
        if ahead:
            os.pwrite(fd, bytes(len(line) * n), 0)
            os.fdatasync(fd)
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, line)
            os.fdatasync(fd)
            samples.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return _stats(samples)


def _fs_of(path: str) -> str:
    """``type device`` of the filesystem holding ``path`` (from /proc/self/mounts)."""
    best = ("", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(
                        best[0]):
                    best = (mnt, f"{typ} on {mnt} ({dev})")
    except OSError:
        pass
    return best[1]


async def _throughput(env: Env, clients: int, sessions: int, seconds: float) -> dict[str, Any]:
    done = 0
    errors = 0
    kw: dict[str, Any] = {"home": env.env["TRIO_AGENTD_HOME"],
                          "registry": env.env["TRIO_AGENTD_REGISTRY_DIR"]}
    async with trio_agentd.open_client(env.socket, **kw) as warm:
        for s in range(sessions):
            await warm.request("prompt", {"session": f"t{s}", "text": "warm", "stream": False})

    per_second = [0] * (int(seconds) + 1)  # prompts completed in each whole second
    t0 = 0.0

    async def one(i: int) -> None:
        nonlocal done, errors
        async with trio_agentd.open_client(env.socket, **kw) as client:
            while True:
                try:
                    await client.request(
                        "prompt", {"session": f"t{i % sessions}", "text": "x", "stream": False}
                    )
                    done += 1
                    per_second[min(int(time.perf_counter() - t0), len(per_second) - 1)] += 1
                except trio_agentd.AgentdError:
                    errors += 1

    t0 = time.perf_counter()
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as n:
            for i in range(clients):
                n.start_soon(one, i)
    elapsed = time.perf_counter() - t0
    return {"prompts_per_s": done / elapsed, "prompts": float(done), "errors": float(errors),
            "seconds": elapsed, "per_second": [float(x) for x in per_second[:int(seconds)]]}


def _child(module: str, *args: str) -> list[str]:
    """``python -P -m benchmarks.MODULE ARGS``: ``benchmarks`` from where this process got it
    (:func:`_child_env`), never from the cwd (which may hold a source tree of the package)."""
    return [sys.executable, "-P", "-m", f"benchmarks.{module}", *args]


def _child_env(env: Env) -> dict[str, str]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = env.env.get("PYTHONPATH")
    return {**env.env, "PYTHONPATH": here if not path else f"{here}{os.pathsep}{path}"}


@contextlib.contextmanager
def _load_processes(env: Env, targets: list[list[str]]) -> Iterator[list[subprocess.Popen[str]]]:
    """One :mod:`benchmarks._load` process per entry of ``targets`` (its arguments), started
    and warmed up; on the way out their stdin is closed (they exit) and any left is killed."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for start in range(0, len(targets), _BATCH):  # a few at a time: 64 cold starts at once
            batch = [subprocess.Popen(_child("_load", *t), env=_child_env(env),  # on 2 cores
                                      stdin=subprocess.PIPE,  # starve them all
                                      stdout=subprocess.PIPE, text=True)
                     for t in targets[start:start + _BATCH]]
            procs += batch
            for p in batch:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"load client {p.args!r} did not start")
        yield procs
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _window(procs: list[subprocess.Popen[str]], seconds: float,
            server_pids: list[int]) -> dict[str, Any]:
    """Let every process go at once for ``seconds``: prompts/s over the window and the server
    CPU (``server_pids``) per prompt."""
    cpu0 = _cpu_of(server_pids)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"go {seconds}\n")
        p.stdin.flush()
    results = []
    for p in procs:
        assert p.stdout is not None
        results.append(json.loads(p.stdout.readline()))
    cpu1 = _cpu_of(server_pids)
    done = sum(r["done"] for r in results)
    return {"clients": len(procs), "prompts_per_s": done / seconds, "prompts": float(done),
            "errors": float(sum(r["errors"] for r in results)), "seconds": seconds,
            "cpu_ms": (cpu1 - cpu0) / max(done, 1) * 1000}


def _median_window(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The windows as one: their total counts, the median rate and CPU per prompt."""
    return {"clients": windows[0]["clients"],
            "prompts_per_s": statistics.median(w["prompts_per_s"] for w in windows),
            "prompts": sum(w["prompts"] for w in windows),
            "errors": sum(w["errors"] for w in windows),
            "seconds": sum(w["seconds"] for w in windows),
            "cpu_ms": statistics.median(w["cpu_ms"] for w in windows),
            "windows": [round(w["prompts_per_s"]) for w in windows]}


def _interleaved(env: Env, clients: int, relays: list[str], relay_pids: list[int],
                 sessions: list[str], agentd_pids: list[int], seconds: float) -> dict[str, Any]:
    """``PAIRS`` pairs of windows of ``seconds``: one of ``clients`` floor clients, one of as
    many prompting clients, taking turns (the first of a pair alternates); the share is the
    median of the pairs' ratios, so a drift of the machine's speed during the run moves both
    sides of a pair alike. Each window's processes are started for it and gone after it: idle
    processes of the other kind would slow the window, and not both kinds alike (in a probe the
    floor's rate was 6-8 % lower with 64 idle prompting clients alive than without)."""
    floor_targets = [["floor", relays[i % SESSIONS]] for i in range(clients)]
    agentd_targets = [["agentd", sessions[i % SESSIONS]] for i in range(clients)]

    def floor() -> dict[str, Any]:
        with _load_processes(env, floor_targets) as procs:
            return _window(procs, seconds, relay_pids)

    def prompts() -> dict[str, Any]:
        with _load_processes(env, agentd_targets) as procs:
            return _window(procs, seconds, agentd_pids)

    floors: list[dict[str, Any]] = []
    prompted: list[dict[str, Any]] = []
    for pair in range(PAIRS):
        if pair % 2 == 0:
            floors.append(floor())
            prompted.append(prompts())
        else:
            prompted.append(prompts())
            floors.append(floor())
    shares = [p["prompts_per_s"] / f["prompts_per_s"]
              for p, f in zip(prompted, floors, strict=True) if f["prompts_per_s"]]
    return {"clients": clients, "floor": _median_window(floors),
            "prompts": _median_window(prompted),
            "share": statistics.median(shares) if shares else None,
            "shares": [round(x, 3) for x in shares]}


def _start_floor(env: Env, path: str, journal: str | None) -> subprocess.Popen[bytes]:
    argv = _child("_floor", path, *([journal] if journal else []))
    server = subprocess.Popen(argv, env=_child_env(env), stdout=subprocess.PIPE,
                              stdin=subprocess.DEVNULL)
    assert server.stdout is not None
    if server.stdout.readline().strip() != b"ready":
        server.kill()
        server.wait()
        raise RuntimeError("a floor server did not start")
    return server


async def _pids_of(env: Env, sessions: list[str]) -> list[int]:
    async with trio_agentd.open_client(
        env.socket, home=env.env["TRIO_AGENTD_HOME"], registry=env.env["TRIO_AGENTD_REGISTRY_DIR"]
    ) as client:
        for s in sessions:
            await client.request("prompt", {"session": s, "text": "warm", "stream": False})
        return await _server_pids(client, sessions)


_BATCH = 8
SESSIONS = 8
CLIENT_PROCESSES = (8, 64)
PAIRS = 3  # windows of the floor's and of the daemon's client processes, taking turns


def run(n: int = 10_000, seconds: float = 20.0, reps: int = 1) -> dict[str, Any]:
    """``reps`` runs of ``n`` sequential prompts (``roundtrip`` is the first, ``roundtrip_runs``
    all of them), each after a run of the floors (``floor_runs``); then one throughput window
    of ``seconds`` (with its per-second counts) of 64 tasks in this process, and for 8 and 64
    client processes ``PAIRS`` windows of the floor and as many of the prompts, taking turns,
    ``seconds`` in all for each (``processes``)."""
    with private_env() as env:
        env.run("-p", "-s", "rt", "warm")
        floor_sock = str(env.root / "s" / "floor.sock")
        servers: list[subprocess.Popen[bytes]] = []
        runs, floors = [], []
        try:
            servers.append(_start_floor(env, floor_sock, None))
            relays = [str(env.root / "s" / f"relay{i}.sock") for i in range(SESSIONS)]
            for i, path in enumerate(relays):
                servers.append(_start_floor(env, path, str(env.home / f"floor-relay{i}.log")))
            relay_pids = [s.pid for s in servers[1:]]
            for _ in range(reps):
                hop = trio.run(_hop, floor_sock, n)
                sync = _fdatasync(str(env.home), min(n, 5_000))
                ahead = _fdatasync(str(env.home), min(n, 5_000), ahead=True)
                relay = trio.run(_relay, relays[0], relay_pids[0], n)
                floors.append({"hop": hop, "fdatasync": sync, "fdatasync_ahead": ahead,
                               "relay": relay,
                               "sum_p50": hop["p50"] + sync["p50"],
                               "sum_p99": hop["p99"] + sync["p99"]})
                runs.append(trio.run(_sequential, env, n))
            thr = trio.run(_throughput, env, 64, SESSIONS, seconds)
            sessions = [f"t{s}" for s in range(SESSIONS)]
            agentd_pids = trio.run(_pids_of, env, sessions)
            procs = [_interleaved(env, clients, relays, relay_pids, sessions, agentd_pids,
                                  seconds / PAIRS)
                     for clients in CLIENT_PROCESSES]
        finally:
            for server in servers:
                server.kill()
                server.wait()
        env.run("shutdown")
    return {"roundtrip": runs[0], "roundtrip_runs": runs, "floor_runs": floors,
            "home_fs": _fs_of(str(env.home)), "throughput": thr, "processes": procs}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    print(f"machine: {machine()}")
    res = run(n, seconds)
    rt, thr = res["roundtrip"], res["throughput"]
    print(f"round trip over {rt['n']:.0f} sequential prompts: p50 {rt['p50']:.3f} ms,"
          f" p99 {rt['p99']:.3f} ms, mean {rt['mean']:.3f} ms")
    print(f"server CPU per prompt {rt['cpu_ms']:.3f} ms (supervisor {rt['supervisor_cpu_ms']:.3f});"
          f" relay-chain floor {res['floor_runs'][0]['relay']['cpu_ms']:.3f} ms,"
          f" p50 {res['floor_runs'][0]['relay']['p50']:.3f} ms")
    print(f"throughput, 64 clients over 8 sessions: {thr['prompts_per_s']:.0f} prompts/s"
          f" ({thr['prompts']:.0f} in {thr['seconds']:.1f} s, {thr['errors']:.0f} errors)")
    for p in res["processes"]:
        print(f"{p['clients']} client processes: {p['prompts']['prompts_per_s']:.0f} prompts/s"
              f" ({p['prompts']['cpu_ms']:.3f} ms CPU each), floor"
              f" {p['floor']['prompts_per_s']:.0f}/s ({p['floor']['cpu_ms']:.3f} ms CPU each);"
              f" share {p['share']:.3f} (pairs {p['shares']})")


if __name__ == "__main__":
    main()
