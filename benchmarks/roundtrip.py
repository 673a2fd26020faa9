"""Prompt round trip (in-process Trio client, echo agent, durable journal) and throughput.

The round trip is measured with its floors, in the same run and interleaved with it (floor run,
prompt run, floor run, …):

- **hop**: one request/response over a Unix socket between two Trio processes (a tiny echo
  server, :mod:`benchmarks._floor`, run by this venv's python), a message the size of a prompt;
- **fdatasync**: one small append to a file in the daemon's home dir plus ``os.fdatasync``, the
  durability each prompt's journal needs.

The prompts go over the direct route (the Trio client asks the supervisor for the route once,
then talks to the session's worker); the client's ``reroutes``/``reconnects`` are reported.

Usage: ``python -m benchmarks.roundtrip [N] [SECONDS]`` — N sequential prompts (default
10,000), then 64 concurrent clients over 8 sessions for SECONDS (default 20).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
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


async def _sequential(env: Env, n: int) -> dict[str, float]:
    async with trio_agentd.open_client(
        env.socket, home=env.env["TRIO_AGENTD_HOME"], registry=env.env["TRIO_AGENTD_REGISTRY_DIR"]
    ) as client:
        for _ in range(50):
            await client.request("prompt", {"session": "rt", "text": "warm", "stream": False})
        r = await client.request("prompt", {"session": "rt", "text": "check", "stream": False})
        if not echo_ok(r, "check"):
            raise RuntimeError(f"wrong answer {r!r}")
        samples = []
        for i in range(n):
            t0 = time.perf_counter()
            await client.request("prompt", {"session": "rt", "text": f"p{i}", "stream": False})
            samples.append(time.perf_counter() - t0)
        return _stats(samples, reroutes=float(client.reroutes),
                      reconnects=float(client.reconnects))


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


def _fdatasync(directory: str, n: int) -> dict[str, float]:
    path = os.path.join(directory, "floor-fdatasync.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    line = b'{"rec":"accepted","id":"0123456789abcdef/123","text":"p1234"}\n'
    samples = []
    try:
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


def run(n: int = 10_000, seconds: float = 20.0, reps: int = 1) -> dict[str, Any]:
    """``reps`` runs of ``n`` sequential prompts (``roundtrip`` is the first, ``roundtrip_runs``
    all of them), each after a run of both floors (``floor_runs``); then one throughput window
    of ``seconds`` (with its per-second counts)."""
    with private_env() as env:
        env.run("-p", "-s", "rt", "warm")
        floor_sock = str(env.root / "s" / "floor.sock")
        server = subprocess.Popen([sys.executable, "-m", "benchmarks._floor", floor_sock],
                                  env=env.env, stdout=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL)
        runs, floors = [], []
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != b"ready":
                raise RuntimeError("the floor echo server did not start")
            for _ in range(reps):
                hop = trio.run(_hop, floor_sock, n)
                sync = _fdatasync(str(env.home), min(n, 5_000))
                floors.append({"hop": hop, "fdatasync": sync,
                               "sum_p50": hop["p50"] + sync["p50"],
                               "sum_p99": hop["p99"] + sync["p99"]})
                runs.append(trio.run(_sequential, env, n))
        finally:
            server.kill()
            server.wait()
        thr = trio.run(_throughput, env, 64, 8, seconds)
        env.run("shutdown")
    return {"roundtrip": runs[0], "roundtrip_runs": runs, "floor_runs": floors,
            "home_fs": _fs_of(str(env.home)), "throughput": thr}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    print(f"machine: {machine()}")
    res = run(n, seconds)
    rt, thr = res["roundtrip"], res["throughput"]
    print(f"round trip over {rt['n']:.0f} sequential prompts: p50 {rt['p50']:.3f} ms,"
          f" p99 {rt['p99']:.3f} ms, mean {rt['mean']:.3f} ms")
    print(f"throughput, 64 clients over 8 sessions: {thr['prompts_per_s']:.0f} prompts/s"
          f" ({thr['prompts']:.0f} in {thr['seconds']:.1f} s, {thr['errors']:.0f} errors)")


if __name__ == "__main__":
    main()
