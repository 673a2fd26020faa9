"""Prompt round trip (in-process Trio client, echo agent, durable journal) and throughput.

Usage: ``python -m benchmarks.roundtrip [N] [SECONDS]`` — N sequential prompts (default
10,000), then 64 concurrent clients over 8 sessions for SECONDS (default 20).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import trio

import trio_agentd

from ._common import Env, machine, private_env


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


async def _sequential(env: Env, n: int) -> dict[str, float]:
    async with trio_agentd.open_client(
        env.socket, home=env.env["TRIO_AGENTD_HOME"], registry=env.env["TRIO_AGENTD_REGISTRY_DIR"]
    ) as client:
        for _ in range(50):
            await client.request("prompt", {"session": "rt", "text": "warm", "stream": False})
        samples = []
        for i in range(n):
            t0 = time.perf_counter()
            await client.request("prompt", {"session": "rt", "text": f"p{i}", "stream": False})
            samples.append(time.perf_counter() - t0)
    return {"p50": _pct(samples, 0.5), "p99": _pct(samples, 0.99),
            "mean": statistics.fmean(samples) * 1000, "n": float(n)}


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
    all of them), then one throughput window of ``seconds`` (with its per-second counts)."""
    with private_env() as env:
        env.run("-p", "-s", "rt", "warm")
        runs = [trio.run(_sequential, env, n) for _ in range(reps)]
        thr = trio.run(_throughput, env, 64, 8, seconds)
        env.run("shutdown")
    return {"roundtrip": runs[0], "roundtrip_runs": runs, "throughput": thr}


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
