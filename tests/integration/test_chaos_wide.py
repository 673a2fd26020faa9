"""Wider bounded chaos: every fault a user meets, one after another, under a steady load.

Four client threads (one :class:`~trio_agentd._syncclient.SyncClient` each) prompt all the
time: three on echo sessions ``e0`` to ``e2``, one on the shell session ``sh``, whose every turn
appends its own text to a side-effect log (``effects.log``) between two sleeps. Meanwhile a
seeded chaos loop, waiting for answered prompts between two steps, does one of:

- ``kill -9`` of the supervisor, of a worker, or of both;
- ``trio-agentd cancel sh`` while a shell turn runs;
- ``trio-agentd kill kN`` of a fresh session, sometimes with a ``kill -9`` of the supervisor
  while the stop is under way (the stop must survive it);
- lets ``i0``/``i1`` be evicted by idleness (``idle_eviction`` 2 s through
  ``TRIO_AGENTD_TIMING``), sometimes kills or restarts the supervisor then, and checks the
  eviction stands until the session's next prompt;
- ``trio-agentd restart``;
- ``trio-agentd doctor --fix``, on a healthy supervisor (must touch nothing) or on a SIGSTOPped
  one (must replace it);
- descriptor pressure: the supervisor's soft ``RLIMIT_NOFILE`` is lowered (``prlimit``) and
  idle connections fill it, for a while;
- a full disk: ``RLIMIT_FSIZE`` 0 on every daemon process (EFBIG, as ENOSPC would be), for a
  while.

Each kind of step happens at least once. Afterwards: 0 accepted commands lost (no journal has an
accepted command without its end, every answered prompt is journalled completed and is in its
transcript / side-effect log exactly once), 0 run twice (no prompt text twice in a transcript or
the side-effect log), 0 stops undone (every killed session is gone and its worker dead, every
eviction held), every client error is one the step running at that time explains (its code and
time window), and no prompt waited longer than :data:`PROMPT_BOUND`.

Rerun a failing seed with ``TA_CHAOS_SEED=<seed>``; ``TA_CHAOS_SECONDS`` changes the chaos time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import resource
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from trio_agentd import _journal
from trio_agentd._defaults import PATIENCE
from trio_agentd._errors import AgentdError
from trio_agentd._identity import is_zombie, read_start_id
from trio_agentd._paths import Layout
from trio_agentd._syncclient import SyncClient

from .harness import DaemonEnv, daemon_env, wait_for
from .test_chaos import (
    MAX_PROMPTS_PER_SESSION,
    _jsonl,
    _live_supervisor,
    _live_workers,
    _logs,
    _new_supervisor,
    _new_worker,
    _ours,
)

ECHO = ("e0", "e1", "e2")
SHELL = "sh"
IDLE = ("i0", "i1")
CHAOS_SECONDS = float(os.environ.get("TA_CHAOS_SECONDS", "40"))
HARD_DEADLINE = 100.0  # seconds from the start of the test to the end of its checks
PROGRESS_MIN, PROGRESS_MAX = 3, 15  # answered prompts between two steps
WORKER_KILLS_PER_SESSION = 4  # below restart_intensity (5 in 60 s): never `failed`
IDLE_EVICTION = 2.0
# the daemon's timing in this test: quick eviction, a short stop grace for cancels and stops
TIMING = {"idle_eviction": IDLE_EVICTION, "idle_sweep_period": 0.25, "stop_grace": 0.5}
# The bound every prompt is held to, start to answer (or error): the client's patience with a
# live supervisor that does not answer (PATIENCE, 15 s, docs/operations.md "A slow supervisor
# is not a wedged one"). It is the longest wait any single documented recovery path may make a
# prompt wait before it is answered or told why not — a prompt waiting for a worker to become
# ready (worker_connect_timeout, 30 s) or resending for RETRY_FOR (60 s) would break it.
PROMPT_BOUND = PATIENCE
FAULTS = ("kill_sup", "kill_worker", "kill_both", "cancel", "kill_session", "evict",
          "restart", "doctor_healthy", "doctor_stopped", "fd", "disk")
# shell turns: wait, leave the side effect, wait (a cancel or a kill can land either side)
SHELL_TURN = "sleep 0.15; echo {text} >> {log}; sleep 0.25"
ERROR_PAUSE = 0.05  # a client thread's pause after an error before its next prompt


@dataclass
class Sent:
    session: str
    text: str
    client_id: str
    start: float
    id: int = 0
    end: float = 0.0
    turn: int | None = None  # set when answered
    exit_status: int | None = None
    error: str | None = None  # the error code when it failed
    message: str = ""  # and its message


@dataclass
class Window:
    """A step that may explain client errors: ``codes`` for ``sessions`` during [start, end]."""

    kind: str
    start: float
    end: float = float("inf")
    codes: frozenset[str] = frozenset()
    sessions: frozenset[str] = frozenset((*ECHO, SHELL))


@dataclass
class Load:
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    sent: list[Sent] = field(default_factory=list)
    oddities: list[str] = field(default_factory=list)  # wrong answers, unexpected exceptions
    per_session: Counter[str] = field(default_factory=Counter)
    in_flight: Counter[str] = field(default_factory=Counter)

    def answered_count(self) -> int:
        with self.lock:
            return sum(1 for r in self.sent if r.turn is not None)

    def done(self) -> list[Sent]:
        with self.lock:
            return [r for r in self.sent if r.end]



def _turns(path: Path, torn_allowed: int) -> list[dict[str, Any]]:
    """The transcript's turn records (it also holds events: workers started, stopped)."""
    return [rec for rec in _jsonl(path, torn_allowed) if rec.get("kind") == "turn"]

