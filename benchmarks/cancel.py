"""Ctrl-C on ``trio-agentd -p``: the turn's processes gone and the session answering again.

A shell session runs ``sleep 1000 & echo $!; wait`` through the CLI; once the CLI has printed
the background child's pid, the CLI gets SIGINT (what Ctrl-C at a terminal sends it). The clock
runs from that signal to:

- **CLI exit**: the CLI exits 130 once the worker confirmed the cancel;
- **processes gone**: the turn's child (``sleep``) no longer runs (polled in /proc every 1 ms);
- **session answering**: a new ``trio-agentd -p`` to the same session, spawned as soon as the CLI
  exited, has printed its answer (a whole CLI process: what the user's next command costs).

Two agents: one that dies of SIGINT (most programs), and a *stubborn* one that ignores it
(``trap '' INT``), which the runner must escalate: TERM once the cancel grace (the exec
runner's ``KILL_GRACE``) ran out, KILL 0.1 s later. Goal: every figure ≤ the stop grace
(``Timing.stop_grace``) + 100 ms for the stubborn agent; for the well-behaved one we hold
ourselves to 100 ms (it dies of the SIGINT itself: no grace should be spent).

Every process started is killed by pid (found by a marker in its environment), also on errors.
Usage: ``python -m benchmarks.cancel [--quick]``. The last line of stdout is the result as JSON.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

from ._common import Env, machine, private_env, summary
from .recovery import BenchError

TURN = "sleep 1000 & echo $!; wait"
STUBBORN = "trap '' INT; sleep 1000 & echo $!; wait"
MARGIN_S = 0.1


def _graces() -> tuple[float, float]:
    """The code measured's stop grace and its cancel grace (SIGINT → SIGTERM)."""
    from trio_agentd.agents._exec import KILL_GRACE
    from trio_agentd.timing import DEFAULT_TIMING

    return float(DEFAULT_TIMING.stop_grace), float(KILL_GRACE)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def once(env: Env, session: str, script: str) -> dict[str, float]:
    """One Ctrl-C; seconds from the SIGINT to each event."""
    p = subprocess.Popen(env.cli("-p", "-s", session, "--", script), env=env.env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.strip().isdigit():
            raise BenchError(f"turn printed {line[:200]!r}, not a pid")
        child = int(line)
        t0 = time.perf_counter()
        p.send_signal(signal.SIGINT)
        gone: float | None = None
        deadline = t0 + 30
        while p.poll() is None:
            if gone is None and not _running(child):
                gone = time.perf_counter() - t0
            if time.perf_counter() > deadline:
                raise BenchError("the CLI did not exit within 30 s of SIGINT")
            time.sleep(0.001)
        exited = time.perf_counter() - t0
        _, err = p.communicate(timeout=5)
        if p.returncode != 130:
            raise BenchError(f"CLI exited {p.returncode} after SIGINT: {err[:300]!r}")
        while gone is None:
            if not _running(child):
                gone = time.perf_counter() - t0
            elif time.perf_counter() > deadline:
                raise BenchError(f"the turn's child {child} still runs 30 s after SIGINT")
            else:
                time.sleep(0.001)
        nxt = subprocess.run(env.cli("-p", "-s", session, "--", "echo next"), env=env.env,
                             stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        answered = time.perf_counter() - t0
        if nxt.returncode != 0 or nxt.stdout != b"next\n":
            raise BenchError(f"next prompt: {nxt.returncode} {nxt.stdout[:100]!r}"
                             f" {nxt.stderr[:200]!r}")
        return {"exit": exited, "gone": gone, "answered": answered}
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def run(reps: int) -> dict[str, Any]:
    # the CLI must get SIGINT as it does at a terminal. A runner started in the background of
    # a non-interactive shell (`python -m benchmarks &`) ignores SIGINT, and an ignored signal
    # stays ignored across fork and exec: the CLI would never see its Ctrl-C (two full runs
    # recorded "did not exit within 30 s" that way). A handler here is reset to the default
    # by exec, so every CLI this figure starts gets SIGINT with Python's own handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stop_grace, kill_grace = _graces()
    out: dict[str, Any] = {"stop_grace_s": stop_grace, "kill_grace_s": kill_grace,
                           "margin_s": MARGIN_S, "reps": reps}
    with private_env() as env:
        for name, script in (("plain", TURN), ("stubborn", STUBBORN)):
            session = f"c-{name}"
            env.run("-p", "-s", session, "--agent", "shell", "--", "true")  # worker up
            samples: dict[str, list[float]] = {"exit": [], "gone": [], "answered": []}
            for _ in range(reps if name == "plain" else max(3, reps // 4)):
                got = once(env, session, script)
                for k, v in got.items():
                    samples[k].append(v)
                print(f"  {name}: exit {got['exit'] * 1000:7.1f} ms  gone"
                      f" {got['gone'] * 1000:7.1f} ms  answered {got['answered'] * 1000:7.1f} ms",
                      file=sys.stderr)
            out[name] = {k: summary(v) for k, v in samples.items()}
            out[name]["goal_ms"] = ((stop_grace if name == "stubborn" else 0.0) + MARGIN_S) * 1000
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    print(f"machine: {machine()}")
    res = run(8 if quick else 20)
    for name in ("plain", "stubborn"):
        r = res[name]
        for k in ("exit", "gone", "answered"):
            s = r[k]
            print(f"{name:9s} {k:9s} median {s['median']:7.1f} ms  min {s['min']:7.1f}  max"
                  f" {s['max']:7.1f}  goal ≤ {r['goal_ms']:.0f} ms")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
