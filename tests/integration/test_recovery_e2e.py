"""Crash recovery end to end: real supervisors and workers, kill -9, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trio_agentd._cli_exit import EXIT_OWN

from .harness import DaemonEnv, daemon_env, wait_for

REPO = Path(__file__).resolve().parents[2]


def _kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _worker_pids(env: DaemonEnv) -> dict[str, int]:
    return {d["session"]: d["pid"] for d in env.descriptors()}


def test_supervisor_kill9_next_command_adopts_every_worker(denv: DaemonEnv) -> None:
    for s in ("a", "b", "c"):
        assert denv.prompt(f"{s}1", session=s) == f"[echo turn 1] {s}1"
    workers = _worker_pids(denv)
    sup = denv.owner()["pid"]
    _kill9(sup)
    wait_for(lambda: sup not in denv.our_pids(), timeout=10, what="the supervisor to die")
    # the next command autostarts a new supervisor, which adopts all three workers
    assert denv.prompt("a2", session="a") == "[echo turn 2] a2"
    assert denv.owner()["pid"] != sup
    assert denv.prompt("b2", session="b") == "[echo turn 2] b2"
    assert denv.prompt("c2", session="c") == "[echo turn 2] c2"
    assert _worker_pids(denv) == workers
    rows = json.loads(denv.run("sessions", "--json").stdout)
    assert {(r["session"], r["pid"], r["turns"], r["state"]) for r in rows} == {
        (s, workers[s], 2, "ready") for s in ("a", "b", "c")
    }


def test_worker_kill9_next_prompt_respawns_same_session_with_its_transcript(
    denv: DaemonEnv,
) -> None:
    assert denv.prompt("one", session="w") == "[echo turn 1] one"
    assert denv.prompt("two", session="w") == "[echo turn 2] two"
    old = _worker_pids(denv)["w"]
    _kill9(old)
    assert denv.prompt("three", session="w") == "[echo turn 3] three"
    new = _worker_pids(denv)["w"]
    assert new != old
    transcript = (denv.home / "sessions" / "w" / "transcript.jsonl").read_text().splitlines()
    turns = [t for t in map(json.loads, transcript) if t["kind"] == "turn"]
    assert [t["prompt"] for t in turns] == ["one", "two", "three"]
    rows = json.loads(denv.run("sessions", "--json").stdout)
    assert rows[0]["restarts"] == 1


def _fixture_env(env: DaemonEnv, tmp: Path, delay: str = "1.5") -> dict[str, str]:
    return {
        "PYTHONPATH": str(REPO),
        "TA_FIXTURE_FILE": str(tmp / "runs.log"),
        "TA_FIXTURE_DELAY": delay,
    }


def _runs(tmp: Path) -> list[str]:
    path = tmp / "runs.log"
    return path.read_text().splitlines() if path.exists() else []


def _start_prompt(env: DaemonEnv, extra: dict[str, str], session: str, agent: str,
                  text: str) -> subprocess.Popen[str]:
    return env.popen("-p", "-s", session, "--agent", agent, text, env=extra)


@pytest.mark.parametrize("agent", ["tests.fixture_agents:slow_once",
                                   "tests.fixture_agents:slow_replayable"])
def test_supervisor_kill9_mid_prompt_answer_printed_once_and_run_once(agent: str) -> None:
    with daemon_env() as env:
        extra = _fixture_env(env, env.root)
        env.env.update(extra)
        cp = env.run("-p", "-s", "x", "--agent", agent, "warm")
        assert cp.returncode == 0, cp.stderr
        p = _start_prompt(env, extra, "x", agent, "payload")
        wait_for(lambda: "start payload" in _runs(env.root), timeout=20, what="the turn to start")
        _kill9(env.owner()["pid"])
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out == "[slow turn 2] payload\n"
        assert _runs(env.root).count("start payload") == 1
        assert _runs(env.root).count("done payload") == 1


def test_worker_kill9_mid_prompt_replayable_agent_reruns_once() -> None:
    with daemon_env() as env:
        extra = _fixture_env(env, env.root)
        env.env.update(extra)
        agent = "tests.fixture_agents:slow_replayable"
        assert env.run("-p", "-s", "r", "--agent", agent, "warm").returncode == 0
        worker = _worker_pids(env)["r"]
        p = _start_prompt(env, extra, "r", agent, "payload")
        wait_for(lambda: "start payload" in _runs(env.root), timeout=20, what="the turn to start")
        _kill9(worker)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out == "[slow turn 2] payload\n"
        runs = _runs(env.root)
        assert runs.count("start payload") == 2  # interrupted once, re-run once
        assert runs.count("done payload") == 1
        assert _worker_pids(env)["r"] != worker


def test_worker_kill9_mid_prompt_non_replayable_agent_reports_command_interrupted() -> None:
    with daemon_env() as env:
        extra = _fixture_env(env, env.root)
        env.env.update(extra)
        agent = "tests.fixture_agents:slow_once"
        assert env.run("-p", "-s", "n", "--agent", agent, "warm").returncode == 0
        worker = _worker_pids(env)["n"]
        p = _start_prompt(env, extra, "n", agent, "payload")
        wait_for(lambda: "start payload" in _runs(env.root), timeout=20, what="the turn to start")
        _kill9(worker)
        out, err = p.communicate(timeout=60)
        assert out == ""
        assert p.returncode == EXIT_OWN
        assert "interrupted by a worker restart" in err
        # it had started (its agent ran): the client is told to check before resending
        assert "it had started and may have had effects; check before sending it again" in err
        runs = _runs(env.root)
        assert runs.count("start payload") == 1
        assert runs.count("done payload") == 0
        # the session itself lives on
        assert env.prompt("after", session="n").startswith("[slow turn 2] after")


def test_restart_under_load_no_client_error_and_worker_pids_unchanged(denv: DaemonEnv) -> None:
    sessions = [f"l{i}" for i in range(4)]
    for s in sessions:
        denv.prompt("warm", session=s)
    workers = _worker_pids(denv)
    old = denv.owner()["pid"]
    done: list[str] = []
    restarted: list[float] = []

    def load(session: str) -> list[str]:
        errors = []
        n = 0
        # keep prompting until 2 s after the restart returned
        while not restarted or time.monotonic() < restarted[0] + 2:
            n += 1
            cp = denv.run("-p", "-s", session, f"m{n}")
            if cp.returncode != 0:
                errors.append(cp.stderr)
            done.append(session)
        return errors

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(load, s) for s in sessions]
        wait_for(lambda: len(done) >= 8, timeout=30, what="the load to be running")
        cp = denv.run("restart")
        restarted.append(time.monotonic())
        assert cp.returncode == 0, cp.stderr
        errors = [e for f in futures for e in f.result()]
    assert errors == []
    assert len(done) > 8
    assert denv.owner()["pid"] != old
    assert _worker_pids(denv) == workers
    assert "4 sessions kept" in cp.stdout


def test_corrupt_descriptor_and_journal_are_logged_and_skipped(denv: DaemonEnv) -> None:
    denv.prompt("hi", session="good")
    denv.prompt("hi", session="bad")
    state = denv.state_dir()
    denv.run("shutdown")
    (state / "workers" / "bad.json").write_bytes(b'{"version": 1, "sess')
    journal = state / "journal" / "good.jsonl"
    data = journal.read_bytes()
    assert not data.endswith(b"\0")  # a stopped worker gave back the room it wrote ahead
    # as a kill in the middle of a record leaves it: torn, in the room
    journal.write_bytes(data[:-7] + bytes(64 * 1024))
    (state / "workers" / "junk.json").write_bytes(bytes(range(256)))
    assert denv.prompt("again", session="good") == "[echo turn 2] again"
    log = denv.log_text()
    assert "skipping worker descriptor" in log
    assert "bad.json" in log
    assert "junk.json" in log


def test_idle_session_is_evicted_and_respawned_by_its_next_prompt() -> None:
    timing = '{"idle_eviction": 0.5, "idle_sweep_period": 0.1}'
    with daemon_env(extra_env={"TRIO_AGENTD_TIMING": timing}) as env:
        assert env.prompt("one", session="idle") == "[echo turn 1] one"
        worker = _worker_pids(env)["idle"]

        def state() -> str:
            rows = json.loads(env.run("sessions", "--json").stdout)
            return str(rows[0]["state"])

        wait_for(lambda: state() == "evicted", timeout=10, what="the idle sweep to evict")
        wait_for(lambda: worker not in env.our_pids(), timeout=10, what="the worker to exit")
        assert env.prompt("two", session="idle") == "[echo turn 2] two"
        assert _worker_pids(env)["idle"] != worker


def test_exec_agent_supervisor_kill9_mid_prompt_prints_once_and_appends_once() -> None:
    with daemon_env() as env:
        out_file = env.root / "appended.txt"
        started = env.root / "started.txt"
        script = (f"read line; echo started >> {started}; sleep 1; "
                  f'echo "$line" >> {out_file}; echo "ran: $line"')
        agent = f"exec:/bin/sh -c '{script}'"
        p = env.popen("-p", "-s", "ex", "--agent", agent, "the-prompt")
        wait_for(lambda: started.exists(), timeout=30, what="the exec agent to start")
        wait_for(lambda: env.owner_records(), timeout=5, what="the owner record")
        os.kill(env.owner()["pid"], signal.SIGKILL)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out == "ran: the-prompt\n"
        assert out_file.read_text() == "the-prompt\n"
        assert started.read_text() == "started\n"