def _client_thread(layout: Layout, load: Load, index: int, seed: int, deadline: float,
                   effects: Path, clients: list[SyncClient]) -> None:
    rng = random.Random(seed * 1000 + index)
    client = SyncClient(layout)
    clients.append(client)
    sessions = (SHELL,) if index == 0 else ECHO
    n = 0
    try:
        while not load.stop.is_set() and time.monotonic() < deadline:
            with load.lock:
                open_sessions = [s for s in sessions
                                 if load.per_session[s] < MAX_PROMPTS_PER_SESSION]
                if not open_sessions:
                    return
                session = rng.choice(open_sessions)
                load.per_session[session] += 1
                n += 1
                rec = Sent(session, f"w{index}-{n}-{session}", client.client_id,
                           time.monotonic())
                load.sent.append(rec)
                load.in_flight[session] += 1
            text = (SHELL_TURN.format(text=rec.text, log=effects) if session == SHELL
                    else rec.text)
            result: Any = None
            try:
                result = client.request("prompt", {"session": session, "text": text})
            except AgentdError as exc:
                rec.error, rec.message = exc.code, exc.message
                if "Traceback" in exc.message or "\n" in exc.message.strip():
                    with load.lock:
                        load.oddities.append(f"{rec.text}: not one line: {exc.message!r}")
            except Exception as exc:  # a client must never see anything else
                rec.error = "exception"
                with load.lock:
                    load.oddities.append(f"{rec.text}: {exc!r}")
            finally:
                rec.id = client._ids  # the command id request() used (and resent)
                with load.lock:
                    rec.end = time.monotonic()
                    load.in_flight[session] -= 1
            if result is None:
                # a person sends again a moment later, not in a tight loop (the pause is this
                # client's own pace, not a wait for anything)
                time.sleep(ERROR_PAUSE)
                continue
            want = "" if session == SHELL else f"[echo turn {result.get('turn')}] {text}\n"
            with load.lock:
                if result.get("session") != session or result.get("reply") != want:
                    load.oddities.append(f"{rec.text}: wrong answer {result!r}")
                    continue
                rec.exit_status = result.get("exit_status")
                rec.turn = int(result["turn"])
    finally:
        client.close()


def _reached(load: Load, n: int, threads: list[threading.Thread]) -> bool:
    return load.answered_count() >= n or not any(t.is_alive() for t in threads)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _alive(pid: int, start_id: str) -> bool:
    """Is this very process still running? (A zombie is not: a supervisor that ``restart``
    started is reparented when its parent exits, and its reaper may take a moment.)"""
    return read_start_id(pid) == start_id and not is_zombie(pid)


