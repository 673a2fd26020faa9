"""Bounded chaos: concurrent clients while the supervisor and workers are ``kill -9``ed at random.

Four echo sessions take prompts with unique texts from four client threads (one
:class:`~trio_agentd._syncclient.SyncClient` each, resending the same ``(client_id, id)`` across
lost connections and autostarting a supervisor when there is none). Meanwhile a seeded chaos loop
kills the supervisor (pid from its owner record) or a worker (pid from its descriptor), and waits
for recovery and for more answered prompts before the next kill. Afterwards every answered
prompt must have run exactly once (transcripts), be journalled as accepted + completed, no
session may be lost, and turn numbers must be 1..N. Echo is replayable, so clients see no error.

Rerun a failing seed with ``TA_CHAOS_SEED=<seed>``; ``TA_CHAOS_SECONDS`` changes the chaos time.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from trio_agentd import _journal
from trio_agentd._errors import AgentdError
from trio_agentd._identity import read_start_id
from trio_agentd._paths import Layout
from trio_agentd._syncclient import SyncClient
from trio_agentd._workerjournal import COMPACT_AFTER

from .harness import DaemonEnv, daemon_env, wait_for

SESSIONS = ("c0", "c1", "c2", "c3")
CLIENTS = 4
CHAOS_SECONDS = float(os.environ.get("TA_CHAOS_SECONDS", "35"))
# seconds from the start of the test to the end of the checks: every wait is bounded by it, and
# pytest-timeout stops the test at 90 s whatever happens (teardown still kills every process)
HARD_DEADLINE = 80.0
# recovery progress required between two kills: answered prompts, at least this many, at most
PROGRESS_MIN, PROGRESS_MAX = 4, 40
# worker kills per session: more than RESTART_INTENSITY (5) respawns within 60 s marks a session
# failed by design, so the chaos stays below it
WORKER_KILLS_PER_SESSION = 4
# prompts per session: the worker journal compacts after COMPACT_AFTER lines (two per prompt) and
# then keeps only the newest results (by design), which would hide answered commands from (b)
MAX_PROMPTS_PER_SESSION = COMPACT_AFTER // 2 - 50


@dataclass
class Sent:
    session: str
    text: str
    client_id: str
    id: int = 0
    turn: int | None = None  # set when answered


@dataclass
class Load:
    """What the client threads did; every field is guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    sent: list[Sent] = field(default_factory=list)
    answered: list[Sent] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    per_session: Counter[str] = field(default_factory=Counter)
    in_flight: Counter[str] = field(default_factory=Counter)
    resent: int = 0

    def answered_count(self) -> int:
        with self.lock:
            return len(self.answered)


def _client_thread(layout: Layout, load: Load, index: int, seed: int, deadline: float,
                   clients: list[SyncClient]) -> None:
    rng = random.Random(seed * 1000 + index)
    client = SyncClient(layout)
    clients.append(client)
    n = 0
    try:
        while not load.stop.is_set() and time.monotonic() < deadline:
            with load.lock:
                open_sessions = [s for s in SESSIONS
                                 if load.per_session[s] < MAX_PROMPTS_PER_SESSION]
                if not open_sessions:
                    return
                session = rng.choice(open_sessions)
                load.per_session[session] += 1
                n += 1
                rec = Sent(session, f"k{index}-{n}-{session}", client.client_id)
                load.sent.append(rec)
                load.in_flight[session] += 1
            try:
                result = client.request("prompt", {"session": session, "text": rec.text})
            except AgentdError as exc:
                with load.lock:
                    load.errors.append(f"{rec.text}: {exc.code}: {exc.message}")
                continue
            except Exception as exc:  # a client must never see anything else either
                with load.lock:
                    load.errors.append(f"{rec.text}: {exc!r}")
                continue
            finally:
                with load.lock:
                    load.in_flight[session] -= 1
            rec.id = client._ids  # the command id request() used (and resent)
            want = f"[echo turn {result.get('turn')}] {rec.text}\n"
            with load.lock:
                load.resent += client.resent
                if result.get("session") != session or result.get("reply") != want:
                    load.errors.append(f"{rec.text}: wrong answer {result!r}")
                    continue
                rec.turn = int(result["turn"])
                load.answered.append(rec)
    finally:
        client.close()


# --- this env's own files ---------------------------------------------------------------------


def _ours(env: DaemonEnv, pid: int, start_id: str | None) -> bool:
    """Is ``pid`` the very process a file of this env names, started inside this env?"""
    if start_id is None or read_start_id(pid) != start_id:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return env.marker in f.read().split(b"\0")
    except OSError:
        return False


