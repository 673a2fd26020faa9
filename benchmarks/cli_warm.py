"""CLI warm path: ``trio-agentd -p hi`` against a running daemon vs ``python -c pass``.

Runs are interleaved (A B A B …) so machine noise hits both alike; the ratio of medians is the
figure. Usage: ``python -m benchmarks.cli_warm [N]``.
"""

from __future__ import annotations

import sys
from typing import Any

from ._common import machine, private_env, summary, timed

BASE = "python -c pass"
CLI = "trio-agentd -p hi (warm)"


def run(n: int = 40) -> dict[str, Any]:
    """Both commands ``n`` times, interleaved; their summaries and the ratio of medians."""
    with private_env() as env:
        env.run("-p", "warm up")
        base, cli = [], []
        for _ in range(n):
            base.append(timed([sys.executable, "-c", "pass"]))
            cli.append(timed(env.cli("-p", "hi"), env.env))
        env.run("shutdown")
    result: dict[str, Any] = {BASE: summary(base), CLI: summary(cli)}
    result["ratio"] = result[CLI]["median"] / result[BASE]["median"]
    return result


def main(n: int = 40) -> dict[str, Any]:
    result = run(n)
    print(f"machine: {machine()}")
    for name in (BASE, CLI):
        s = result[name]
        print(f"{name:28s} median {s['median']:7.1f} ms  min {s['min']:7.1f}  max {s['max']:7.1f}"
              f"  (n={s['n']:.0f})")
    print(f"ratio of medians: {result['ratio']:.2f}x")
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
