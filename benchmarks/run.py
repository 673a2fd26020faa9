"""Run every benchmark figure and write ``docs/benchmarks.md``, ``docs/benchmarks.json`` and the
recovery plot ``docs/benchmarks-recovery.png``.

Usage: ``python -m benchmarks [--quick] [--only NAME,NAME] [--out DIR]``.

Each figure runs in its own child process (``python -m benchmarks.run --child NAME``), with a
deadline: a figure that fails or hangs records its error and the run goes on. Everything a child
starts inherits a marker in its environment (``TA_BENCH_RUNNER=<id>``); after each figure the
runner kills whatever still carries it (the figures kill what they start themselves; a leftover
is reported as a leak). Verdicts against the goals are computed from the numbers of
this run, never written by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _venv

REPO = Path(__file__).resolve().parent.parent
RUNNER_MARKER = "TA_BENCH_RUNNER"
PLOT_NAME = "benchmarks-recovery.png"

Data = dict[str, Any]


# --- the figures ---------------------------------------------------------------------------------


def _cli_warm(quick: bool) -> Data:
    from . import cli_warm

    return cli_warm.run(20 if quick else 40)


def _roundtrip(quick: bool) -> Data:
    from . import roundtrip

    return roundtrip.run(2_000 if quick else 10_000, 5.0 if quick else 20.0, reps=3)


def _startup(quick: bool) -> Data:
    from . import startup

    return startup.run(quick)


def _streaming(quick: bool) -> Data:
    from . import streaming

    return streaming.run(quick)


def _recovery(quick: bool) -> Data:
    from . import recovery

    # each size on its own: a failed repetition (recorded, never retried) loses that size only
    sizes = [10, 50] if quick else [10, 50, 100]
    t0 = time.monotonic()
    rows: list[Data] = []
    errors: list[Data] = []
    for n in sizes:
        try:
            rows += recovery.supervisor_kill(n, 2 if quick else 3, (1, recovery.POOL))
        except Exception as exc:
            errors.append({"sessions": n, "error": f"{type(exc).__name__}: {exc}"})
    worker: Data | None = None
    try:
        worker = recovery.worker_kill(10 if quick else 20)
    except Exception as exc:
        errors.append({"worker_kill": True, "error": f"{type(exc).__name__}: {exc}"})
    if not rows and worker is None:
        raise RuntimeError("; ".join(e["error"] for e in errors))
    return {"supervisor_kill": rows, "worker_kill": worker, "errors": errors,
            "total_s": round(time.monotonic() - t0, 1)}


def _dataplane(quick: bool) -> Data:
    from . import dataplane

    return dataplane.run(quick)


def _footprint(quick: bool) -> Data:
    from . import footprint

    return footprint.run(quick)


def _doctor(quick: bool) -> Data:
    from . import doctor

    return doctor.run(7 if quick else 15, 3 if quick else 5)


def _cancel(quick: bool) -> Data:
    from . import cancel

    return cancel.run(8 if quick else 20)


def _peers(quick: bool) -> Data:
    try:
        peers: Any = importlib.import_module("benchmarks.peers")
    except Exception as exc:
        raise RuntimeError(f"benchmarks/peers.py does not import: {exc!r}") from exc
    fn = getattr(peers, "run", None)
    if not callable(fn):
        raise RuntimeError("benchmarks/peers.py has no run(quick) function")
    out = fn(quick=quick)
    if not isinstance(out, dict):
        raise RuntimeError(f"peers.run returned {type(out).__name__}, not a dict")
    return out


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    fn: Callable[[bool], Data]
    timeout: float  # seconds, full run; quick runs get half


FIGURES = [
    Figure("cli_warm", "CLI warm prompt", _cli_warm, 180),
    Figure("roundtrip", "Prompt round trip and throughput", _roundtrip, 600),
    Figure("streaming", "Streaming: one session, 16 sessions, memory", _streaming, 900),
    Figure("startup", "Cold start and concurrent launches", _startup, 300),
    Figure("recovery", "Recovery after kill -9", _recovery, 600),
    Figure("dataplane", "Data plane: supervisor kill -9 under streams and routed sessions",
           _dataplane, 900),
    Figure("footprint", "Idle cost, memory and scale", _footprint, 600),
    Figure("doctor", "ps --json, doctor, doctor --fix", _doctor, 300),
    Figure("cancel", "Ctrl-C on a running prompt", _cancel, 300),
    Figure("peers", "Peers: supervisord, circus, pm2", _peers, 900),
]
BY_NAME = {f.name: f for f in FIGURES}


# --- child side ----------------------------------------------------------------------------------


def _child(name: str, quick: bool, out: Path) -> int:
    def term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds the figure's context managers: they kill what they ran

    signal.signal(signal.SIGTERM, term)
    t0 = time.perf_counter()
    result: Data
    try:
        if os.environ.get("TA_BENCH_ALLOW_SOURCE") != "1":
            _venv.check_self()  # NotInstalled: an editable install or the source tree
        result = {"data": BY_NAME[name].fn(quick)}
    except KeyboardInterrupt:
        result = {"error": "interrupted (SIGTERM or Ctrl-C); what it started was killed"}
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result, default=str))
    return 0 if "data" in result else 1


# --- parent side: processes ----------------------------------------------------------------------


def _marked(marker: bytes) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            with contextlib.suppress(OSError), open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    out.append(int(name))
    return out


def _sweep(marker: bytes) -> list[str]:
    """SIGKILL every live process carrying ``marker``; their command lines (zombies skipped)."""
    hit = []
    for pid in _marked(marker):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError):
            continue
        hit.append(f"{pid}: {cmd[:160]}")
    return hit


def _run_child(fig: Figure, quick: bool, tmp: Path, runner_id: str, venv: Data) -> Data:
    out = tmp / f"{fig.name}.json"
    env = _venv.child_env(venv)
    env[RUNNER_MARKER] = runner_id
    # the bench venv's python, -P: the cwd (the repo, with its source tree) is not on sys.path
    argv = [venv["python"], "-P", "-m", "benchmarks.run", "--child", fig.name, "--out", str(out)]
    if quick:
        argv.append("--quick")
    timeout = fig.timeout / 2 if quick else fig.timeout
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        raise
    result: Data
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"error": f"the figure's process exited {proc.returncode} without a result"}
    if timed_out:
        result = {"error": f"did not finish within its deadline of {timeout:.0f} s",
                  "partial": result}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    leaked = _sweep(f"{RUNNER_MARKER}={runner_id}".encode())
    if leaked:
        result["leaked"] = leaked
    return result


# --- machine -------------------------------------------------------------------------------------


def _meminfo_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1024 * 1024)
    return None


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def code_info() -> Data:
    """The commit measured, and whether the package had uncommitted changes."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "trio_agentd", "pyproject.toml")
    return {"commit": (git("rev-parse", "--short", "HEAD") or "").strip() or None,
            "commit_full": (git("rev-parse", "HEAD") or "").strip() or None,
            "subject": (git("log", "-1", "--format=%s") or "").strip(),
            "uncommitted": [line[3:] for line in (dirty or "").splitlines() if line.strip()]}


def machine_info() -> Data:
    import trio

    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {"cores": os.cpu_count(), "usable_cores": affinity, "cpu": _cpu_model(),
            "memory_gib": _meminfo_gib(), "python": platform.python_version(),
            "trio": trio.__version__, "kernel": f"{platform.system()} {platform.release()}",
            "arch": platform.machine()}


# --- numbers and verdicts ------------------------------------------------------------------------


def num(x: Any, unit: str = "") -> str:
    if not isinstance(x, int | float) or x != x:
        return "—"
    a = abs(float(x))
    if float(x).is_integer():
        s = f"{int(x):,}"
    else:
        s = (f"{x:,.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1
             else f"{x:.3f}")
    if unit == "x":
        return f"{s}x"
    return f"{s} {unit}".strip() if unit else s


def verdict(value: Any, goal: float, *, at_most: bool = True, unit: str = "") -> str:
    """``met`` / ``missed`` computed from ``value``, with how far off a miss is."""
    if not isinstance(value, int | float) or value != value:
        return "not measured"
    ok = value <= goal if at_most else value >= goal
    if ok:
        return "met"
    if at_most:
        return f"missed: {num(value, unit)} is {value / goal:.2f}x the goal"
    return f"missed: {num(value, unit)} is {100 * value / goal:.0f} % of the goal"


def get(d: Any, *keys: Any) -> Any:
    """``d[k1][k2]…`` or ``None`` if any step is missing or the wrong type."""
    for k in keys:
        found = ((isinstance(d, dict) and k in d)
                 or (isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d)))
        if not found:
            return None
        d = d[k]
    return d