@pytest.mark.timeout(115)
@pytest.mark.filterwarnings(r"ignore:subprocess \d+ is still running:ResourceWarning")
def test_wide_chaos_kills_cancels_evictions_restarts_doctor_fd_pressure_and_full_disk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t0 = time.monotonic()
    seed = int(os.environ.get("TA_CHAOS_SEED") or random.randrange(1 << 32))
    print(f"\nwide chaos seed {seed} (rerun with TA_CHAOS_SEED={seed})")
    with daemon_env(extra_env={"TRIO_AGENTD_TIMING": json.dumps(TIMING)}) as env:
        # the in-process autostart (SyncClient) uses this process's environment: the env's
        # paths, its timing and the TA_TEST_RUN marker, so teardown finds and kills it
        for name in list(os.environ):
            if name.startswith(("TRIO_AGENTD_", "XDG_")):
                monkeypatch.delenv(name)
        for name in ("TRIO_AGENTD_HOME", "TRIO_AGENTD_REGISTRY_DIR", "TRIO_AGENTD_SOCKET",
                     "TRIO_AGENTD_TIMING", "TA_TEST_RUN", "HOME", "XDG_RUNTIME_DIR"):
            monkeypatch.setenv(name, env.env[name])
        chaos = WideChaos(env, seed, t0)
        try:
            chaos.run()
        except BaseException:
            print(_logs(env))
            raise
        finally:
            chaos.stop_clients()
            chaos.unlimit()


