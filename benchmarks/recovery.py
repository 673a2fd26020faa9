"""Crash recovery: how long until sessions answer again after a ``kill -9``.

(a) **supervisor** kill -9 with N sessions (N = 10, 50, 100): the clock starts at the kill; the
prompts, one per session, autostart the next supervisor, which adopts every worker. Reported:
until the first answer (a supervisor is up) and until *every* session has answered. The prompts
come from 1 client thread, or from 8 at once (each finds no supervisor and autostarts one; one
wins the socket): the two modes are interleaved, kill by kill. Each repetition checks that no
session was lost and every worker was adopted (same pid and start id), not respawned.

(b) **worker** kill -9: the clock starts at the kill; one prompt is sent to that session at once
and the clock stops at its answer (the supervisor notices the dead worker, respawns it under the
same session id and the prompt runs there). The kills rotate over 10 sessions so that no session
comes near the restart intensity (5 respawns per 60 s marks a session failed).

Usage: ``python -m benchmarks.recovery [--sizes 10,50,100] [--clients 1,8] [--worker-reps 20]
[--json PATH]``.
The last line of stdout is the result as JSON; ``--json PATH`` also writes it to PATH. Every
process started is killed by pid (found by a marker in its environment), also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from trio_agentd._identity import read_start_id
from trio_agentd._paths import Layout
from trio_agentd._syncclient import SyncClient

from ._common import (
    Env,
    _our_pids,
    echo_ok,
    inherited,
    kill_started,
    machine,
    private_env,
    summary,
)

POOL = 8  # client threads: for creating sessions, and the concurrent mode after a kill
WAIT = 120.0  # seconds any one phase may take before the benchmark gives up
WORKER_SESSIONS = 10


class BenchError(Exception):
    """A repetition went wrong: the numbers would be meaningless."""


@dataclass
class Pool:
    """Client threads (daemon threads: Ctrl-C never waits for them), one SyncClient each."""

    layout: Layout
    clients: list[SyncClient] = field(default_factory=list)
    stopping: bool = False

    def run(self, items: list[str], fn: Callable[[SyncClient, str], Any],
            threads: int = POOL) -> dict[str, tuple[float, Any]]:
        """``fn(client, item)`` for every item; item → (perf_counter when done, result).

        Raises:
            BenchError: an item failed or the phase took longer than ``WAIT``.
        """
        todo: queue.SimpleQueue[str] = queue.SimpleQueue()
        for item in items:
            todo.put(item)
        done: dict[str, tuple[float, Any]] = {}
        errors: list[str] = []
        lock = threading.Lock()
        finished = threading.Event()

        def work(client: SyncClient) -> None:
            while not self.stopping:
                try:
                    item = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    result = fn(client, item)
                except Exception as exc:
                    with lock:
                        errors.append(f"{item}: {exc!r}")
                        finished.set()
                    return
                with lock:
                    done[item] = (time.perf_counter(), result)
                    if len(done) == len(items):
                        finished.set()

        for _ in range(min(threads, len(items))):
            client = SyncClient(self.layout)
            self.clients.append(client)
            threading.Thread(target=work, args=(client,), daemon=True).start()
        deadline = time.monotonic() + WAIT
        while not finished.wait(0.25):  # short waits: Ctrl-C stays responsive
            if time.monotonic() > deadline:
                raise BenchError(f"{len(items) - len(done)} of {len(items)} not done in {WAIT}s")
        if errors:
            raise BenchError(f"{len(errors)} failed, e.g. {errors[0]}")
        return done

    def stop(self) -> None:
        """Make every client thread give up without ever starting another supervisor."""
        self.stopping = True
        for c in self.clients:
            c.autostart = False


# --- this env's files and processes ---------------------------------------------------------


def _ours(env: Env, pid: int, start_id: str | None) -> bool:
    if start_id is None or read_start_id(pid) != start_id:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return env.marker in f.read().split(b"\0")
    except OSError:
        return False


def _supervisor(env: Env) -> tuple[int, str] | None:
    """The live supervisor named by the env's owner record."""
    for rec in sorted(env.registry.glob("*.owner")):
        try:
            owner = json.loads((rec / "owner.json").read_bytes())
        except (OSError, ValueError):
            continue
        pid, sid = owner.get("pid"), owner.get("start_id")
        if owner.get("phase") == "owner" and isinstance(pid, int) and _ours(env, pid, sid):
            return pid, str(sid)
    return None


def _workers(env: Env) -> dict[str, tuple[int, str | None]]:
    """session → (pid, start id) from every descriptor with a worker (a session whose worker
    has not been started yet has a descriptor without a pid: it is left out)."""
    out: dict[str, tuple[int, str | None]] = {}
    for path in (env.home / "daemons").glob("*/workers/*.json"):
        desc = json.loads(path.read_bytes())
        if isinstance(desc.get("pid"), int):
            out[str(desc["session"])] = (desc["pid"], desc.get("start_id"))
    return out


