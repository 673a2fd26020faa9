"""``ps --json`` and ``doctor`` with 1 and 20 daemons, and ``doctor --fix`` to a relaunched
daemon answering.

Usage: ``python -m benchmarks.doctor [N]``. Whole-process timings, interleaved with
``python -c pass`` (A B C A B C …) so the ratio survives machine noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from ._common import Env, machine, private_env, summary, timed


def _start_daemons(env: Env, count: int) -> list[str]:
    sockets = [env.socket] + [str(env.root / "s" / f"d{i}.sock") for i in range(1, count)]
    procs = [subprocess.Popen(env.cli("--socket", s, "-p", "-s", f"s{i}", "hi"), env=env.env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i, s in enumerate(sockets)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    return sockets


def ps_figure(n_runs: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for count in (1, 20):
        with private_env() as env:
            env.env["XDG_RUNTIME_DIR"] = str(env.root / "run")
            (env.root / "run").mkdir(mode=0o700)
            _start_daemons(env, count)
            rows = json.loads(env.run("ps", "--json").stdout)
            assert len(rows) == count, rows
            assert all(r["status"] == "current" for r in rows), rows
            base, ps, doc = [], [], []
            for _ in range(n_runs):
                base.append(timed([sys.executable, "-c", "pass"]))
                ps.append(timed(env.cli("ps", "--json"), env.env))
                doc.append(timed(env.cli("doctor"), env.env))  # exit 0: nothing wedged
            env.run("shutdown", "--all")
        out[f"python -c pass ({count})"] = summary(base)
        out[f"ps --json, {count} daemon(s)"] = summary(ps)
        out[f"doctor, {count} daemon(s)"] = summary(doc)
    return out


def doctor_fix_figure(n_runs: int) -> dict[str, float]:
    samples = []
    for _ in range(n_runs):
        with private_env() as env:
            env.env["XDG_RUNTIME_DIR"] = str(env.root / "run")
            env.env["TRIO_AGENTD_SELF_HEAL"] = "0"
            (env.root / "run").mkdir(mode=0o700)
            env.run("-p", "-s", "keep", "hi")
            rec = next((env.root / "reg").glob("*.owner"))
            (rec / "owner.json").unlink()
            t0 = time.perf_counter()
            subprocess.run(env.cli("doctor", "--fix"), env=env.env, check=True,
                           stdout=subprocess.DEVNULL)
            # doctor returns once the relaunched supervisor answers hello; a prompt proves it
            env.run("-p", "-s", "keep", "after")
            samples.append(time.perf_counter() - t0)
            env.run("shutdown", "--all")
    return summary(samples)


def run(n: int = 15, fix_runs: int | None = None) -> dict[str, Any]:
    """``ps --json`` and ``doctor`` (``n`` interleaved runs each), ``doctor --fix``; as data."""
    ps = ps_figure(n)
    ratios = {f"{cmd}, {count} daemon(s)":
              ps[f"{cmd}, {count} daemon(s)"]["median"] / ps[f"python -c pass ({count})"]["median"]
              for count in (1, 20) for cmd in ("ps --json", "doctor")}
    fix = doctor_fix_figure(fix_runs if fix_runs is not None else max(3, n // 3))
    return {"ps": ps, "ratios": ratios, "doctor_fix": fix}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    print(f"machine: {machine()}")
    res = run(n)
    ps, fix = res["ps"], res["doctor_fix"]
    for name, s in ps.items():
        print(f"{name:32s} median {s['median']:7.1f} ms  min {s['min']:7.1f}  max {s['max']:7.1f}")
    for name, ratio in res["ratios"].items():
        print(f"{name}: {ratio:.2f}x python -c pass")
    print(f"{'doctor --fix → prompt answered':32s} median {fix['median']:7.1f} ms  min"
          f" {fix['min']:7.1f}  max {fix['max']:7.1f}  (n={fix['n']:.0f})")
    if os.environ.get("BENCH_JSON"):
        print(json.dumps({"ps": ps, "doctor_fix": fix}))


if __name__ == "__main__":
    main()
