"""Shared helpers for benchmarks: a private daemon environment and robust statistics.

Benchmarks start processes in a private temp dir and kill exactly those (by pid, found through
a unique marker in their environment) even on failure.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _venv


@dataclass(frozen=True, slots=True)
class Env:
    root: Path
    env: dict[str, str]

    @property
    def socket(self) -> str:
        return str(self.root / "s" / "d.sock")

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def registry(self) -> Path:
        return self.root / "reg"

    @property
    def marker(self) -> bytes:
        return f"TA_BENCH_RUN={self.root}".encode()

    def cli(self, *args: str) -> list[str]:
        """The bench venv's ``trio-agentd`` console script (what a user runs)."""
        return [*_venv.cli(), *args]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cli(*args), env=self.env, capture_output=True, text=True,
                              check=True, timeout=120)


def _our_pids(marker: bytes) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        out.append(int(name))
            except OSError:
                pass
    return out


def ensure_bytecode() -> None:
    """Refuse to measure anything but a plain installed copy with bytecode (the bench venv of
    :mod:`benchmarks._venv`): an editable install or the source tree is not what users run.

    Set ``TA_BENCH_ALLOW_SOURCE=1`` to run a figure against the source tree anyway (debugging
    only: the numbers are not comparable).
    """
    if os.environ.get("TA_BENCH_ALLOW_SOURCE") == "1":
        return
    _venv.check_self()


@contextlib.contextmanager
def private_env() -> Iterator[Env]:
    ensure_bytecode()
    root = Path(tempfile.mkdtemp(prefix="tab-", dir="/tmp"))
    (root / "s").mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_AGENTD_")}
    env.update(
        TRIO_AGENTD_HOME=str(root / "home"),
        TRIO_AGENTD_REGISTRY_DIR=str(root / "reg"),
        TRIO_AGENTD_SOCKET=str(root / "s" / "d.sock"),
        TA_BENCH_RUN=str(root),
    )
    marker = f"TA_BENCH_RUN={root}".encode()
    try:
        yield Env(root, env)
    finally:
        killed = _our_pids(marker)
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _clear_scratch(killed)
        shutil.rmtree(root, ignore_errors=True)


def _clear_scratch(pids: list[int]) -> None:
    """Remove the rehearsal scratch directories of the fork templates among ``pids`` that were
    just killed. They live where a user's would (``/dev/shm``, unless ``TMPDIR`` is set), not
    in the private root: the benchmarks measure what a user gets."""
    from trio_agentd._scratch import SCRATCH_PREFIX, root_of

    where = root_of(os.environ)
    for pid in pids:
        for path in Path(where).glob(f"{SCRATCH_PREFIX}{pid}-*"):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def inherited(env: Env) -> Iterator[None]:
    """Make this process's environment ``env.env`` for the body, then restore it.

    For benchmarks that run the client in-process: a supervisor the client autostarts inherits
    this process's environment, so it gets the private paths and the marker that
    :func:`private_env` kills by.
    """
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env.env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def kill_started(env: Env) -> int:
    """SIGKILL every process started in ``env`` now (by marker and pid); how many were hit."""
    hit = 0
    killed = _our_pids(env.marker)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            hit += 1
    _clear_scratch(killed)
    return hit


def echo_ok(result: object, text: str) -> bool:
    """``result`` is the echo agent's answer to ``text`` (its reply ends its line)."""
    if not isinstance(result, dict):
        return False
    return result.get("reply") == f"[echo turn {result.get('turn')}] {text}\n"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def vm_rss_kb(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in KiB from ``/proc/PID/status``; ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` (its threads, and children it waited for) in seconds."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            tail = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    tck = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in tail[11:15]) / tck


def run_timed(argv: list[str], *, env: dict[str, str] | None = None,
              stdout: Any = subprocess.DEVNULL, stderr: Any = subprocess.DEVNULL,
              limit: float = 120.0) -> tuple[float, int]:
    """Whole-process wall seconds and exit status, by a blocking wait.

    ``subprocess``'s ``wait(timeout=…)`` polls, with sleeps that double up to 50 ms, and so
    does ``run(timeout=…)`` whenever there is no pipe to read: a sample lands on that grid
    (a process that ends after 165 ms is seen at 214 ms). Here the wait blocks, and a timer
    kills a process that runs past ``limit`` (its status then says so)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=stderr)
    return wait_timed([proc], t0, limit)[0], proc.returncode


def wait_timed(procs: list[subprocess.Popen[Any]], t0: float, limit: float) -> list[float]:
    """Block until every one of ``procs`` has exited (a timer kills them all once ``limit``
    seconds have passed); each one's seconds since ``t0``, as seen by blocking waits (see
    :func:`run_timed`)."""
    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()

    timer = threading.Timer(limit, kill_all)
    timer.start()
    try:
        done = []
        for p in procs:
            p.wait()
            done.append(time.perf_counter() - t0)
        return done
    except BaseException:
        kill_all()
        for p in procs:
            p.wait()
        raise
    finally:
        timer.cancel()


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def summary(samples: list[float], scale: float = 1000.0) -> dict[str, float]:
    return {
        "median": statistics.median(samples) * scale,
        "min": min(samples) * scale,
        "max": max(samples) * scale,
        "n": float(len(samples)),
    }


def machine() -> str:
    import trio

    return (f"{os.cpu_count()} cores, Python {platform.python_version()}, trio {trio.__version__},"
            f" {platform.system()} {platform.release()}")