def _mmm(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    mid = len(s) // 2
    median = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
    return {"median": median, "min": s[0], "max": s[-1], "n": float(len(s))}


class Doc:
    """The markdown being written, plus the goals summary collected on the way."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.goals: list[tuple[str, str, str, str]] = []  # figure, measured, goal, verdict

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.add("| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|")
        for r in rows:
            self.add("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in r)
                     + " |")
        self.add("")

    def goal(self, figure: str, measured: str, goal: str, v: str) -> str:
        self.goals.append((figure, measured, goal, v))
        return v


def _stat_row(label: str, s: Any, unit: str, goal: str = "", v: str = "") -> list[str]:
    if not isinstance(s, dict):
        return [label, "—", "—", "—", "—", goal, v or "not measured"]
    return [label, num(s.get("median"), unit), num(s.get("min"), unit), num(s.get("max"), unit),
            num(s.get("n")) if isinstance(s.get("n"), int | float) else "—", goal, v]


HEAD = ["measure", "median", "min", "max", "n", "goal", "verdict"]


def _failed(doc: Doc, res: Data) -> bool:
    """Write the figure's error (if any) and whether it has data to render."""
    if "error" in res:
        doc.add(f"**This figure failed:** `{res['error']}`", "")
        tb = res.get("traceback")
        if tb:
            doc.add("<details><summary>traceback</summary>", "", "```", str(tb).strip(), "```",
                    "", "</details>", "")
    if res.get("leaked"):
        doc.add(f"**Leaked processes** (killed by the runner afterwards): "
                f"{len(res['leaked'])}, e.g. `{res['leaked'][0]}`", "")
    return isinstance(res.get("data"), dict)


# --- sections ------------------------------------------------------------------------------------


RT_P50, RT_P99 = 0.35, 1.0  # ms


def sec_roundtrip(doc: Doc, res: Data) -> None:
    doc.add("## Prompt round trip and throughput", "",
            "In-process Trio client (`trio_agentd.open_client`), echo agent, `stream: False`, "
            "durable journal; the prompt goes over the session's direct route (the worker "
            "itself). Round trip: sequential prompts to one session, p50 and p99 per run, "
            "median/min/max over the runs (same daemon). Floors, measured in the same run just "
            "before each prompt run: one request/response hop over a Unix socket between two "
            "Trio processes (a tiny echo server, `benchmarks/_floor.py`) and one small append + "
            "`os.fdatasync` on the filesystem of the daemon's home (for comparison, not as a "
            "floor: the same record written into zeros written and flushed before, as the worker's "
            "journal writes its records, so that the flush writes no inode); and the "
            "*relay-chain floor*: "
            "the hops a prompt makes now and nothing else — a prompt goes from the client "
            "straight to its session's worker, which makes one record durable and answers, so "
            "the floor is a tiny Trio server (`benchmarks/_floor.py` with a journal file) that "
            "per request line appends one small record, `fdatasync`s it and writes one response "
            "line. Server CPU per prompt: utime + stime (`/proc/PID/stat`) of the supervisor and "
            "the session's worker over a run, divided by its prompts; the floor's is its "
            "server's, per request. Throughput: 64 concurrent clients (tasks of one process) "
            "over 8 sessions for one window, the spread over its 1-second buckets; then 8 and 64 "
            "client *processes* (`benchmarks/_load.py`, started and warmed up, then let go at "
            "once) over 8 sessions, against as many client processes over 8 relay-chain floor "
            "servers (one per session) in the same run: three pairs of windows (a third of the "
            "time each), the two kinds taking turns, each window's processes started for it and "
            "gone after it; the share of the floor is the median of the pairs' ratios.",
            "")
    if not _failed(doc, res):
        doc.goal("round trip p50", "—", f"≤ {RT_P50} ms", "not measured")
        doc.goal("round trip p99", "—", f"≤ {RT_P99:g} ms", "not measured")
        return
    d = res["data"]
    runs = [r for r in d.get("roundtrip_runs") or [d.get("roundtrip")] if isinstance(r, dict)]
    floors = [f for f in d.get("floor_runs") or [] if isinstance(f, dict)]
    rows = []
    n = get(runs, 0, "n")
    fsum50 = _mmm([f["sum_p50"] for f in floors]) if floors else None
    fsum99 = _mmm([f["sum_p99"] for f in floors]) if floors else None
    if runs:
        p50, p99 = _mmm([r["p50"] for r in runs]), _mmm([r["p99"] for r in runs])
        mean = _mmm([r["mean"] for r in runs])
        over = (f" (floor {num(fsum50['median'], 'ms')}: {p50['median'] / fsum50['median']:.1f}x"
                " the floor)" if fsum50 else "")
        v50 = doc.goal("round trip p50", num(p50["median"], "ms") + over, f"≤ {RT_P50} ms",
                       verdict(p50["median"], RT_P50, unit="ms"))
        v99 = doc.goal("round trip p99", num(p99["median"], "ms"), f"≤ {RT_P99:g} ms",
                       verdict(p99["median"], RT_P99, unit="ms"))
        rows += [_stat_row(f"p50 per run of {num(n)} prompts (ms)", p50, "", f"≤ {RT_P50} ms",
                           v50),
                 _stat_row(f"p99 per run of {num(n)} prompts (ms)", p99, "", f"≤ {RT_P99:g} ms",
                           v99),
                 _stat_row("mean per run (ms)", mean, ""),
                 ["client reroutes / reconnects during the runs",
                  f"{num(sum(r.get('reroutes', 0) for r in runs))} / "
                  f"{num(sum(r.get('reconnects', 0) for r in runs))}", "—", "—", "—", "", ""]]
    if floors:
        for key, label in (("hop", "floor: Unix-socket hop between two processes"),
                           ("fdatasync", f"floor: append + fdatasync ({d.get('home_fs')})")):
            rows.append(_stat_row(f"{label}, p50 (ms)", _mmm([f[key]["p50"] for f in floors]), ""))
            rows.append(_stat_row(f"{label}, p99 (ms)", _mmm([f[key]["p99"] for f in floors]), ""))
        ahead = [f["fdatasync_ahead"]["p50"] for f in floors if "fdatasync_ahead" in f]
        if ahead:  # not a floor: how the journal writes (what it spares itself against one)
            rows.append(_stat_row("… for comparison: a record written into zeros written ahead"
                                  " (as the worker's journal does) + fdatasync, p50 (ms)",
                                  _mmm(ahead), ""))
        rows.append(_stat_row("floor sum (hop + fdatasync), p50 (ms)", fsum50, ""))
        rows.append(_stat_row("floor sum (hop + fdatasync), p99 (ms)", fsum99, ""))
    thr = d.get("throughput") or {}
    rate = thr.get("prompts_per_s")
    vt = doc.goal("throughput", num(rate, "prompts/s"), "≥ 5,000 prompts/s",
                  verdict(rate, 5000, at_most=False, unit="prompts/s"))
    buckets = [float(x) for x in thr.get("per_second") or []]
    if buckets:
        rows.append(_stat_row("throughput per 1 s bucket (prompts/s)", _mmm(buckets), ""))
    rows.append([f"throughput over {num(thr.get('seconds'))} s (prompts/s)", num(rate), "—", "—",
                 "1", "≥ 5,000", vt])
    rows.append(["errors during the throughput window", num(thr.get("errors")), "—", "—", "—",
                 "", ""])
    _cpu_and_processes(doc, d, runs, floors, rows)
    doc.table(HEAD, rows)


CPU_FLOOR_FACTOR = 2.0  # server CPU per prompt: at most this many times the relay chain's
THROUGHPUT_SHARE = 0.5  # client processes' throughput: at least this share of the relay chain's


def _cpu_and_processes(doc: Doc, d: Data, runs: list[Data], floors: list[Data],
                       rows: list[list[str]]) -> None:
    """Server CPU per prompt against the relay-chain floor's, and throughput of client
    processes against the floor's at the same client counts (goal rows and table rows)."""
    relays = [f["relay"] for f in floors if isinstance(f.get("relay"), dict)]
    cpu_runs = [r for r in runs if isinstance(r.get("cpu_ms"), int | float)]
    if relays:
        rows.append(_stat_row("relay-chain floor (client → server: append + fdatasync, answer),"
                              " p50 (ms)", _mmm([r["p50"] for r in relays]), ""))
        rows.append(_stat_row("relay-chain floor, p99 (ms)", _mmm([r["p99"] for r in relays]),
                              ""))
        rows.append(_stat_row("relay-chain floor: server CPU per request (ms)",
                              _mmm([r["cpu_ms"] for r in relays]), ""))
    if cpu_runs:
        cpu = _mmm([r["cpu_ms"] for r in cpu_runs])
        sup = _mmm([r.get("supervisor_cpu_ms", 0.0) for r in cpu_runs])
        floor_cpu = _mmm([r["cpu_ms"] for r in relays])["median"] if relays else None
        goal = f"≤ {CPU_FLOOR_FACTOR:g}x the relay-chain floor"
        if floor_cpu:
            ratio = cpu["median"] / floor_cpu
            measured = (f"{num(cpu['median'], 'ms')} (floor {num(floor_cpu, 'ms')}:"
                        f" {ratio:.2f}x)")
            v = doc.goal("server CPU per prompt (supervisor + worker)", measured, goal,
                         verdict(ratio, CPU_FLOOR_FACTOR, unit="x"))
        else:
            v = doc.goal("server CPU per prompt (supervisor + worker)", num(cpu["median"], "ms"),
                         goal, "not measured")
        rows.append(_stat_row("server CPU per prompt, supervisor + worker (ms)", cpu, "", goal,
                              v))
        rows.append(_stat_row("… of which the supervisor (ms)", sup, ""))
    for p in d.get("processes") or []:
        if not isinstance(p, dict):
            continue
        clients, prompts, floor = p.get("clients"), p.get("prompts") or {}, p.get("floor") or {}
        rate, frate = prompts.get("prompts_per_s"), floor.get("prompts_per_s")
        share = p.get("share")  # the median of interleaved pairs' ratios
        if not isinstance(share, int | float):
            share = rate / frate if isinstance(rate, int | float) and frate else None
        goal = f"≥ {100 * THROUGHPUT_SHARE:.0f} % of the floor"
        pairs = ", ".join(f"{100 * x:.0f}" for x in p.get("shares") or [])
        measured = (f"{num(rate, 'prompts/s')}: {100 * share:.0f} % of the floor's"
                    f" {num(frate, '/s')} (median of the interleaved pairs' ratios: {pairs} %)"
                    if share is not None else num(rate, "prompts/s"))
        v = doc.goal(f"throughput, {clients} client processes over 8 sessions", measured, goal,
                     verdict(100 * share, 100 * THROUGHPUT_SHARE, at_most=False, unit="% of"
                             " the floor") if share is not None else "not measured")
        rows.append([f"{clients} client processes over 8 sessions (prompts/s)", num(rate), "—",
                     "—", "1", goal, v])
        rows.append([f"… relay-chain floor, {clients} client processes over 8 servers"
                     " (requests/s)", num(frate), "—", "—", "1", "", ""])
        rows.append([f"… server CPU per prompt / per floor request, {clients} client processes"
                     " (ms)", f"{num(prompts.get('cpu_ms'))} / {num(floor.get('cpu_ms'))}", "—",
                     "—", "1", "", ""])
        rows.append([f"… errors, {clients} client processes", num(prompts.get("errors")), "—",
                     "—", "—", "", ""])


def sec_streaming(doc: Doc, res: Data) -> None:
    doc.add("## Streaming", "",
            "One session: the bench venv's CLI, `trio-agentd -p -s s1 --agent shell -- 'head -c "
            "SIZE /dev/zero' > /dev/null`, timed as a whole process after a warm-up prompt on "
            "the same session, interleaved with the plain pipe `head -c SIZE /dev/zero | cat > "
            "/dev/null`; the figure is the ratio of the median throughputs. 16 sessions: 16 such "
            "CLI processes at once (each its own session), first spawn to last exit, against "
            "16 plain pipes at once, and against the same bytes written into 16 files on the "
            "daemon's filesystem at once (`head -c SIZE /dev/zero > FILE`): what keeping a "
            "turn's output for a resend costs at the least. Memory: an in-process Trio client "
            "streams SIZE bytes (`stream_prompt_bytes`, direct route), reading at full speed, "
            "and reading 1 MB, "
            "pausing 10 s, then the rest; `VmRSS` of the supervisor and the session's worker "
            "sampled every 50 ms; growth = peak - RSS just before the prompt.", "")
    if not _failed(doc, res):
        for g, goal in (("stream 1 GB, one session", "≥ 50 % of a plain pipe"),
                        ("stream, 16 sessions at once", "≥ 50 % of 16 plain pipes"),
                        ("RSS growth while streaming", "≤ 20 MB")):
            doc.goal(g, "—", goal, "not measured")
        return
    d = res["data"]
    for part, err in (d.get("errors") or {}).items():
        doc.add(f"**Part `{part}` failed:** `{err}`", "")
    rows = []
    one = d.get("one")
    if isinstance(one, dict):
        size = f"{one['bytes'] / 1e6:,.0f} MB"
        ratio = float(one.get("ratio") or 0.0)
        v = doc.goal(f"stream {size}, one session (CLI → /dev/null)",
                     f"{num(get(one, 'cli_MBps', 'median'), 'MB/s')} = "
                     f"{100 * ratio:.1f} % of the pipe's "
                     f"{num(get(one, 'pipe_MBps', 'median'), 'MB/s')}",
                     "≥ 50 % of a plain pipe", verdict(100 * ratio, 50, at_most=False, unit="%"))
        rows += [_stat_row(f"plain pipe, {size} (MB/s)", one.get("pipe_MBps"), ""),
                 _stat_row(f"`trio-agentd -p … --agent shell`, {size} → /dev/null (MB/s)",
                           one.get("cli_MBps"), "", "≥ 50 % of the pipe", v),
                 _stat_row("… whole command (s)", one.get("cli_s"), ""),
                 ["ratio of medians", f"{100 * ratio:.1f} %", "—", "—", "—", "≥ 50 %", v]]
        for who in ("supervisor", "worker", "cli"):
            rows.append(_stat_row(f"… CPU seconds per stream: {who}", get(one, "cpu_s", who), ""))
    many = d.get("many")
    if isinstance(many, dict):
        ratio = float(many.get("ratio") or 0.0)
        each = f"{many['bytes_each'] / 1e6:,.0f} MB"
        v = doc.goal(f"stream, {many['sessions']} sessions at once ({each} each)",
                     f"{num(get(many, 'cli_MBps', 'median'), 'MB/s')} aggregate = "
                     f"{100 * ratio:.1f} % of {many['sessions']} pipes' "
                     f"{num(get(many, 'pipe_MBps', 'median'), 'MB/s')}",
                     "≥ 50 % of 16 plain pipes", verdict(100 * ratio, 50, at_most=False, unit="%"))
        rows += [_stat_row(f"{many['sessions']} plain pipes at once, {each} each, aggregate "
                           "(MB/s)", many.get("pipe_MBps"), ""),
                 _stat_row(f"{many['sessions']} CLI streams at once, {each} each, aggregate "
                           "(MB/s)", many.get("cli_MBps"), "", "≥ 50 % of the pipes", v)]
        if isinstance(many.get("file_MBps"), dict):
            file_ratio = float(many.get("file_ratio") or 0.0)
            rows += [_stat_row(f"… the same bytes into {many['sessions']} files at once, no "
                               "socket, no Python (MB/s)", many.get("file_MBps"), ""),
                     ["… files / pipes; CLI streams / files",
                      f"{100 * file_ratio:.1f} %; "
                      f"{100 * ratio / file_ratio if file_ratio else 0.0:.1f} %",
                      "—", "—", "—", "", ""]]
    mem = d.get("memory")
    if isinstance(mem, dict):
        size = f"{mem['bytes'] / 1e6:,.0f} MB"
        for case, label in (("reading", "reading at full speed"),
                            ("paused", f"reader pausing {num(mem.get('pause_s'))} s")):
            worst = max(get(mem, case, "supervisor", "max") or 0.0,
                        get(mem, case, "worker", "max") or 0.0)
            v = doc.goal(f"RSS growth streaming {size}, {label}",
                         f"supervisor {num(get(mem, case, 'supervisor', 'median'), 'MB')}, worker "
                         f"{num(get(mem, case, 'worker', 'median'), 'MB')} (max {num(worst)})",
                         "≤ 20 MB each", verdict(worst, 20.0, unit="MB"))
            for who in ("supervisor", "worker"):
                rows.append(_stat_row(f"RSS growth, {size}, {label}: {who} (MB)",
                                      get(mem, case, who), "", "≤ 20 MB", v))
            rows.append(_stat_row(f"RSS growth, {size}, {label}: the client itself (MB)",
                                  get(mem, case, "client"), ""))
            rows.append(_stat_row(f"Trio client stream, {label} (MB/s)", get(mem, case, "MBps"),
                                  ""))
    doc.table(HEAD, rows)


FLAT_MS = 50.0


def sec_dataplane(doc: Doc, res: Data, plot: str | None = None) -> None:
    doc.add("## Data plane: supervisor kill -9 under routed prompts and streams", "",
            "Streams: N shell sessions each print numbered lines 1..10000 in 10 bursts 0.3 s "
            "apart (about 3 s), all consumed at once by one in-process Trio client "
            "(`stream_prompt_bytes`); once every stream has delivered bytes the supervisor gets "
            "`kill -9`. Counted per repetition: streams that failed, streams with a gap, a "
            "duplicate or a line out of order, bytes lost or doubled, the client's resends "
            "(`reroutes` + `reconnects`) and streams that had already finished at the kill. "
            "Routed sessions: one Trio client prompts each of N echo sessions once (it then holds "
            "every route); the supervisor gets `kill -9`; the same client prompts all N at once "
            "and the clock runs from the kill to each answer. Nothing starts a supervisor "
            "meanwhile; each repetition checks every answer, no reroute or reconnect, no new "
            "supervisor, every worker's pid unchanged. The same N prompts with the supervisor "
            "alive, just before the kill, give what N answers cost anyway. Between repetitions "
            "a supervisor is autostarted again (it adopts the workers) and the client routes "
            "every session again outside the clock: a route is bound to the supervisor "
            "generation that granted it.", "")
    if not _failed(doc, res):
        doc.goal("supervisor kill -9 under 100 streams", "—", "0 interrupted, 0 bytes lost",
                 "not measured")
        doc.goal("supervisor kill -9 → routed sessions answering", "—",
                 "≤ 300 ms, flat in N", "not measured")
        return
    d = res["data"]
    for e in d.get("errors") or []:
        what = f"{e.get('part')}" + (f", {e['sessions']} sessions" if e.get("sessions") else "")
        doc.add(f"**A part failed** ({what}): `{e.get('error')}`", "")
    rows = []
    st = d.get("streams")
    if isinstance(st, dict):
        t = st.get("total") or {}
        bad = (int(st.get("interrupted", 0)) + int(st.get("resends", 0))
               + int(t.get("bytes_lost", 0)) + int(t.get("bytes_doubled", 0)))
        reps = st.get("reps") or []
        early = int(t.get("finished_before_kill", 0))
        v = "met" if bad == 0 else (f"missed: {st.get('interrupted')} streams interrupted, "
                                     f"{st.get('resends')} resends, {t.get('bytes_lost')} bytes "
                                     f"lost, {t.get('bytes_doubled')} doubled")
        if v == "met" and early:
            v = f"met, but {early} streams had finished before the kill"
        doc.goal(f"supervisor kill -9 under {st['sessions']} streams ({len(reps)} kills)",
                 f"{st.get('interrupted')} interrupted, {st.get('resends')} resends, "
                 f"{t.get('bytes_lost')} bytes lost, {t.get('bytes_doubled')} doubled",
                 "0 interrupted, 0 bytes lost or doubled", v)
        for i, r in enumerate(reps):
            rows.append([f"{st['sessions']} streams, kill {i + 1}: kill at "
                         f"{num(r.get('kill_after_s'), 's')}, all done "
                         f"{num(r.get('all_done_after_kill_s'), 's')} after it",
                         f"{r.get('failed')} failed, {r.get('damaged')} damaged, "
                         f"{r.get('reroutes')} reroutes, {r.get('reconnects')} reconnects, "
                         f"{r.get('bytes_lost')} B lost, {r.get('bytes_doubled')} B doubled of "
                         f"{num(r.get('bytes_expected'))} B, {r.get('finished_before_kill')} "
                         "done before the kill", "—", "—", "1", "all 0", v])
    routed = [r for r in d.get("routed") or [] if isinstance(r, dict)]
    if routed:
        worst = max(get(r, "all_answered_ms", "median") or 0.0 for r in routed)
        added = [(get(r, "all_answered_ms", "median") or 0.0)
                 - (get(r, "all_answered_no_kill_ms", "median") or 0.0) for r in routed]
        ns = ", ".join(str(r["sessions"]) for r in routed)
        v = verdict(worst, 300, unit="ms")
        # flat: what the kill adds to N answers (over the same N with the supervisor alive)
        # grows by at most FLAT_MS from the smallest N to the largest
        if v == "met" and added[-1] - added[0] > FLAT_MS:
            v = (f"missed: not flat in N (the kill adds {added[0]:.0f} ms at N="
                 f"{routed[0]['sessions']}, {added[-1]:.0f} ms at N={routed[-1]['sessions']})")
        doc.goal(f"supervisor kill -9 → every routed session answering (N = {ns})",
                 ", ".join(f"N={r['sessions']}: {num(get(r, 'all_answered_ms', 'median'), 'ms')}"
                           for r in routed), "≤ 300 ms, flat in N", v)
        for r in routed:
            n = r["sessions"]
            vr = verdict(get(r, "all_answered_ms", "median"), 300, unit="ms")
            rows.append(_stat_row(f"N={n}: kill → first routed session answered (ms)",
                                  r.get("first_answer_ms"), ""))
            rows.append(_stat_row(f"N={n}: kill → all N answered (ms)", r.get("all_answered_ms"),
                                  "", "≤ 300 ms", vr))
            rows.append(_stat_row(f"N={n}: the same N prompts, supervisor alive (ms)",
                                  r.get("all_answered_no_kill_ms"), ""))
            rows.append([f"N={n}: added by the kill (difference of medians, ms)",
                         num((get(r, "all_answered_ms", "median") or 0.0)
                             - (get(r, "all_answered_no_kill_ms", "median") or 0.0)),
                         "—", "—", "—", f"flat: grows ≤ {FLAT_MS:g} ms over N", ""])
    doc.table(HEAD, rows)
    if plot:
        doc.add(plot, "")


def sec_cli_warm(doc: Doc, res: Data, peers: Data | None) -> None:
    doc.add("## CLI warm prompt", "",
            "Whole process `trio-agentd -p hi` (blocking client, no event loop) against a running "
            "daemon, interleaved with `python -c pass` (A B A B …); the figure is the ratio of "
            "the medians.", "")
    if not _failed(doc, res):
        doc.goal("CLI warm prompt", "—", "≤ 2.5x python -c pass", "not measured")
        return
    d = res["data"]
    base, cli, ratio = d.get("python -c pass"), d.get("trio-agentd -p hi (warm)"), d.get("ratio")
    v = doc.goal("CLI warm prompt", f"{num(ratio)}x python -c pass", "≤ 2.5x python -c pass",
                 verdict(ratio, 2.5, unit="x"))
    faster = _faster_than_peers(ratio, peers)
    doc.goal("CLI warm prompt vs peers' status commands", faster[0],
             "faster than every peer's status command", faster[1])
    doc.table(HEAD, [
        _stat_row("`python -c pass` (ms)", base, ""),
        _stat_row("`trio-agentd -p hi`, warm (ms)", cli, ""),
        ["ratio of medians", f"{num(ratio)}x", "—", "—", "—", "≤ 2.5x", v],
        ["vs peers' status commands", faster[0], "—", "—", "—", "faster than every peer",
         faster[1]],
    ])


def _peer_names(peers: Data | None) -> list[str]:
    return [k for k, v in (peers or {}).items() if isinstance(v, dict)]


def _faster_than_peers(ratio: Any, peers: Data | None) -> tuple[str, str]:
    names = _peer_names(peers)
    if not names or not isinstance(ratio, int | float):
        return "—", "not measured (no peer figures)"
    parts, slower, missing = [], [], []
    for p in names:
        pr = get(peers, p, "status_cmd_ms", "ratio_to_python_c_pass")
        if not isinstance(pr, int | float):
            missing.append(p)
            continue
        parts.append(f"{p} {pr / ratio:.2f}x")
        if pr <= ratio:
            slower.append(p)
    measured = ", ".join(parts) + " the time of `trio-agentd -p hi`" if parts else "—"
    if slower:
        return measured, f"missed: not faster than {', '.join(slower)}"
    if missing:
        return measured, f"met for the measured peers; not measured: {', '.join(missing)}"
    return measured, "met"


def sec_startup(doc: Doc, res: Data) -> None:
    doc.add("## Cold start and concurrent launches", "",
            "Cold start: a fresh private environment per repetition (no daemon, no state); whole "
            "process `trio-agentd -p hi` from spawn to exit (it autostarts the supervisor, which "
            "spawns the session's worker, and prints the reply). `python -c pass` is timed "
            "interleaved as a gauge of machine noise. Concurrent launches: N `trio-agentd -p hi` "
            "spawned back to back on a fresh socket, from the first spawn to the last exit; each "
            "repetition checks every process exited 0 with its reply, the turns are exactly "
            "1..N, there is one `*.owner` record and one live supervisor process.", "")
    if not _failed(doc, res):
        doc.goal("cold start", "—", "≤ 400 ms", "not measured")
        doc.goal("concurrent launches", "—", "all succeed, one supervisor", "not measured")
        return
    d = res["data"]
    cold = get(d, "cold", "cold_start_ms")
    v = doc.goal("cold start", num(get(cold, "median"), "ms"), "≤ 400 ms",
                 verdict(get(cold, "median"), 400, unit="ms"))
    rows = [_stat_row("cold start, no daemon → reply printed (ms)", cold, "", "≤ 400 ms", v),
            _stat_row("`python -c pass`, interleaved (ms)", get(d, "cold", "python_c_pass_ms"),
                      "")]
    for r in d.get("concurrent") or []:
        ok = r.get("all_succeeded") and r.get("one_supervisor")
        vc = doc.goal(f"{r['clients']} concurrent launches",
                      f"{num(get(r, 'wall_ms', 'median'), 'ms')} wall, all succeeded, one "
                      "supervisor" if ok else "failed", "all succeed, one supervisor",
                      "met" if ok else "missed")
        rows.append(_stat_row(f"{r['clients']} launches at once: wall time (ms)", r.get("wall_ms"),
                              "", "all succeed, one supervisor", vc))
        rows.append(_stat_row(f"{r['clients']} launches at once: median client exit, from the "
                              "first spawn (ms)", r.get("median_exit_ms"), ""))
    doc.table(HEAD, rows)


def sec_recovery(doc: Doc, res: Data, plot: str) -> None:
    doc.add("## Recovery after kill -9: prompts that autostart the next supervisor", "",
            "Not the routed prompts of the data-plane figure: here the clients (the blocking "
            "`SyncClient`, as in the CLI) hold no route when the supervisor dies, so each "
            "prompt needs a supervisor first. Supervisor `kill -9` with "
            "N sessions: the clock starts at the kill; one prompt per "
            "session, from 1 client thread or 8 at once (interleaved kill by kill), autostarts "
            "the next supervisor, which adopts every worker. Each repetition checks every worker "
            "was adopted (same pid and start id) and no session was lost. Worker `kill -9`: one "
            "prompt to that session at once; the clock stops at its answer.", "")
    if not _failed(doc, res):
        doc.goal("supervisor kill -9 → all answering, 100 sessions", "—", "≤ 1 s, 0 lost",
                 "not measured")
        doc.goal("worker kill -9 → session answering", "—", "≤ 300 ms median",
                 "not measured")
        return
    d = res["data"]
    failed = {e.get("sessions"): str(e.get("error")) for e in d.get("errors") or []
              if e.get("sessions") is not None}
    for e in d.get("errors") or []:
        what = (f"{e['sessions']} sessions" if e.get("sessions") is not None
                else "worker kill -9")
        doc.add(f"**A repetition failed** ({what}; the other sizes ran on): `{e.get('error')}`",
                "")
    rows = []
    for n, err in failed.items():
        rows.append([f"{n} sessions: every repetition", "—", "—", "—", "—",
                     "≤ 1 s, 0 lost" if n == 100 else "", f"failed: {err[:200]}"])
        if n == 100:
            doc.goal("supervisor kill -9 → all 100 answering", "a repetition failed",
                     "≤ 1 s, 0 lost", f"missed: {err[:200]}")
    for r in d.get("supervisor_kill") or []:
        n, c = r.get("sessions"), r.get("clients")
        goal, v = "", ""
        if n == 100:
            med = get(r, "all_answered_ms", "median")
            lost = r.get("sessions_lost")
            v = verdict(med, 1000, unit="ms")
            if v == "met" and lost != 0:
                v = f"missed: {lost} sessions lost"
            goal = "≤ 1 s, 0 lost"
            doc.goal(f"supervisor kill -9 → all 100 answering ({c} client thread"
                     f"{'s' if c != 1 else ''})", f"{num(med, 'ms')}, {lost} lost", goal, v)
        rows.append(_stat_row(f"{n} sessions, {c} client(s): first answer (ms)",
                              r.get("first_answer_ms"), ""))
        rows.append(_stat_row(f"{n} sessions, {c} client(s): all answered (ms)",
                              r.get("all_answered_ms"), "", goal, v))
    if 100 not in failed and not any(r.get("sessions") == 100
                                     for r in d.get("supervisor_kill") or []):
        doc.goal("supervisor kill -9 → all answering, 100 sessions", "—", "≤ 1 s, 0 lost",
                 "not measured (no 100-session run)")
    w = d.get("worker_kill")
    if not isinstance(w, dict):
        werr = next((str(e.get("error")) for e in d.get("errors") or [] if e.get("worker_kill")),
                    None)
        doc.goal("worker kill -9 → session answering", "failed" if werr else "—",
                 "≤ 300 ms median", f"missed: {werr[:200]}" if werr else "not measured")
    else:
        med = get(w, "answered_again_ms", "median")
        v = doc.goal("worker kill -9 → session answering", num(med, "ms"), "≤ 300 ms median",
                     verdict(med, 300, unit="ms"))
        rows.append(_stat_row(f"worker kill -9 → answering ({w.get('kills')} kills over "
                              f"{w.get('sessions')} sessions) (ms)", w.get("answered_again_ms"),
                              "", "≤ 300 ms", v))
    doc.table(HEAD, rows)
    doc.add("Every repetition with numbers above adopted every worker (same pid and start id) "
            "and lost no session; a repetition where that failed fails its size (reported "
            "above, never retried).", "")
    doc.add(plot, "")


_SCALE_GOAL = "1,000 sessions, all answering; supervisor RSS ≤ 60 MB; total ≤ 8 GB"


def sec_footprint(doc: Doc, res: Data) -> None:
    doc.add("## Idle cost, memory and scale", "",
            "One private daemon; sessions created by prompting new session ids (echo agent) from "
            "8 blocking-client threads, in batches of 50. Idle: nobody sends a command during "
            "the window; CPU is utime+stime from `/proc/<pid>/stat` of the supervisor (pid from "
            "the owner record) and every worker (pids from the worker descriptors), "
            "identity-checked, as % of one core; 5 s slices measured on each process's CPU-time "
            "clock (ns, `clock_gettime`) give the spread. Memory: `psutil` "
            "`memory_full_info()`. Scale: keep creating sessions until the first failure or "
            "1,000, then every session must answer one more prompt; its memory is measured "
            "then, the same way (total: the PSS of the supervisor, every worker and the fork "
            "template, each shared page counted once), and the fall of the machine's "
            "`MemAvailable` since before the first session is shown as a cross-check.",
            "")
    if not _failed(doc, res):
        for g, goal in (("idle cost", "≤ 2 % of one core"), ("supervisor RSS", "≤ 50 MB"),
                        ("worker PSS", "≤ 20 MB"), ("worker PSS per worker", "≤ 6 MB"),
                        ("scale", _SCALE_GOAL)):
            doc.goal(g, "—", goal, "not measured")
        return
    d = res["data"]
    idle, mem, sc = d.get("idle") or {}, d.get("memory") or {}, d.get("scale") or {}
    total = idle.get("total_pct")
    vi = doc.goal(f"idle cost, {idle.get('sessions')} sessions",
                  num(total, "% of one core"), "≤ 2 % of one core",
                  verdict(total, 2.0, unit="%"))
    rss = mem.get("supervisor_rss_mb")
    vr = doc.goal(f"supervisor RSS at {mem.get('sessions')} sessions", num(rss, "MB"), "≤ 50 MB",
                  verdict(rss, 50, unit="MB"))
    pmax = get(mem, "worker_pss_mb", "max")
    vp = doc.goal("worker PSS (largest worker)", num(pmax, "MB"), "≤ 20 MB",
                  verdict(pmax, 20, unit="MB"))
    mean = mem.get("worker_pss_mean_mb")
    vm = doc.goal(f"worker PSS with {mem.get('sessions')} sessions, per worker (mean: the"
                  " workers' total PSS / workers)",
                  f"{num(mean, 'MB')} (median {num(get(mem, 'worker_pss_mb', 'median'))},"
                  f" largest {num(pmax)})", "≤ 6 MB per worker", verdict(mean, 6.0, unit="MB"))
    count, answered, target = sc.get("sessions"), sc.get("answered_again"), sc.get("target")
    smem = sc.get("memory") or {}
    srss, stotal = smem.get("supervisor_rss_mb"), smem.get("total_pss_mb")
    if isinstance(target, int) and target < 1000:
        vs = f"not measured: this run stopped at {target} (quick)"
    elif count is None:
        vs = "not measured"
    elif count >= 1000 and answered == count:
        over: list[str] = []
        if not isinstance(srss, (int, float)) or srss > 60:
            over.append(f"supervisor RSS {num(srss)} MB > 60 MB")
        if not isinstance(stotal, (int, float)) or stotal > 8192:
            over.append(f"total PSS {num(stotal)} MB > 8,192 MB")
        vs = "missed: " + "; ".join(over) if over else "met"
    else:
        vs = (f"missed: {count} sessions started, {answered} answered"
              + (f"; first failure: {sc.get('first_failure')}" if sc.get("first_failure") else ""))
    doc.goal("scale", f"{num(count)} sessions, {num(answered)} answering; supervisor RSS"
             f" {num(srss, 'MB')}, total PSS {num(stotal, 'MB')}", _SCALE_GOAL, vs)
    window = idle.get("window_s")
    doc.table(HEAD, [
        [f"idle CPU, {idle.get('sessions')} sessions, whole {num(window)} s window "
         f"(% of one core)", num(total), "—", "—", "1", "≤ 2 %", vi],
        ["… of which the supervisor (%)", num(idle.get("supervisor_pct")), "—", "—", "1", "", ""],
        ["… of which all workers (%)", num(idle.get("workers_pct")), "—", "—", "1", "", ""],
        ["… the same window on the CPU-time clock, ns (%)", num(idle.get("clock_total_pct")),
         "—", "—", "1", "", ""],
        _stat_row(f"idle CPU per {num(idle.get('slice_s'))} s slice, CPU-time clock (%)",
                  idle.get("slices_total_pct"), ""),
        _stat_row("idle CPU per worker (%)", idle.get("per_worker_pct"), ""),
        [f"supervisor RSS at {mem.get('sessions')} sessions (MB)", num(rss), "—", "—", "1",
         "≤ 50 MB", vr],
        ["supervisor PSS / USS (MB)",
         f"{num(mem.get('supervisor_pss_mb'))} / {num(mem.get('supervisor_uss_mb'))}",
         "—", "—", "1", "", ""],
        _stat_row("worker PSS (MB)", mem.get("worker_pss_mb"), "", "≤ 20 MB (max)", vp),
        ["worker PSS, mean (MB)", num(mean), "—", "—", num(get(mem, "worker_pss_mb", "n")),
         "≤ 6 MB per worker", vm],
        _stat_row("worker RSS (MB)", mem.get("worker_rss_mb"), ""),
        _stat_row("worker USS (MB)", mem.get("worker_uss_mb"), ""),
        ["total PSS, supervisor + workers (MB)", num(mem.get("total_pss_mb")), "—", "—", "1", "",
         ""],
        [f"scale: sessions started (target {num(target)})", num(count), "—", "—", "1",
         "1,000, all answering", vs],
        ["scale: creation time (s) / rate (sessions/s)",
         f"{num(sc.get('create_s'))} / {num(sc.get('sessions_per_s'))}", "—", "—", "1", "", ""],
        ["scale: answered one more prompt (count, s)",
         f"{num(answered)} in {num(sc.get('answer_again_s'))}", "—", "—", "1", "", ""],
        [f"scale: supervisor RSS at {num(count)} sessions (MB)", num(srss), "—", "—", "1",
         "≤ 60 MB", ""],
        ["scale: supervisor PSS / USS (MB)",
         f"{num(smem.get('supervisor_pss_mb'))} / {num(smem.get('supervisor_uss_mb'))}",
         "—", "—", "1", "", ""],
        _stat_row(f"scale: worker PSS at {num(count)} sessions (MB)", smem.get("worker_pss_mb"),
                  ""),
        [f"scale: total PSS at {num(count)} sessions, supervisor + workers + template (MB)",
         num(stotal), "—", "—", "1", "≤ 8,192 MB", ""],
        ["scale: fall of the machine's MemAvailable since before the first session (MB)",
         num(sc.get("mem_available_drop_mb")), "—", "—", "1", "", ""],
        ["scale: first failure", str(sc.get("first_failure") or "none"), "", "", "", "", ""],
    ])


def sec_doctor(doc: Doc, res: Data) -> None:
    doc.add("## ps --json, doctor, doctor --fix", "",
            "Whole processes against 1 and 20 running daemons (each its own socket), interleaved "
            "with `python -c pass` (A B C A B C …); the figure is the ratio of the medians. "
            "`doctor --fix`: the owner record of a daemon running with self-heal off is deleted "
            "(it is wedged); the clock runs until `doctor --fix` has replaced it and a prompt to "
            "the old session is answered.", "")
    if not _failed(doc, res):
        doc.goal("ps --json / doctor", "—", "≤ 2.5x python -c pass", "not measured")
        return
    d = res["data"]
    ps, ratios = d.get("ps") or {}, d.get("ratios") or {}
    rows = []
    for count in (1, 20):
        rows.append(_stat_row(f"`python -c pass` ({count}) (ms)",
                              ps.get(f"python -c pass ({count})"), ""))
        for cmd in ("ps --json", "doctor"):
            key = f"{cmd}, {count} daemon(s)"
            r = ratios.get(key)
            v = doc.goal(f"`{cmd}`, {count} daemon(s)", f"{num(r)}x python -c pass",
                         "≤ 2.5x python -c pass", verdict(r, 2.5, unit="x"))
            rows.append(_stat_row(f"`{key}` (ms)", ps.get(key), ""))
            rows.append([f"`{key}`: ratio of medians", f"{num(r)}x", "—", "—", "—", "≤ 2.5x", v])
    rows.append(_stat_row("`doctor --fix` → prompt answered (ms)", d.get("doctor_fix"), ""))
    doc.table(HEAD, rows)


def sec_cancel(doc: Doc, res: Data) -> None:
    doc.add("## Ctrl-C on a running prompt", "",
            "A shell session runs `sleep 1000 & echo $!; wait` through the CLI; the CLI gets "
            "SIGINT once it printed the child's pid. From the signal: the CLI's exit (130), the "
            "turn's child gone (polled every 1 ms), and the next `trio-agentd -p` to the session "
            "answered (a whole CLI process). *Stubborn*: the turn ignores SIGINT (`trap '' INT`) "
            "and must be escalated to TERM and KILL. Goal: the stop grace + 100 ms; for the agent "
            "that dies of SIGINT, 100 ms.", "")
    if not _failed(doc, res):
        doc.goal("Ctrl-C → processes gone, session answering", "—", "≤ stop grace + 100 ms",
                 "not measured")
        return
    d = res["data"]
    rows = []
    for name, label in (("plain", "dies of SIGINT"), ("stubborn", "ignores SIGINT")):
        r = d.get(name) or {}
        goal = r.get("goal_ms")
        for key, what in (("exit", "CLI exited 130"), ("gone", "turn's processes gone"),
                          ("answered", "session answered the next prompt")):
            s = r.get(key)
            v = verdict(get(s, "median"), goal, unit=" ms") if goal is not None else "—"
            rows.append(_stat_row(f"{label}: {what} (ms)", s, "", f"≤ {num(goal)}", v))
        worst = max((get(r, k, "median") or 0) for k in ("gone", "answered"))
        doc.goal(f"Ctrl-C ({label}) → processes gone and session answering",
                 f"{num(worst)} ms", f"≤ {num(goal)} ms", verdict(worst, goal or 0, unit=" ms"))
    doc.table(HEAD, rows)
    doc.add(f"Stop grace {num(d.get('stop_grace_s'))} s; the runner's SIGINT → TERM grace "
            f"{num(d.get('kill_grace_s'))} s, TERM → KILL 0.1 s.", "")


def _peer_cell(peers: Data, p: str, fig: str, render: Callable[[Data], str]) -> str:
    r = get(peers, p, fig)
    if not isinstance(r, dict):
        return "not reported"
    if "error" in r:
        return "error: " + str(r["error"]).replace("\n", " ")[:200]
    try:
        return render(r)
    except (KeyError, TypeError, ValueError) as exc:
        return f"unreadable result ({type(exc).__name__}: {exc}): {json.dumps(r)[:150]}"


def _survival(r: Data) -> str:
    n, adopted = r["programs"], r["adopted"]
    facts = (f"{adopted} of {n} adopted, {r.get('duplicated', 0)} duplicated (a new copy while "
             f"the old one runs), {r.get('respawned', 0)} respawned, {r.get('lost', 0)} lost; "
             f"{r.get('unmanaged_survivors', 0)} left running unmanaged")
    if adopted == n:
        return f"{n} of {n} programs adopted after restart ({facts})"
    return f"cannot: after kill -9 and a restart ({r.get('how', 'restarted')}), {facts}"


def sec_lifecycle(doc: Doc, figs: dict[str, Data]) -> None:
    """Startup, launch of 100 and clean stop of 100: trio-agentd against the peers."""
    doc.add("## Startup, launch and stop, against the peers", "",
            "trio-agentd (from the cold-start and bulk figures of `benchmarks/startup.py`): "
            "startup is a cold `trio-agentd -p hi` with no daemon, to its printed reply; "
            "launch is one client process (`open_client`, Trio) creating 100 new sessions at "
            "once, from no daemon (it autostarts the supervisor) until each answered its first "
            "prompt; stop is `trio-agentd shutdown` with those 100, until the supervisor and "
            "every worker are gone. Peers (`benchmarks/peers.py`, same run, idle stand-in "
            "programs): startup is the start command with 1 program until its status command "
            "first shows it running, launch the same with 100, stop the peer's clean stop "
            "command (`supervisorctl shutdown`, `circusctl quit`, `pm2 kill`) until the daemon "
            "and every program are gone. A peer's status is polled every 20 ms, each poll a "
            "whole status command.", "")
    boot = get(figs, "startup", "data")
    peers = get(figs, "peers", "data")
    ours = {"startup": get(boot, "cold", "cold_start_ms"), "launch": get(boot, "bulk", "launch_ms"),
            "stop": get(boot, "bulk", "stop_ms")}
    names = _peer_names(peers) if isinstance(peers, dict) else []

    def peer(name: str, key: str) -> Any:
        return get(peers, name, "lifecycle_ms", key)

    def cell(s: Any) -> str:
        if not isinstance(s, dict):
            return "not measured"
        return (f"{num(s.get('median'), 'ms')} (min {num(s.get('min'))}, max "
                f"{num(s.get('max'))}, n={num(s.get('n'))})")

    rows = []
    goals = {"startup": ("supervisord", "startup (no daemon) → first prompt answered"),
             "launch": ("circus", "launch → 100 new sessions all answering"),
             "stop": ("supervisord", "clean `shutdown` with 100 sessions → nothing left")}
    pair = get(peers, "supervisord", "startup_pair")
    for key, (rival, label) in goals.items():
        mine = get(ours[key], "median")
        theirs = get(peer(rival, key), "median")
        how = "same run"
        if key == "startup" and isinstance(get(pair, "ratio_of_medians"), int | float):
            # the interleaved pair (A B A B …) decides: both met the same machine
            mine, theirs = get(pair, "trio_agentd_ms", "median"), get(pair, "rival_ms", "median")
            how = f"interleaved, {num(get(pair, 'reps'))} each"
        if isinstance(mine, int | float) and isinstance(theirs, int | float):
            v = "met" if mine < theirs else f"missed: {mine / theirs:.2f}x {rival}'s"
        else:
            v = "not measured"
        doc.goal(label, f"{num(mine, 'ms')} ({rival}: {num(theirs, 'ms')}; {how})",
                 f"faster than {rival}'s, same run", v)
        rows.append([label, cell(ours[key]),
                     *[f"error: {err}"[:200] if (err := get(peers, n, "lifecycle_ms", "error"))
                       else cell(peer(n, key)) for n in names],
                     f"faster than {rival}", v])
    doc.table(["figure", "trio-agentd", *names, "goal", "verdict"], rows)
    if isinstance(pair, dict) and "error" not in pair:
        doc.add("", "Startup, interleaved (the goal's verdict): supervisord's startup (as above) "
                "and a cold `trio-agentd -p hi`, alternately, "
                f"{num(pair.get('reps'))} each, late in the run: trio-agentd "
                f"{cell(pair.get('trio_agentd_ms'))}, supervisord {cell(pair.get('rival_ms'))}; "
                f"ratio of medians {num(pair.get('ratio_of_medians'))}x. The rows above come "
                "from different parts of the run (the cold-start figure early, the peers late).",
                "")
    elif isinstance(pair, dict):
        doc.add("", f"Startup, interleaved: error: {str(pair.get('error'))[:300]}", "")


def sec_peers(doc: Doc, figs: dict[str, Data]) -> None:
    res = figs.get("peers", {})
    doc.add("## Peers, side by side", "",
            "supervisord, circus and pm2, each installed privately (`.bench/`) and run with "
            "private config, sockets and state, hosting idle stand-in programs "
            "(`benchmarks/peers_programs/session.py`: a Python process in `signal.pause()`), "
            "measured by `benchmarks/peers.py` in this run. Status-command timings are "
            "interleaved with `python -c pass` inside that figure; `trio-agentd -p hi` was "
            "interleaved with `python -c pass` in the CLI figure, so the comparison is the "
            "ratio of the two ratios to `python -c pass` (each from interleaved medians).", "")
    if not _failed(doc, res):
        return
    peers: Data = res["data"]
    names = _peer_names(peers)
    cli = get(figs, "cli_warm", "data")
    rec = get(figs, "recovery", "data")
    foot = get(figs, "footprint", "data")
    trio_ratio = get(cli, "ratio")

    def status(r: Data) -> str:
        # private paths say nothing about the command: keep their last part
        cmd = re.sub(r"(?:ipc://)?/\S*/(\S+)", r"…/\1", str(r.get("command", "status")))
        return (f"`{cmd}` {num(r['median'], 'ms')} "
                f"({num(r['ratio_to_python_c_pass'])}x python -c pass)")

    def vs_trio(r: Data) -> str:
        if not isinstance(trio_ratio, int | float):
            return "not measured (CLI figure failed)"
        x = r["ratio_to_python_c_pass"] / trio_ratio
        return f"{x:.2f}x the time of `trio-agentd -p hi`"

    def restart(r: Data) -> str:
        s = (f"{num(r['median'], 'ms')} (min {num(r['min'])}, max {num(r['max'])}, n={r['n']}; "
             f"new process of the program exists)")
        return s

    def idle(r: Data) -> str:
        return (f"{num(r['total_pct'])} % ({r.get('programs')} programs, "
                f"{num(r.get('window_s'))} s)" + (f"; {r['setting']}" if r.get("setting") else ""))

    def daemon_rss(r: Data) -> str:
        return f"{num(r['daemon_rss'], 'MB')} (PSS {num(r.get('daemon_pss'))})"

    def child_pss(r: Data) -> str:
        return (f"{num(r['program_pss_median'], 'MB')} (RSS {num(r.get('program_rss_median'))}; "
                f"median of {r.get('programs')})")

    # trio-agentd's column, from this run's other figures
    t_status = (f"`trio-agentd -p hi` {num(get(cli, 'trio-agentd -p hi (warm)', 'median'), 'ms')}"
                f" ({num(trio_ratio)}x python -c pass)" if cli else "CLI figure failed")
    big = None
    for r in get(rec, "supervisor_kill") or []:
        if big is None or r.get("sessions", 0) > big.get("sessions", 0):
            big = r
    t_surv = (f"{big['sessions']} of {big['sessions']} sessions answering, every worker adopted "
              f"(same pid), {big.get('sessions_lost')} lost; all answering in "
              f"{num(get(big, 'all_answered_ms', 'median'), 'ms')} (median)"
              if big else "recovery figure failed")
    wk = get(rec, "worker_kill", "answered_again_ms")
    t_restart = (f"{num(wk['median'], 'ms')} (min {num(wk['min'])}, max {num(wk['max'])}, "
                 f"n={num(wk['n'])}; until the session *answers a prompt* again)"
                 if isinstance(wk, dict) else "recovery figure failed")
    idle_t = get(foot, "idle")
    t_idle = (f"{num(idle_t['total_pct'])} % ({idle_t['sessions']} sessions, "
              f"{num(idle_t['window_s'])} s)" if isinstance(idle_t, dict) else "footprint failed")
    mem = get(foot, "memory")
    t_rss = (f"{num(mem['supervisor_rss_mb'], 'MB')} (PSS {num(mem['supervisor_pss_mb'])})"
             if isinstance(mem, dict) else "footprint failed")
    t_pss = (f"{num(get(mem, 'worker_pss_mb', 'median'), 'MB')} (RSS "
             f"{num(get(mem, 'worker_rss_mb', 'median'))}; median of {mem['sessions']})"
             if isinstance(mem, dict) else "footprint failed")

    rows = [
        ["status command, whole process", t_status,
         *(_peer_cell(peers, p, "status_cmd_ms", status) for p in names)],
        ["… relative to `trio-agentd -p hi`", "1.00x",
         *(_peer_cell(peers, p, "status_cmd_ms", vs_trio) for p in names)],
        ["daemon `kill -9`, then started again: what survives", t_surv,
         *(_peer_cell(peers, p, "daemon_kill9_survival", _survival) for p in names)],
        ["child `kill -9` → restarted (median)", t_restart,
         *(_peer_cell(peers, p, "child_restart_ms", restart) for p in names)],
        ["idle CPU, % of one core", t_idle,
         *(_peer_cell(peers, p, "idle_cpu_pct", idle) for p in names)],
        ["daemon RSS", t_rss, *(_peer_cell(peers, p, "memory_mb", daemon_rss) for p in names)],
        ["per-child PSS", t_pss, *(_peer_cell(peers, p, "memory_mb", child_pss) for p in names)],
    ]
    # variants a peer reports beside its main figures (e.g. circus at its default check_delay)
    for p in names:
        for fig, r in (peers.get(p) or {}).items():
            if not isinstance(r, dict) or fig == "install":
                continue
            for base, fn in (("child_restart_ms", restart), ("idle_cpu_pct", idle)):
                if fig.startswith(base + "_"):
                    cells = ["—"] * len(names)
                    cells[names.index(p)] = _peer_cell(peers, p, fig, fn)
                    label = ("child `kill -9` → restarted" if base == "child_restart_ms"
                             else "idle CPU, % of one core")
                    rows.append([f"{label} ({p}, {fig[len(base) + 1:].replace('_', ' ')})", "—",
                                 *cells])
    doc.table(["figure", "trio-agentd", *names], rows)
    installs = [f"{p} {_peer_cell(peers, p, 'install', lambda r: str(r.get('version')))}"
                for p in names]
    settings = [f"{p}: {get(peers, p, 'child_restart_ms', 'setting')}" for p in names
                if get(peers, p, "child_restart_ms", "setting")]
    doc.add("Versions: " + ", ".join(installs) + ".", "")
    if settings:
        doc.add("Restart settings: " + "; ".join(settings) + ".", "")


# --- plot ----------------------------------------------------------------------------------------


def plot_recovery(rec: Data | None, path: Path, routed: Any = None) -> str:
    """Draw the recovery plot; the markdown to show it, or why there is none."""
    rows = [r for r in get(rec, "supervisor_kill") or [] if isinstance(r, dict)]
    direct = [r for r in routed or [] if isinstance(r, dict)]
    if not rows and not direct:
        return "*No recovery plot: the recovery figures produced no data in this run.*"
    try:
        mpl: Any = importlib.import_module("matplotlib")
        mpl.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError as exc:
        return (f"*No recovery plot: matplotlib is not installed ({exc}); install the benchmark "
                "extra: `.venv/bin/pip install -e '.[bench]'`.*")
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)

    def series(pts: list[tuple[int, Data]], label: str, **kw: Any) -> None:
        pts = sorted(pts, key=lambda p: p[0])
        xs = [n for n, _s in pts]
        med = [s["median"] for _n, s in pts]
        lo = [s["median"] - s["min"] for _n, s in pts]
        hi = [s["max"] - s["median"] for _n, s in pts]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=4, label=label, **kw)

    if direct:
        series([(r["sessions"], r["all_answered_ms"]) for r in direct],
               "routed Trio client, no supervisor (median, min-max)", linewidth=2)
        if all(isinstance(r.get("all_answered_no_kill_ms"), dict) for r in direct):
            series([(r["sessions"], r["all_answered_no_kill_ms"]) for r in direct],
                   "same prompts, supervisor alive, no kill", linestyle="--", alpha=0.7)
    for clients in sorted({r["clients"] for r in rows}):
        series([(r["sessions"], r["all_answered_ms"]) for r in rows if r["clients"] == clients],
               f"prompts autostart the next supervisor ({clients} client thread"
               f"{'s' if clients != 1 else ''})", alpha=0.8)
    ax.axhline(300, color="tab:red", linestyle=":", linewidth=1,
               label="goal (routed): all answering within 300 ms")
    ax.set_xlabel("sessions (N)")
    ax.set_ylabel("supervisor kill -9 → all N answered (ms)")
    ax.set_title("trio-agentd: sessions answering after supervisor kill -9")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"![recovery time against number of sessions]({path.name})"