def _stray_daemons(env: Env, keep: int) -> list[int]:
    """Supervisor processes of this env other than ``keep`` (autostart losers still exiting)."""
    out = []
    for pid in _our_pids(env.marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if pid != keep and b"daemon" in argv:
            out.append(pid)
    return out


def _no_strays(env: Env, keep: int) -> bool:
    return not _stray_daemons(env, keep)


def _wait(predicate: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.01)
    return value


def _prompt(text: str) -> Callable[[SyncClient, str], Any]:
    def send(client: SyncClient, session: str) -> Any:
        result = client.request("prompt", {"session": session, "text": text})
        if not echo_ok(result, text):
            raise BenchError(f"session {session}: wrong answer {result!r}")
        return result
    return send


def _create(client: SyncClient, session: str) -> Any:
    return client.request("create_session", {"session": session, "agent": "echo"})


@contextmanager
def _bench_env(pools: list[Pool]) -> Iterator[tuple[Env, Layout]]:
    """A private env whose autostarted supervisors inherit its marker; on any exit (Ctrl-C
    too) client threads are told to stop, then everything started is killed by pid."""
    with private_env() as env, inherited(env):
        layout = Layout.resolve(socket=env.socket, home=env.home, registry=env.registry)
        try:
            yield env, layout
        except BenchError:
            for log in sorted(env.home.glob("daemons/*/daemon.log")):
                tail = log.read_text(errors="replace").splitlines()[-40:]
                print(f"--- {log} (tail) ---", *tail, sep="\n", file=sys.stderr)
            raise
        finally:
            for p in pools:
                p.stop()
            kill_started(env)  # private_env sweeps again after this, then removes the dir


# --- (a) supervisor kill -9 ---------------------------------------------------------------------


def supervisor_kill(n: int, reps: int, modes: tuple[int, ...]) -> list[dict[str, Any]]:
    """``reps`` kills per client count in ``modes``, interleaved (1, 8, 1, 8, …)."""
    pools: list[Pool] = []
    first: dict[int, list[float]] = {m: [] for m in modes}
    every: dict[int, list[float]] = {m: [] for m in modes}
    with _bench_env(pools) as (env, layout):
        sessions = [f"s{i:03d}" for i in range(n)]
        pools.append(pool := Pool(layout))
        t0 = time.perf_counter()
        pool.run(sessions, _create)
        created_s = time.perf_counter() - t0
        # a created session's worker starts on its own time: one answered prompt each means
        # every worker runs, and its descriptor names it (what the kills must find adopted)
        pool.run(sessions, _prompt("up"))
        workers = _workers(env)
        if sorted(workers) != sessions:
            raise BenchError(f"N={n}: expected {n} descriptors, found {len(workers)}")
        for rep in range(reps):
            for clients in modes:
                pools.append(pool := Pool(layout))
                f, a = _one_supervisor_kill(env, layout, pool, sessions, workers, clients, rep)
                first[clients].append(f)
                every[clients].append(a)
                print(f"  N={n:3d} clients={clients} rep {rep + 1}/{reps}: first answer"
                      f" {f * 1000:7.1f} ms, all {n} answered {a * 1000:7.1f} ms",
                      file=sys.stderr)
    return [
        {
            "sessions": n,
            "clients": clients,
            "first_answer_ms": summary(first[clients]),
            "all_answered_ms": summary(every[clients]),
            "samples_all_ms": [round(x * 1000, 1) for x in every[clients]],
            "workers_adopted": True,
            "sessions_lost": 0,
            "create_s": round(created_s, 2),
        }
        for clients in modes
    ]


def _one_supervisor_kill(env: Env, layout: Layout, pool: Pool, sessions: list[str],
                         workers: dict[str, tuple[int, str | None]], clients: int,
                         rep: int) -> tuple[float, float]:
    """Kill -9 the supervisor; seconds until the first and until every session answered.

    Raises:
        BenchError: a worker was respawned instead of adopted, or a session was lost.
    """
    pid, sid = _wait(lambda: _supervisor(env), "a live supervisor")
    if not _ours(env, pid, sid):
        raise BenchError(f"supervisor pid {pid} is not ours")
    text = f"after kill {rep} with {clients} clients"
    t_kill = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    done = pool.run(sessions, _prompt(text), threads=clients)
    times = sorted(t for t, _r in done.values())
    # checks: a new supervisor, every worker adopted (same pid and start id), none lost
    new = _wait(lambda: _supervisor(env), "the new supervisor")
    if new[0] == pid:
        raise BenchError("the killed supervisor is still the owner")
    now = _workers(env)
    if now != workers:
        moved = sorted(s for s in sessions if now.get(s) != workers[s])
        raise BenchError(f"{len(moved)} workers respawned, not adopted: {moved}")
    check = SyncClient(layout, autostart=False)
    rows = check.request("sessions")
    check.close()
    ready = {r["session"] for r in rows
             if r["state"] == "ready" and r["pid"] == workers[r["session"]][0]}
    if ready != set(sessions):
        raise BenchError(f"sessions lost: {sorted(set(sessions) - ready)}")
    # autostart losers exit on their own; let them, so kills do not overlap
    _wait(functools.partial(_no_strays, env, new[0]), "autostart losers to exit", 30)
    return times[0] - t_kill, times[-1] - t_kill


# --- (b) worker kill -9 -------------------------------------------------------------------------


def worker_kill(reps: int) -> dict[str, Any]:
    pools: list[Pool] = []
    samples: list[float] = []
    with _bench_env(pools) as (env, layout):
        sessions = [f"w{i:02d}" for i in range(WORKER_SESSIONS)]
        pools.append(pool := Pool(layout))
        pool.run(sessions, _create)
        client = SyncClient(layout, autostart=False)
        pool.clients.append(client)
        for rep in range(reps):
            session = sessions[rep % len(sessions)]
            pid, sid = _workers(env)[session]
            if not _ours(env, pid, sid):
                raise BenchError(f"worker pid {pid} of {session} is not ours")
            text = f"after worker kill {rep}"
            t_kill = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            result = client.request("prompt", {"session": session, "text": text})
            samples.append(time.perf_counter() - t_kill)
            if not echo_ok(result, text):
                raise BenchError(f"wrong answer {result!r}")
            new = _workers(env)[session]
            if new[0] == pid:
                raise BenchError(f"{session}: answered, but its descriptor still names {pid}")
            print(f"  worker kill {rep + 1:2d}/{reps} ({session}): answered again in"
                  f" {samples[-1] * 1000:7.1f} ms", file=sys.stderr)
        rows = client.request("sessions")
        client.close()
        restarts = {r["session"]: r["restarts"] for r in rows}
        lost = [s for s in sessions if restarts.get(s) is None]
        if lost or sum(restarts.values()) != reps:
            raise BenchError(f"sessions lost {lost} or restarts {restarts} != {reps} kills")
    return {"kills": reps, "sessions": WORKER_SESSIONS, "answered_again_ms": summary(samples),
            "samples_ms": [round(x * 1000, 1) for x in samples]}


# --- main -----------------------------------------------------------------------------------------


def run(sizes: list[int], worker_reps: int, modes: tuple[int, ...],
        reps: Callable[[int], int] | None = None) -> dict[str, Any]:
    """Both figures as data; ``reps(n)`` kills per client mode at ``n`` sessions (default 5 at
    10 sessions or fewer, else 3)."""
    t0 = time.monotonic()
    per = reps or (lambda n: 5 if n <= 10 else 3)
    sup = [r for n in sizes for r in supervisor_kill(n, per(n), modes)]
    wrk = worker_kill(worker_reps) if worker_reps else None
    return {"machine": machine(), "supervisor_kill": sup, "worker_kill": wrk,
            "total_s": round(time.monotonic() - t0, 1)}


def main(sizes: list[int], worker_reps: int, modes: tuple[int, ...]) -> dict[str, Any]:
    result = run(sizes, worker_reps, modes)
    sup, wrk = result["supervisor_kill"], result["worker_kill"]
    print(f"machine: {machine()}")
    print("supervisor kill -9 → sessions answering again, ms from the kill (the prompts"
          " autostart the next supervisor; it adopts every worker)")
    print(f"{'sessions':>8}  {'clients':>7}  {'kills':>5}  {'first answer med/min/max':>26}"
          f"  {'all answered med/min/max':>26}")
    for r in sup:
        f, a = r["first_answer_ms"], r["all_answered_ms"]
        print(f"{r['sessions']:>8}  {r['clients']:>7}  {a['n']:>5.0f}  {_mmm(f):>26}"
              f"  {_mmm(a):>26}")
    if wrk is not None:
        w = wrk["answered_again_ms"]
        print(f"worker kill -9 → session answering again: {_mmm(w)} ms"
              f" (median/min/max, n={w['n']:.0f})")
    print(f"every worker adopted (same pid and start id), 0 sessions lost;"
          f" total {result['total_s']} s")
    return result


def _mmm(s: dict[str, float]) -> str:
    return f"{s['median']:.0f} / {s['min']:.0f} / {s['max']:.0f}"


def _cli() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10,50,100", help="session counts (default 10,50,100)")
    p.add_argument("--worker-reps", type=int, default=20, help="worker kills (default 20)")
    p.add_argument("--clients", default=f"1,{POOL}",
                   help=f"client threads prompting after a supervisor kill (default 1,{POOL})")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    args = p.parse_args()
    try:
        result = main([int(x) for x in args.sizes.split(",") if x], args.worker_reps,
                      tuple(int(x) for x in args.clients.split(",") if x))
    except KeyboardInterrupt:
        print("interrupted: everything started was killed", file=sys.stderr)
        sys.exit(130)
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    _cli()