class WideChaos:
    def __init__(self, env: DaemonEnv, seed: int, t0: float) -> None:
        self.env = env
        self.seed = seed
        self.rng = random.Random(seed)
        self.t0 = t0
        self.deadline = t0 + HARD_DEADLINE
        self.layout = Layout.resolve(socket=env.socket, home=env.home, registry=env.registry)
        self.effects = env.root / "effects.log"
        self.load = Load()
        self.clients: list[SyncClient] = []
        self.threads: list[threading.Thread] = []
        self.windows: list[Window] = []
        self.done: Counter[str] = Counter()
        self.kills_of: Counter[str] = Counter()
        self.killed: dict[str, tuple[int, str]] = {}  # session -> the worker its kill stopped
        self.idle_turns: Counter[str] = Counter()
        self.idle_prompts: list[Sent] = []
        self.idle_workers: dict[str, tuple[int, str]] = {}  # the worker of its last prompt
        self.limited: set[int] = set()  # pids whose limits a fault lowered (restored after)
        self.probes: list[str] = []  # sessions a prompt under a full disk began
        self.cancelled = 0
        self.evictions = 0

    def left(self, cap: float = 30.0) -> float:
        return max(0.1, min(cap, self.deadline - time.monotonic()))

    def at(self) -> str:
        return f"t={time.monotonic() - self.t0:5.1f}s"

    def stop_clients(self) -> None:
        self.load.stop.set()
        for c in self.clients:
            c.autostart = False
        for t in self.threads:
            t.join(timeout=max(0.5, self.deadline - time.monotonic()))

    def unlimit(self) -> None:
        """Raise every limit a fault lowered (a failing test must not leave a process limited
        while teardown runs)."""
        unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        for pid in sorted(self.limited):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                resource.prlimit(pid, resource.RLIMIT_FSIZE, unlimited)
        self.limited.clear()

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        load = self.load
        setup = SyncClient(self.layout)
        for s in ECHO + IDLE:
            assert setup.request("create_session", {"session": s, "agent": "echo"})
        assert setup.request("create_session", {"session": SHELL, "agent": "shell"})
        setup.close()
        for s in IDLE:
            self.prompt_idle(s)
        chaos_start = time.monotonic()
        chaos_end = chaos_start + CHAOS_SECONDS
        for i in range(4):
            t = threading.Thread(
                target=_client_thread, name=f"wide-chaos-client-{i}", daemon=True,
                args=(self.layout, load, i, self.seed, chaos_end + 5, self.effects,
                      self.clients),
            )
            self.threads.append(t)
            t.start()
        plan = list(FAULTS)
        self.rng.shuffle(plan)
        while time.monotonic() < chaos_end or plan:
            need = load.answered_count() + self.rng.randint(PROGRESS_MIN, PROGRESS_MAX)
            wait_for(functools.partial(_reached, load, need, self.threads),
                     timeout=self.left(), what=f"{need} answered prompts (recovery progress)")
            if not any(t.is_alive() for t in self.threads):
                break
            kind = plan.pop() if plan else self.rng.choice(FAULTS)
            getattr(self, f"step_{kind}")()
            self.done[kind] += 1
        self.finish()

    # --- steps ------------------------------------------------------------------------------
    def supervisor(self) -> tuple[int, str]:
        sup = wait_for(lambda: _live_supervisor(self.env), timeout=self.left(),
                       what="a live supervisor")
        assert sup is not None
        return sup

    def kill9_supervisor(self, sup: tuple[int, str]) -> None:
        if _ours(self.env, *sup):
            os.kill(sup[0], signal.SIGKILL)
        # routed clients need no supervisor: the next command that does (this one) starts one
        cp = self.env.run("sessions", timeout=self.left())
        assert cp.returncode == 0, cp.stderr
        wait_for(functools.partial(_new_supervisor, self.env, sup[0]), timeout=self.left(),
                 what="a new supervisor")

    def worker_victim(self) -> str | None:
        workers = _live_workers(self.env)
        victims = sorted(s for s in (*ECHO, SHELL)
                         if s in workers and self.kills_of[s] < WORKER_KILLS_PER_SESSION)
        with self.load.lock:
            busy = [s for s in victims if self.load.in_flight[s]]
        return self.rng.choice(busy or victims) if victims else None

    def kill9_worker(self, session: str) -> None:
        workers = _live_workers(self.env)
        if session not in workers or not _ours(self.env, *workers[session]):
            return
        pid = workers[session][0]
        codes = frozenset({"command_interrupted"}) if session == SHELL else frozenset()
        w = self.window("kill_worker", codes, frozenset({session}))
        os.kill(pid, signal.SIGKILL)
        self.kills_of[session] += 1
        print(f"  {self.at()} kill -9 worker {session} pid {pid}")
        wait_for(functools.partial(_new_worker, self.env, session, pid), timeout=self.left(),
                 what=f"session {session} to get a new worker")
        w.end = time.monotonic()

    def window(self, kind: str, codes: frozenset[str],
               sessions: frozenset[str] = frozenset((*ECHO, SHELL))) -> Window:
        w = Window(kind, time.monotonic(), codes=codes, sessions=sessions)
        self.windows.append(w)
        return w

    def step_kill_sup(self) -> None:
        sup = self.supervisor()
        print(f"  {self.at()} kill -9 supervisor pid {sup[0]}")
        self.kill9_supervisor(sup)

    def step_kill_worker(self) -> None:
        session = self.worker_victim()
        if session is not None:
            self.kill9_worker(session)

    def step_kill_both(self) -> None:
        sup = self.supervisor()
        session = self.worker_victim()
        if session is None:
            return self.step_kill_sup()
        workers = _live_workers(self.env)
        if session not in workers:
            return self.step_kill_sup()
        pid = workers[session][0]
        codes = frozenset({"command_interrupted"}) if session == SHELL else frozenset()
        w = self.window("kill_both", codes, frozenset({session}))
        if _ours(self.env, *workers[session]):
            os.kill(pid, signal.SIGKILL)
            self.kills_of[session] += 1
        print(f"  {self.at()} kill -9 worker {session} pid {pid} + supervisor pid {sup[0]}")
        self.kill9_supervisor(sup)
        wait_for(functools.partial(_new_worker, self.env, session, pid), timeout=self.left(),
                 what=f"session {session} to get a new worker")
        w.end = time.monotonic()

    def step_cancel(self) -> None:
        # a shell turn lasts 0.4 s and the shell client sends the next at once: wait until the
        # client is waiting for one, then cancel whatever the session runs (a cancel that
        # lands between two turns finds none: then again, a few times)
        w = self.window("cancel", frozenset({"command_cancelled"}), frozenset({SHELL}))
        for _ in range(5):
            wait_for(lambda: self.load.in_flight[SHELL] > 0, timeout=self.left(),
                     what="a shell prompt in flight")
            cp = self.env.run("cancel", SHELL, timeout=self.left())
            assert cp.returncode == 0, cp.stderr
            assert cp.stdout in ("cancelled the running turn of session sh\n",
                                 "session sh runs no turn\n"), cp.stdout
            print(f"  {self.at()} cancel sh: {cp.stdout.strip()}")
            if cp.stdout.startswith("cancelled"):
                self.cancelled += 1
                break
        w.end = time.monotonic()

    def step_kill_session(self) -> None:
        name = f"k{self.done['kill_session']}"
        assert self.env.prompt("doomed", session=name) == "[echo turn 1] doomed"
        worker = wait_for(lambda: _live_workers(self.env).get(name), timeout=self.left(),
                          what=f"the worker of {name}")
        assert worker is not None
        race = self.rng.random() < 0.5
        sup = self.supervisor()
        print(f"  {self.at()} kill {name} (worker pid {worker[0]})"
              f"{' + kill -9 supervisor during the stop' if race else ''}")
        if race:
            p = self.env.popen("kill", name)
            # as soon as the stop intent is on disk (or the stop is over), kill the supervisor
            wait_for(lambda: self.stopping_or_gone(name) or p.poll() is not None,
                     timeout=self.left(), interval=0.002, what=f"the stop of {name} to begin")
            self.kill9_supervisor(sup)
            out, err = p.communicate(timeout=self.left())
            # the CLI resends its kill to the successor, which finds the stop done or finishes it
            assert p.returncode in (0, 1), (p.returncode, out, err)
            assert "Traceback" not in err, err
        else:
            cp = self.env.run("kill", name, timeout=self.left())
            assert cp.returncode == 0, cp.stderr
        self.killed[name] = worker
        wait_for(lambda: not _alive(*worker), timeout=self.left(),
                 what=f"the worker of killed session {name} to end")
        self.check_killed(name)

    def stopping_or_gone(self, name: str) -> bool:
        for d in self.env.descriptors():
            if d.get("session") == name:
                return d.get("lifecycle") != "ready"
        return True

    def sessions(self) -> dict[str, dict[str, Any]]:
        cp = self.env.run("sessions", "--json", timeout=self.left())
        assert cp.returncode == 0, cp.stderr
        return {r["session"]: r for r in json.loads(cp.stdout)}

    def check_killed(self, name: str) -> None:
        rows = self.sessions()
        assert name not in rows, f"killed session {name} is back: {rows[name]}"
        assert name not in _live_workers(self.env), f"killed session {name} has a worker"
        assert not _alive(*self.killed[name])

    def step_evict(self) -> None:
        name = self.rng.choice(IDLE)
        worker = self.idle_workers[name]
        # idle_eviction after its last turn, then the sweep and the graceful stop
        wait_for(lambda: self.sessions()[name]["state"] == "evicted", interval=0.2,
                 timeout=self.left(), what=f"{name} to be evicted")
        wait_for(lambda: not _alive(*worker), timeout=self.left(),
                 what=f"the evicted worker of {name} to end")
        self.evictions += 1
        then = self.rng.choice(("nothing", "kill -9 supervisor", "restart"))
        print(f"  {self.at()} {name} evicted (worker pid {worker[0]}), then {then}")
        if then == "kill -9 supervisor":
            self.kill9_supervisor(self.supervisor())
        elif then == "restart":
            self.step_restart()
        # the eviction stands until the session's next prompt
        rows = self.sessions()
        assert rows[name]["state"] == "evicted", f"the eviction of {name} was undone: {rows}"
        assert name not in _live_workers(self.env), f"evicted {name} has a worker"
        assert not _alive(*worker)
        self.prompt_idle(name)

    def prompt_idle(self, name: str) -> None:
        self.idle_turns[name] += 1
        rec = Sent(name, f"idle-{name}-{self.idle_turns[name]}", "cli", time.monotonic())
        got = self.env.prompt(rec.text, session=name)
        rec.end = time.monotonic()
        rec.turn = self.idle_turns[name]
        assert got == f"[echo turn {rec.turn}] {rec.text}", got
        self.idle_prompts.append(rec)
        worker = wait_for(lambda: _live_workers(self.env).get(name), timeout=self.left(),
                          what=f"the worker of {name}")
        assert worker is not None
        self.idle_workers[name] = worker

    def step_restart(self) -> None:
        sup = self.supervisor()
        cp = self.env.run("restart", timeout=self.left())
        assert cp.returncode == 0, cp.stderr
        # restart returns once the new supervisor answers a hello; its record says "owner"
        # once it has adopted the sessions, a moment later (a full disk, killed workers)
        new = wait_for(lambda: _new_supervisor(self.env, sup[0]), timeout=self.left(),
                       what="the new supervisor's owner record after restart")
        assert new is not None  # (wait_for returns a true value)
        print(f"  {self.at()} restart: supervisor pid {sup[0]} -> {new[0]}")

    def step_doctor_healthy(self) -> None:
        sup = self.supervisor()
        cp = self.env.run("doctor", "--fix", timeout=self.left())
        assert cp.returncode == 0, (cp.stdout, cp.stderr)
        assert _live_supervisor(self.env) == sup, "doctor --fix touched a healthy supervisor"
        print(f"  {self.at()} doctor --fix on a healthy supervisor: left alone")

    def step_doctor_stopped(self) -> None:
        sup = self.supervisor()
        print(f"  {self.at()} SIGSTOP supervisor pid {sup[0]}, then doctor --fix")
        os.kill(sup[0], signal.SIGSTOP)
        try:
            cp = self.env.run("doctor", "--fix", timeout=self.left())
        finally:
            if _ours(self.env, *sup):
                os.kill(sup[0], signal.SIGCONT)
        assert cp.returncode == 0, (cp.stdout, cp.stderr)
        assert not _alive(*sup), ("doctor --fix left the stopped supervisor alive", cp.stdout,
                                  cp.stderr)
        new = wait_for(functools.partial(_new_supervisor, self.env, sup[0]),
                       timeout=self.left(), what="the supervisor doctor --fix started")
        assert new is not None
        print(f"  {self.at()} doctor --fix replaced it: pid {new[0]}")

    def step_fd(self) -> None:
        sup = self.supervisor()
        soft, hard = resource.prlimit(sup[0], resource.RLIMIT_NOFILE)
        w = self.window("fd", frozenset({"resource_exhausted"}))
        resource.prlimit(sup[0], resource.RLIMIT_NOFILE, (_fds(sup[0]) + 8, hard))
        idle: list[socket.socket] = []
        refused = 0
        try:
            for _ in range(64):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                idle.append(s)
                s.settimeout(5)
                s.connect(self.env.socket)
                first = s.recv(65536)
                if b'"resource_exhausted"' in first:
                    refused += 1
                    if refused >= 3:
                        break
            assert refused, "the descriptor limit was never reached"
            print(f"  {self.at()} fd pressure: {len(idle)} idle connections,"
                  f" {refused} refused, holding 1 s")
            time.sleep(1.0)  # the fault's own duration (not a wait for an event)
        finally:
            for s in idle:
                s.close()
            if _ours(self.env, *sup):
                resource.prlimit(sup[0], resource.RLIMIT_NOFILE, (soft, hard))
            w.end = time.monotonic()

    def step_disk(self) -> None:
        sup = self.supervisor()
        w = self.window("disk", frozenset({"storage_error"}))
        full = (0, resource.RLIM_INFINITY)
        pids = [sup[0], *(p for p in self.env.our_pids() if p != sup[0])]
        for pid in pids:
            try:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, full)
                self.limited.add(pid)
            except ProcessLookupError:
                pass
        print(f"  {self.at()} disk full for {len(self.limited)} processes")
        try:
            # the fault bites, then lasts a moment longer. A prompt of the load may not meet it:
            # a worker writes its records into room it made ahead, and late in the run the
            # load may be over (its sessions at their cap, its threads past their end). A
            # prompt that makes a session always does: it writes new files, refused at once
            probe = f"d{self.done['disk']}"
            client = SyncClient(self.layout)
            try:
                with pytest.raises(AgentdError) as refused:
                    client.request("prompt", {"session": probe, "text": "probe"})
            finally:
                client.close()
            assert refused.value.code == "storage_error", refused.value
            assert "EFBIG" in refused.value.message, refused.value.message
            time.sleep(0.5)  # the fault's own duration (not a wait for an event)
        finally:
            # the supervisor first, so a worker it spawns meanwhile is found by the next scan
            self.unlimit()
            for pid in self.env.our_pids():
                try:
                    lim = resource.prlimit(pid, resource.RLIMIT_FSIZE)
                    if lim[0] != resource.RLIM_INFINITY:
                        self.limited.add(pid)
                except ProcessLookupError:
                    pass
            self.unlimit()
            w.end = time.monotonic()
        # the session the refused prompt began serves once there is room again
        assert self.env.prompt("again", session=probe) == "[echo turn 1] again"
        self.probes.append(probe)

    # --- the checks -------------------------------------------------------------------------
    def finish(self) -> None:
        env, load = self.env, self.load
        load.stop.set()
        for t in self.threads:
            t.join(timeout=self.left(60))
        hung = [t.name for t in self.threads if t.is_alive()]
        assert not hung, f"client threads still waiting for an answer (hang): {hung}"

        # every session serves after the chaos
        final = SyncClient(self.layout)
        for s in (*ECHO, SHELL):
            start = time.monotonic()
            rec = Sent(s, f"final-{s}", final.client_id, start)
            text = SHELL_TURN.format(text=rec.text, log=self.effects) if s == SHELL else rec.text
            result = final.request("prompt", {"session": s, "text": text})
            rec.id, rec.end, rec.turn = final._ids, time.monotonic(), int(result["turn"])
            rec.exit_status = result.get("exit_status")
            load.sent.append(rec)
        final.close()
        for s in IDLE:
            self.prompt_idle(s)

        sent = load.done()
        errors = [r for r in sent if r.error is not None]
        answered = [r for r in sent if r.turn is not None]
        slowest = max(sent + self.idle_prompts, key=lambda r: r.end - r.start)
        print(f"wide chaos counts: steps {dict(sorted(self.done.items()))}, prompts"
              f" {len(sent)}, answered {len(answered)}, errors"
              f" {dict(Counter(r.error for r in errors))}, cancelled turns {self.cancelled},"
              f" evictions {self.evictions}, idle prompts {len(self.idle_prompts)}, slowest"
              f" prompt {slowest.end - slowest.start:.2f}s ({slowest.text}),"
              f" seconds {time.monotonic() - self.t0:.1f}")
        assert load.oddities == [], load.oddities[:20]
        assert set(self.done) == set(FAULTS), self.done
        assert self.cancelled >= 1
        assert self.evictions >= 1

        # every error is explained by the step running at that time
        for r in errors:
            ok = [w.kind for w in self.windows if r.error in w.codes
                  and r.session in w.sessions and r.start <= w.end and r.end >= w.start]
            assert ok, (f"{r.text}: {r.error} ({r.message}) at t={r.start - self.t0:.2f}.."
                        f"{r.end - self.t0:.2f}s, explained by no step: "
                        f"{[(w.kind, w.start - self.t0, w.end - self.t0) for w in self.windows]}")

        # no prompt waited longer than its documented bound
        for r in (*sent, *self.idle_prompts):
            assert r.end - r.start <= PROMPT_BOUND, (
                f"{r.text} waited {r.end - r.start:.2f}s (bound {PROMPT_BOUND:g}s),"
                f" from t={r.start - self.t0:.2f}s")

        # 0 stops undone: every killed session stays gone, its worker dead
        for name in self.killed:
            self.check_killed(name)
        rows = self.sessions()
        assert set(rows) == {*ECHO, SHELL, *IDLE, *self.probes}, rows
        # (the final prompts may be more than idle_eviction ago: evicted, or being evicted, is
        # fine; failed or recovering is not)
        assert {r["state"] for r in rows.values()} <= {"ready", "evicted", "stopping"}, rows

        journal_dir = env.state_dir() / "journal"
        effects = Counter(self.effects.read_text().split()) if self.effects.exists() \
            else Counter()
        for s in (*ECHO, SHELL):
            self.check_session(s, [r for r in sent if r.session == s], journal_dir, effects)
        for s in IDLE:
            tr = _turns(env.home / "sessions" / s / "transcript.jsonl", self.kills_of[s])
            assert [line["prompt"] for line in tr] == [
                r.text for r in self.idle_prompts if r.session == s]
            assert [int(line["turn"]) for line in tr] == list(range(1, len(tr) + 1))

    def explain_pending(self, s: str, pending: list[tuple[_journal.Key, dict[str, Any]]],
                        sent: list[Sent], raw: bytes) -> str:
        """Everything known of commands accepted but never ended: what the client saw, the
        journal's records of them, the steps around them and the log lines naming them."""
        lines = [f"{s}: accepted but never ended: {pending}"]
        by_key = {(r.client_id, str(r.id)): r for r in sent}
        for k, _rec in pending:
            r = by_key.get((k[0], str(k[1])))
            if r is None:
                lines.append(f"  {k}: no client record")
                continue
            lines.append(f"  {k}: {r.text} t={r.start - self.t0:.2f}..{r.end - self.t0:.2f}s"
                         f" turn={r.turn} error={r.error} ({r.message})")
            lines.extend(f"    step {w.kind} {w.start - self.t0:.2f}..{w.end - self.t0:.2f}s"
                         for w in self.windows if w.start <= r.end + 1 and w.end >= r.start - 1)
            lines.extend(f"    journal {line}" for line in raw.decode(errors="replace").splitlines()
                         if k[0] in line and f'"id":{k[1]}' in line.replace(" ", ""))
        lines.append(_logs(self.env))
        return "\n".join(lines)

    def check_session(self, s: str, sent: list[Sent], journal_dir: Path,
                      effects: Counter[str]) -> None:
        env = self.env
        tr = _turns(env.home / "sessions" / s / "transcript.jsonl", self.kills_of[s])
        turns = [int(line["turn"]) for line in tr]
        assert turns == list(range(1, len(tr) + 1)), f"{s}: turns {turns}"
        raw = (journal_dir / f"{s}.jsonl").read_bytes()
        parsed = _journal.parse(raw)
        # 0 accepted commands lost: each accepted one ended (completed or interrupted)
        assert parsed.pending() == [], self.explain_pending(s, parsed.pending(), sent, raw)
        journal = _jsonl(journal_dir / f"{s}.jsonl", self.kills_of[s])
        accepted = {(j["client_id"], str(j["id"])): j for j in journal if j["kind"] == "accepted"}
        completed = {(j["client_id"], str(j["id"])): j for j in journal
                     if j["kind"] == "completed"}
        if s == SHELL:
            ran = Counter({t: n for t, n in effects.items() if t.endswith(f"-{s}")})
        else:
            ran = Counter(str(line["prompt"]) for line in tr)
        # 0 run twice: no text has two turns / two side effects
        twice = {t: n for t, n in ran.items() if n > 1}
        assert not twice, f"{s}: ran more than once: {twice}"
        texts = {r.text for r in sent}
        assert set(ran) <= texts, f"{s}: ran but never sent: {set(ran) - texts}"
        for r in sent:
            key = (r.client_id, str(r.id))
            if r.turn is None:
                continue
            # answered: journalled accepted + completed at the turn its client was told, and
            # it ran once (a shell turn whose agent failed, as under a full disk, may not have)
            assert key in accepted, f"{s}: {r.text} {key} not journalled as accepted"
            assert key in completed, f"{s}: {r.text} {key} not journalled as completed"
            assert completed[key]["result"]["turn"] == r.turn, completed[key]
            if s != SHELL or r.exit_status == 0:
                assert ran[r.text] == 1, f"{s}: {r.text} answered but ran {ran[r.text]} times"