def _live_supervisor(env: DaemonEnv) -> tuple[int, str] | None:
    """(pid, start id) of the live supervisor from its owner record, if one is up."""
    for rec in env.owner_records():
        try:
            owner = json.loads((rec / "owner.json").read_bytes())
        except (OSError, ValueError):
            continue
        if (isinstance(owner, dict) and owner.get("phase") == "owner"
                and _ours(env, int(owner["pid"]), owner.get("start_id"))):
            return int(owner["pid"]), str(owner["start_id"])
    return None


def _live_workers(env: DaemonEnv) -> dict[str, tuple[int, str]]:
    """session → (pid, start id) of every ready worker whose descriptor names a live process."""
    out = {}
    for path in (env.home / "daemons").glob("*/workers/*.json"):
        try:
            desc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue  # descriptors are written atomically; a vanished one is skipped
        pid, sid = desc.get("pid"), desc.get("start_id")
        if desc.get("lifecycle") == "ready" and isinstance(pid, int) and _ours(env, pid, sid):
            out[str(desc["session"])] = (pid, str(sid))
    return out


def _new_worker(env: DaemonEnv, session: str, old_pid: int) -> tuple[int, str] | None:
    got = _live_workers(env).get(session)
    return got if got is not None and got[0] != old_pid else None


def _new_supervisor(env: DaemonEnv, old_pid: int) -> tuple[int, str] | None:
    got = _live_supervisor(env)
    return got if got is not None and got[0] != old_pid else None


def _jsonl(path: Path, torn_allowed: int) -> list[dict[str, Any]]:
    """The records of a worker's JSON-lines file, parsed strictly but for torn lines.

    A worker killed in the middle of an append leaves a torn line (the kernel cuts a write at a
    page boundary when SIGKILL arrives); the next worker seals it with a newline and writes on.
    So a line that does not parse is allowed only if it is the start of a record, at most once
    per kill of this session's worker.
    """
    if not path.exists():
        return []
    records, torn = [], []
    for line in _journal.written(path.read_bytes()).splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            assert line.startswith(b'{"kind":'), f"{path.name}: not a record: {line[:200]!r}"
            torn.append(line)
    assert len(torn) <= torn_allowed, f"{path.name}: {len(torn)} torn lines: {torn[:5]}"
    return records


def _logs(env: DaemonEnv) -> str:
    parts = [f"--- daemon.log ---\n{env.log_text()[-20000:]}"]
    for p in sorted((env.home / "sessions").glob("*/worker.log")):
        parts.append(f"--- {p.parent.name}/worker.log ---\n{p.read_text(errors='replace')[-4000:]}")
    return "\n".join(parts)


# --- the test ---------------------------------------------------------------------------------