# --- the report ----------------------------------------------------------------------------------


def _code_line(code: Data) -> str:
    if not code:
        return "not recorded."
    if not code.get("commit"):
        return "not a git checkout"
    s = f"commit `{code['commit']}` ({code.get('subject')})"
    changed = code.get("uncommitted") or []
    if changed:
        s += "; uncommitted changes in " + ", ".join(f"`{c}`" for c in changed)
    return s + "."


def _venv_line(v: Any) -> str:
    if not isinstance(v, dict):
        return "not recorded."
    return (f"`.bench/{Path(str(v.get('venv'))).name}` (source hash `{v.get('key')}`; "
            f"{'reused' if v.get('cached') else 'installed for this run'}).")


def render(report: Data, plot_md: str) -> str:
    figs: dict[str, Data] = report["figures"]
    m = report["machine"]
    doc = Doc()
    body = Doc()
    body.goals = doc.goals
    peers = get(figs, "peers", "data")
    for name in report["order"]:
        res = figs.get(name)
        if res is None:
            continue
        if name == "cli_warm":
            sec_cli_warm(body, res, peers if isinstance(peers, dict) else None)
        elif name == "roundtrip":
            sec_roundtrip(body, res)
        elif name == "streaming":
            sec_streaming(body, res)
        elif name == "dataplane":
            sec_dataplane(body, res, None if "recovery" in figs else plot_md)
        elif name == "startup":
            sec_startup(body, res)
        elif name == "recovery":
            sec_recovery(body, res, plot_md)
        elif name == "footprint":
            sec_footprint(body, res)
        elif name == "doctor":
            sec_doctor(body, res)
        elif name == "cancel":
            sec_cancel(body, res)
        elif name == "peers":
            sec_lifecycle(body, figs)
            sec_peers(body, figs)
    mode = "quick (`--quick`: fewer repetitions, shorter windows)" if report["quick"] else "full"
    doc.add("# Benchmarks", "",
            "Generated by `python -m benchmarks` (`benchmarks/run.py`); do not edit by hand — "
            "rerun it. Reproduce: `.venv/bin/pip install -e '.[bench]' && .venv/bin/python -m "
            "benchmarks` (`--quick` for a short run). The runner measures a plain, non-editable "
            "`pip install .` of the tree in `.bench/venv-<hash>/` (bytecode compiled), never the "
            "editable dev install: every daemon, worker and CLI, and the `python -c pass` "
            "baseline, run from that venv. Every verdict is computed from this run's numbers; "
            "floors and peers are measured in the same run.", "",
            f"- **Date**: {report['date']}; run: {mode}, {num(report['wall_s'])} s in all.",
            f"- **Machine**: {m.get('cores')} cores ({m.get('usable_cores')} usable, "
            f"{m.get('cpu') or '?'}), {num(m.get('memory_gib'))} GiB memory, Python "
            f"{m.get('python')}, trio {m.get('trio')}, {m.get('kernel')} ({m.get('arch')}).",
            f"- **Code measured**: {_code_line(report.get('code') or {})}",
            f"- **Installed as users get it**: {_venv_line(report.get('venv'))}",
            f"- **Load average** (1/5/15 min) at the start: {report['load_start']}; at the end: "
            f"{report['load_end']}. The machine is shared: comparisons are interleaved runs "
            "(A B A B …) and ratios of their medians.", "")
    sec_goals = Doc()
    sec_goals.add("## Goals", "")
    sec_goals.table(["figure", "measured", "goal", "verdict"],
                    [list(g) for g in doc.goals])
    doc.add(*sec_goals.lines)
    doc.add(*body.lines)
    doc.add("## Per figure: wall time and errors", "")
    rows = []
    for n in report["order"]:
        if n not in figs:
            continue
        r = figs[n]
        text = f"error: {str(r['error'])[:200]}" if "error" in r else "ok"
        if r.get("leaked"):
            text += f"; {len(r['leaked'])} leaked processes, killed by the runner"
        rows.append([n, num(r.get("wall_s")), text])
    doc.table(["figure", "wall (s)", "result"], rows)
    doc.add("Raw numbers: [`benchmarks.json`](benchmarks.json).", "")
    return "\n".join(doc.lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer repetitions and shorter windows (under 5 minutes)")
    p.add_argument("--only", help="comma-separated figures: " + ",".join(BY_NAME))
    p.add_argument("--out", default=str(REPO / "docs"), help="output dir (default docs/)")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: rewrite the report and plot from OUT/benchmarks.json")
    p.add_argument("--child", choices=sorted(BY_NAME), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.quick, Path(args.out))
    if args.render:
        out = Path(args.out)
        return _write(json.loads((out / "benchmarks.json").read_text()), out)
    order = [f.name for f in FIGURES]
    if args.only:
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [x for x in wanted if x not in BY_NAME]
        if unknown:
            p.error(f"unknown figures {unknown}; known: {', '.join(BY_NAME)}")
        order = [n for n in order if n in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("== bench venv: a plain `pip install .` of this tree (reused if unchanged)",
          file=sys.stderr, flush=True)
    try:
        venv = _venv.ensure()
    except Exception as exc:
        print(f"cannot make the bench venv: {exc}", file=sys.stderr)
        return 1
    print(f"== bench venv: {venv['venv']} ({'reused' if venv['cached'] else 'installed'}, "
          f"{venv['install_s']} s)", file=sys.stderr, flush=True)
    runner_id = uuid.uuid4().hex
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"ta-bench-{runner_id[:12]}"
    tmp.mkdir(mode=0o700)
    report: Data = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                    "quick": args.quick, "machine": machine_info(), "code": code_info(),
                    "load_start": _loadavg(), "venv": venv,
                    "order": order, "figures": {}}
    t0 = time.perf_counter()
    try:
        for name in order:
            fig = BY_NAME[name]
            print(f"== {name}: {fig.title}", file=sys.stderr, flush=True)
            res = _run_child(fig, args.quick, tmp, runner_id, venv)
            report["figures"][name] = res
            status = f"error: {res['error']}" if "error" in res else "ok"
            print(f"== {name}: {status} ({res['wall_s']} s)", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", file=sys.stderr)
        _sweep(f"{RUNNER_MARKER}={runner_id}".encode())
    finally:
        for f in tmp.glob("*.json"):
            f.unlink()
        with contextlib.suppress(OSError):
            tmp.rmdir()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["load_end"] = _loadavg()
    return _write(report, out)


def _write(report: Data, out: Path) -> int:
    plot_md = plot_recovery(get(report, "figures", "recovery", "data"), out / PLOT_NAME,
                            get(report, "figures", "dataplane", "data", "routed"))
    (out / "benchmarks.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "benchmarks.md").write_text(render(report, plot_md))
    print(f"wrote {out / 'benchmarks.md'}, {out / 'benchmarks.json'}"
          f"{', ' + str(out / PLOT_NAME) if plot_md.startswith('!') else ''}"
          f" (run: {report['wall_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