@pytest.mark.timeout(90)
# the in-process autostart (SyncClient) detaches the supervisor it spawns and drops its Popen:
# by design, the daemon outlives the client
@pytest.mark.filterwarnings(r"ignore:subprocess \d+ is still running:ResourceWarning")
def test_chaos_kill9_supervisor_and_workers_under_load(monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = time.monotonic()
    seed = int(os.environ.get("TA_CHAOS_SEED") or random.randrange(1 << 32))
    print(f"\nchaos seed {seed} (rerun with TA_CHAOS_SEED={seed})")
    with daemon_env() as env:
        # SyncClient autostarts a supervisor with this process's environment: give it the env's
        # paths and the TA_TEST_RUN marker, so teardown finds and kills it
        for name in list(os.environ):
            if name.startswith(("TRIO_AGENTD_", "XDG_")):
                monkeypatch.delenv(name)
        for name in ("TRIO_AGENTD_HOME", "TRIO_AGENTD_REGISTRY_DIR", "TRIO_AGENTD_SOCKET",
                     "TA_TEST_RUN", "HOME"):
            monkeypatch.setenv(name, env.env[name])
        chaos = Chaos(env, seed, t0)
        try:
            chaos.run()
        except BaseException:
            print(_logs(env))
            raise
        finally:
            chaos.stop_clients()


class Chaos:
    def __init__(self, env: DaemonEnv, seed: int, t0: float) -> None:
        self.env = env
        self.seed = seed
        self.rng = random.Random(seed)
        self.t0 = t0
        self.deadline = t0 + HARD_DEADLINE
        self.layout = Layout.resolve(socket=env.socket, home=env.home, registry=env.registry)
        self.load = Load()
        self.clients: list[SyncClient] = []
        self.threads: list[threading.Thread] = []
        self.sup_kills = self.worker_kills = self.respawns = self.new_supervisors = 0
        self.kills_of: Counter[str] = Counter()
        self.known_pids: dict[str, int] = {}
        self.slowest = 0.0  # longest time from a kill to the next recovery progress

    def left(self, cap: float = 30.0) -> float:
        """A timeout for one wait: at most ``cap``, never past the hard deadline."""
        return max(0.1, min(cap, self.deadline - time.monotonic()))

    def stop_clients(self) -> None:
        self.load.stop.set()
        for c in self.clients:
            c.autostart = False  # a straggler must never start a daemon after teardown
        for t in self.threads:
            t.join(timeout=max(0.5, self.deadline - time.monotonic()))

    def run(self) -> None:
        env, load = self.env, self.load
        setup = SyncClient(self.layout)
        for s in SESSIONS:
            assert setup.request("create_session", {"session": s, "agent": "echo"})["session"] == s
        setup.close()
        initial = wait_for(lambda: len(_live_workers(env)) == len(SESSIONS), timeout=self.left(),
                           what="four ready workers")
        assert initial
        self.known_pids = {s: p for s, (p, _sid) in _live_workers(env).items()}
        chaos_start = time.monotonic()
        chaos_end = chaos_start + CHAOS_SECONDS
        for i in range(CLIENTS):
            t = threading.Thread(
                target=_client_thread, name=f"chaos-client-{i}", daemon=True,
                args=(self.layout, load, i, self.seed, chaos_end + 5, self.clients),
            )
            self.threads.append(t)
            t.start()
        killed_at: float | None = None
        while time.monotonic() < chaos_end:
            need = load.answered_count() + self.rng.randint(PROGRESS_MIN, PROGRESS_MAX)
            wait_for(functools.partial(_reached, load, need, self.threads), timeout=self.left(),
                     what=f"{need} answered prompts (recovery progress)")
            if not any(t.is_alive() for t in self.threads):
                break  # every session took its MAX_PROMPTS_PER_SESSION
            if killed_at is not None:
                self.slowest = max(self.slowest, time.monotonic() - killed_at)
            if time.monotonic() >= chaos_end:
                break
            elapsed = (time.monotonic() - chaos_start) / CHAOS_SECONDS
            killed_at = self.kill_one(elapsed)
        self.finish()

    def kill_one(self, elapsed: float) -> float | None:
        """Kill -9 the supervisor, a worker, or both at once; wait until each is replaced.

        Returns when the first kill happened (``None`` if nothing was killed).
        """
        env, load = self.env, self.load
        sup = wait_for(lambda: _live_supervisor(env), timeout=self.left(), what="a live supervisor")
        assert sup is not None
        workers = _live_workers(env)
        for s, (p, _sid) in workers.items():
            if self.known_pids.get(s) != p:
                self.respawns += 1
                self.known_pids[s] = p
        # worker kills are spread over the chaos time (their budget is small), preferring a
        # session with a prompt in flight so that turns get cut and replayed
        budget = WORKER_KILLS_PER_SESSION * len(SESSIONS)
        victims = sorted(s for s in workers if self.kills_of[s] < WORKER_KILLS_PER_SESSION)
        with load.lock:
            busy = [s for s in victims if load.in_flight[s]]
        roll = self.rng.random()
        kill_worker = bool(victims) and self.worker_kills < budget * elapsed + 1 and roll < 0.6
        # sometimes both: the next supervisor then finds a dead worker to respawn and replay
        kill_sup = not kill_worker or roll < 0.15
        session = self.rng.choice(busy or victims) if kill_worker else None
        targets = [workers[session]] if session is not None else []
        if kill_sup:
            targets.append(sup)
        if not all(_ours(env, pid, sid) for pid, sid in targets):
            return None
        killed_at = time.monotonic()
        for pid, _sid in targets:
            os.kill(pid, signal.SIGKILL)
        what = []
        if session is not None:
            self.worker_kills += 1
            self.kills_of[session] += 1
            what.append(f"worker {session} pid {workers[session][0]}"
                        f"{' (busy)' if session in busy else ''}")
        if kill_sup:
            self.sup_kills += 1
            what.append(f"supervisor pid {sup[0]}")
        print(f"  t={killed_at - self.t0:5.1f}s kill -9 {' + '.join(what)}"
              f" (answered {load.answered_count()})")
        if kill_sup:
            # routed clients go on without a supervisor; the next command that needs one
            # (a client's route request, or this one) autostarts it
            env.run("sessions", timeout=self.left())
            wait_for(functools.partial(_new_supervisor, env, sup[0]), timeout=self.left(),
                     what="a new supervisor")
            self.new_supervisors += 1
        if session is not None:
            old = workers[session][0]
            new = wait_for(functools.partial(_new_worker, env, session, old),
                           timeout=self.left(), what=f"session {session} to get a new worker")
            assert new is not None
            self.respawns += 1
            self.known_pids[session] = new[0]
        return killed_at

    def finish(self) -> None:
        env, load = self.env, self.load
        load.stop.set()
        for t in self.threads:
            t.join(timeout=self.left(60))
        hung = [t.name for t in self.threads if t.is_alive()]
        assert not hung, f"client threads still waiting for an answer (hang): {hung}"

        # one clean prompt per session: every session is served after the chaos
        final = SyncClient(self.layout)
        finals: dict[str, int] = {}
        for s in SESSIONS:
            result = final.request("prompt", {"session": s, "text": f"final-{s}"})
            assert result["reply"] == f"[echo turn {result['turn']}] final-{s}\n", result
            finals[s] = int(result["turn"])
            load.answered.append(Sent(s, f"final-{s}", final.client_id, final._ids, finals[s]))
        final.close()

        cp = env.run("sessions", "--json", timeout=self.left())
        assert cp.returncode == 0, cp.stderr
        rows = {r["session"]: r for r in json.loads(cp.stdout)}
        restarts = sum(int(r["restarts"]) for r in rows.values())
        transcripts = {s: [t for t in _jsonl(env.home / "sessions" / s / "transcript.jsonl",
                                             self.kills_of[s])
                           if t.get("kind") == "turn"]  # events besides (worker starts ...)
                       for s in SESSIONS}
        replayed = sum(1 for tr in transcripts.values() for line in tr if line.get("replayed"))
        kills = self.sup_kills + self.worker_kills
        print(f"chaos counts: prompts sent {len(load.sent)}, answered {len(load.answered)}"
              f" (incl. {len(SESSIONS)} final), client errors {len(load.errors)},"
              f" supervisor kills {self.sup_kills} (new supervisors seen"
              f" {self.new_supervisors}), worker kills {self.worker_kills}, respawns seen"
              f" {self.respawns} (restarts reported by `sessions`: {restarts}), replayed turns"
              f" {replayed}, resent commands {load.resent}, slowest recovery"
              f" {self.slowest:.2f}s, seconds {time.monotonic() - self.t0:.1f}")

        # zero client errors: echo is replayable, so even a turn cut by a kill is answered
        assert load.errors == [], load.errors[:20]
        assert kills >= 5, "the chaos loop barely ran"
        assert len(load.answered) >= PROGRESS_MIN * kills
        assert restarts >= self.worker_kills, rows

        # (c) no session lost: all listed, ready, and the final prompt answered
        assert set(rows) == set(SESSIONS), rows
        assert {r["state"] for r in rows.values()} == {"ready"}, rows

        by_session: dict[str, list[Sent]] = {s: [] for s in SESSIONS}
        for rec in load.answered:
            by_session[rec.session].append(rec)
        journal_dir = env.state_dir() / "journal"
        for s in SESSIONS:
            self.check_session(s, transcripts[s], by_session[s], finals[s],
                               _jsonl(journal_dir / f"{s}.jsonl", self.kills_of[s]))

    def check_session(self, s: str, tr: list[dict[str, Any]], answered: list[Sent], final: int,
                      journal: list[dict[str, Any]]) -> None:
        # (d) turns 1..N, no duplicates; the final prompt is the newest turn
        turns = [int(line["turn"]) for line in tr]
        assert turns == list(range(1, len(tr) + 1)), f"{s}: turns {turns}"
        assert final == len(tr), f"{s}: final turn {final}, transcript has {len(tr)}"
        # (a) every answered prompt ran exactly once, at the turn its client was told
        prompts = Counter(str(line["prompt"]) for line in tr)
        turn_of = {str(line["prompt"]): int(line["turn"]) for line in tr}
        for rec in answered:
            assert prompts[rec.text] == 1, f"{s}: {rec.text!r} ran {prompts[rec.text]} times"
            assert turn_of[rec.text] == rec.turn, f"{s}: {rec.text!r} answered turn {rec.turn}"
        # nothing ran that no client sent
        sent_texts = {r.text for r in self.load.sent if r.session == s} | {f"final-{s}"}
        assert set(prompts) <= sent_texts, set(prompts) - sent_texts
        # (b) every answered command is in the worker journal, accepted and completed
        accepted = {(j["client_id"], str(j["id"])): j for j in journal if j["kind"] == "accepted"}
        completed = {(j["client_id"], str(j["id"])): j for j in journal
                     if j["kind"] == "completed"}
        interrupted = {(j["client_id"], str(j["id"])) for j in journal
                       if j["kind"] == "interrupted"}
        for rec in answered:
            key = (rec.client_id, str(rec.id))
            assert key in accepted, f"{s}: {rec.text!r} {key} not journalled as accepted"
            assert accepted[key]["args"]["text"] == rec.text, accepted[key]
            assert key in completed, f"{s}: {rec.text!r} {key} not journalled as completed"
            assert completed[key]["result"]["turn"] == rec.turn, completed[key]
            assert key not in interrupted, f"{s}: {rec.text!r} {key} journalled interrupted"


def _reached(load: Load, n: int, threads: list[threading.Thread]) -> bool:
    return load.answered_count() >= n or not any(t.is_alive() for t in threads)
