"""Upgrade handover with real processes: an "old installation" supervisor meets a new client.

The old installation is a copy of this package with another ``APP_VERSION`` (and, in the
``protocol`` cases, another ``PROTOCOL_VERSION``), importable only through a private venv's
interpreter: every process it starts (``python -E -P``, its own ``sys.executable``) runs the
copy, exactly as a supervisor of a previous ``pip install`` would. Nothing but the version
numbers differs, and the handover uses only what the protocol already had (``sessions``, and
``shutdown`` with ``stop_workers: false``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_agentd
from trio_agentd._cli_exit import EXIT_OWN
from trio_agentd._identity import is_alive
from trio_agentd._version import APP_VERSION, PROTOCOL_VERSION

from .harness import DaemonEnv, wait_for

OLD_VERSION = "0.0.9"
VARIANTS = {"app": PROTOCOL_VERSION, "protocol": PROTOCOL_VERSION - 1}


def make_old_install(root: Path, *, protocol: int) -> str:
    """A copy of the package claiming ``OLD_VERSION`` (and ``protocol``), and the interpreter
    of a venv that imports it (and this venv's dependencies); its path."""
    pkg = root / "old-install" / "pkg"
    shutil.copytree(Path(trio_agentd.__file__).parent, pkg / "trio_agentd",
                    ignore=shutil.ignore_patterns("__pycache__"))
    version_file = pkg / "trio_agentd" / "_version.py"
    text = version_file.read_text()
    new = text.replace(f'APP_VERSION = "{APP_VERSION}"', f'APP_VERSION = "{OLD_VERSION}"')
    new = new.replace(f"PROTOCOL_VERSION = {PROTOCOL_VERSION}", f"PROTOCOL_VERSION = {protocol}")
    assert new != text
    version_file.write_text(new)
    env_dir = root / "old-install" / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    site = env_dir / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    # the copy first; then this venv's packages as plain paths (its .pth files, such as an
    # editable install's finder, are not run: trio_agentd comes from the copy)
    paths = dict.fromkeys([str(pkg), sysconfig.get_paths()["purelib"],
                           sysconfig.get_paths()["platlib"]])
    (site / "old_install.pth").write_text("".join(f"{p}\n" for p in paths))
    return str(env_dir / "bin" / "python")


class Old:
    """The old installation's CLI."""

    def __init__(self, denv: DaemonEnv, python: str) -> None:
        self.denv = denv
        self.python = python

    def argv(self, *args: str) -> list[str]:
        return [self.python, "-E", "-P", "-m", "trio_agentd", *args]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), env=self.denv.env, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL, cwd="/")

    def popen(self, *args: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(self.argv(*args), env=self.denv.env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                             cwd="/")
        self.denv.procs.append(p)
        return p


@pytest.fixture(params=sorted(VARIANTS))
def old(request: pytest.FixtureRequest, denv: DaemonEnv) -> Old:
    return Old(denv, make_old_install(denv.root, protocol=VARIANTS[request.param]))


def ok(cp: subprocess.CompletedProcess[str]) -> str:
    assert cp.returncode == 0, (cp.returncode, cp.stderr)
    return cp.stdout


def timing(**fields: float) -> dict[str, str]:
    return {"TRIO_AGENTD_TIMING": json.dumps(fields)}


def sessions(denv: DaemonEnv) -> dict[str, dict[str, Any]]:
    return {r["session"]: r for r in json.loads(ok(denv.run("sessions", "--json")))}


def supervisor(denv: DaemonEnv) -> dict[str, Any]:
    hello = denv.hello()
    assert hello is not None
    return hello


def read_stderr_until(p: subprocess.Popen[bytes], needle: bytes, timeout: float) -> bytes:
    """What ``p`` wrote on stderr up to and including ``needle`` (with a deadline)."""
    assert p.stderr is not None
    fd = p.stderr.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} on stderr within {timeout}s: {seen!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"stderr closed before {needle!r}: {seen!r}"
            seen += chunk
    return seen


def start_blocking_turn(old: Old, flag: Path) -> subprocess.Popen[str]:
    """A shell turn on session ``busy`` that runs until ``flag`` exists; returns once the old
    supervisor reports the session busy."""
    p = old.popen("-p", "-s", "busy", "--agent", "shell", "--",
                  f"while [ ! -e {flag} ]; do sleep 0.02; done; echo finished")
    wait_for(lambda: sessions_of(old).get("busy", {}).get("busy"),
             timeout=30, what="the busy turn to run")
    return p


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def finish_turn(turn: subprocess.Popen[str], denv: DaemonEnv, protocol: int) -> None:
    """The blocking turn, released, runs to its end in its worker. Its old client resends over
    a new route when the new supervisor ended its old one (a ping on it is refused); a client
    of another protocol cannot talk to the new supervisor and says so — the turn's answer is
    in the transcript all the same."""
    out, err = turn.communicate(timeout=30)
    if protocol == PROTOCOL_VERSION:
        assert (turn.returncode, out) == (0, "finished\n"), err
    else:
        assert turn.returncode in (0, EXIT_OWN), err
        assert turn.returncode == 0 or "run `trio-agentd restart`" in err
    transcript = denv.home / "sessions" / "busy" / "transcript.jsonl"
    wait_for(lambda: transcript.exists() and "finished" in transcript.read_text(), timeout=30,
             what="the turn's record")


def test_an_idle_old_supervisor_is_handed_over_and_its_workers_adopted(
    denv: DaemonEnv, old: Old
) -> None:
    assert ok(old.run("-p", "-s", "a", "one")) == "[echo turn 1] one\n"
    assert ok(old.run("-p", "-s", "b", "one")) == "[echo turn 1] one\n"
    assert ok(old.run("-p", "-s", "a", "two")) == "[echo turn 2] two\n"
    before = supervisor(denv)
    assert before["app_version"] == OLD_VERSION
    # ps (from the new installation) shows the version the old supervisor reports, as stale
    [row] = json.loads(ok(denv.run("ps", "--json")))
    assert (row["app_version"], row["status"], row["pid"]) == (
        OLD_VERSION, "stale", before["pid"])
    workers = {s: r["pid"] for s, r in sessions_of(old).items()}

    # the first command of the new installation hands over and goes on (silently: idle)
    cp = denv.run("-p", "-s", "a", "three", env=timing(upgrade_idle=3600))
    assert (cp.returncode, cp.stdout, cp.stderr) == (0, "[echo turn 3] three\n", "")

    after = supervisor(denv)
    assert after["app_version"] == APP_VERSION
    assert after["protocol"] == PROTOCOL_VERSION
    assert after["pid"] != before["pid"]
    assert not is_alive(before["pid"], before["start_id"])
    # ... a supervisor of this installation, not one the old one started
    assert os.path.realpath(f"/proc/{after['pid']}/exe") == os.path.realpath(sys.executable)
    rows = sessions(denv)
    # every session kept, every worker adopted (same pids), still the old version's
    assert {s: r["pid"] for s, r in rows.items()} == workers
    assert {r["version"] for r in rows.values()} == {OLD_VERSION}
    assert (rows["a"]["turns"], rows["b"]["turns"]) == (3, 1)
    table = ok(denv.run("sessions"))
    assert table.splitlines()[0].split()[:5] == ["SESSION", "AGENT", "STATE", "PID", "VERSION"]
    assert f" {OLD_VERSION} " in table
    [row] = json.loads(ok(denv.run("ps", "--json")))
    assert (row["app_version"], row["status"], row["pid"]) == (APP_VERSION, "current",
                                                              after["pid"])
    # nothing lost, nothing run twice: the transcripts go on where they were
    assert ok(denv.run("-p", "-s", "b", "two")) == "[echo turn 2] two\n"


def test_busy_sessions_are_waited_for_then_the_handover_goes_on(
    denv: DaemonEnv, old: Old
) -> None:
    flag = denv.root / "release"
    turn = start_blocking_turn(old, flag)
    before = supervisor(denv)
    busy_pid = sessions_of(old)["busy"]["pid"]

    new = subprocess.Popen(
        denv.argv("-p", "-s", "idle", "hi"),
        env={**denv.env, **timing(handover_wait=60, upgrade_idle=3600)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    denv.procs.append(new)  # type: ignore[arg-type]
    said = read_stderr_until(new, b"\n", timeout=30).decode()
    assert said.count("\n") == 1
    assert "waiting up to 60s for busy session(s) busy to finish" in said
    assert f"runs trio-agentd {OLD_VERSION}" in said
    # it waits: the old supervisor still serves
    assert new.poll() is None
    assert supervisor(denv)["pid"] == before["pid"]

    flag.touch()
    out, err = turn.communicate(timeout=30)
    assert (turn.returncode, out) == (0, "finished\n"), err
    got_out, got_err = new.communicate(timeout=60)
    assert new.returncode == 0, got_err
    assert got_out == b"[echo turn 1] hi\n"
    assert got_err == b""  # that one line (read above), nothing more
    after = supervisor(denv)
    assert (after["app_version"], after["pid"] != before["pid"]) == (APP_VERSION, True)
    assert sessions(denv)["busy"]["pid"] == busy_pid  # adopted


def sessions_of(old: Old) -> dict[str, dict[str, Any]]:
    return {r["session"]: r for r in json.loads(ok(old.run("sessions", "--json")))}


def test_a_wait_that_runs_out_says_what_to_run_and_restart_hands_over_at_once(
    denv: DaemonEnv, old: Old
) -> None:
    flag = denv.root / "release"
    turn = start_blocking_turn(old, flag)
    before = supervisor(denv)
    busy_pid = sessions_of(old)["busy"]["pid"]

    cp = denv.run("-p", "-s", "idle", "hi", env=timing(handover_wait=0.5))
    advice = (f"supervisor pid {before['pid']} (trio-agentd {OLD_VERSION}) was not replaced:"
              " session(s) busy still busy after 0.5s — run `trio-agentd restart` to replace it"
              f" with {APP_VERSION} now (running turns go on)")
    lines = cp.stderr.splitlines()
    assert lines[0].startswith("trio-agentd: supervisor pid")
    if before["protocol"] == PROTOCOL_VERSION:
        # the old supervisor speaks our protocol: the command goes on with it
        assert (cp.returncode, cp.stdout) == (0, "[echo turn 1] hi\n"), cp.stderr
        assert lines[1:] == [f"trio-agentd: {advice}"]
    else:
        assert (cp.returncode, cp.stdout) == (EXIT_OWN, "")
        assert lines[1:] == [f"trio-agentd: error: {advice}"]
    assert supervisor(denv)["pid"] == before["pid"]

    # restart hands over at once, busy or not: the running turn goes on in its worker
    cp = denv.run("restart", env=timing(upgrade_idle=3600))
    after = supervisor(denv)
    assert (cp.returncode, cp.stdout) == (0, (
        f"replaced supervisor on {denv.socket}: pid {before['pid']} (version {OLD_VERSION})"
        f" → {after['pid']} (version {APP_VERSION}),"
        f" {2 if before['protocol'] == PROTOCOL_VERSION else 1} sessions kept\n")), cp.stderr
    assert sessions(denv)["busy"]["pid"] == busy_pid
    flag.touch()
    finish_turn(turn, denv, before["protocol"])


def test_old_workers_serve_until_idle_then_are_replaced(denv: DaemonEnv, old: Old) -> None:
    assert ok(old.run("-p", "-s", "calm", "one")) == "[echo turn 1] one\n"
    flag = denv.root / "release"
    turn = start_blocking_turn(old, flag)
    protocol = supervisor(denv)["protocol"]
    old_workers = {s: (r["pid"], r) for s, r in sessions_of(old).items()}
    assert {r["version"] for _p, r in old_workers.values()} == {OLD_VERSION}

    ok(denv.run("restart", env=timing(upgrade_idle=0.5)))

    def replaced(session: str) -> dict[str, Any]:
        row = sessions(denv)[session]
        new = row["version"] == APP_VERSION and row["state"] == "ready"
        return row if new and row["pid"] != old_workers[session][0] else {}

    calm = wait_for(lambda: replaced("calm"), timeout=30, what="the idle worker replaced")
    assert gone(old_workers["calm"][0])
    # the busy session's old worker still serves its turn, well past upgrade_idle
    busy = sessions(denv)["busy"]
    assert (busy["pid"], busy["version"], busy["busy"]) == (
        old_workers["busy"][0], OLD_VERSION, True)

    flag.touch()
    finish_turn(turn, denv, protocol)
    busy = wait_for(lambda: replaced("busy"), timeout=30, what="the busy worker replaced")
    assert (calm["restarts"], busy["restarts"]) == (0, 0)  # a replacement is not a crash
    # the sessions go on, on the new workers, with their history
    assert ok(denv.run("-p", "-s", "calm", "two")) == "[echo turn 2] two\n"
    assert ok(denv.run("-p", "-s", "busy", "--", "echo again")) == "again\n"
    rows = sessions(denv)
    assert (rows["calm"]["pid"], rows["busy"]["pid"]) == (calm["pid"], busy["pid"])
    assert (rows["calm"]["turns"], rows["busy"]["turns"]) == (2, 2)
    assert "replacing it with a worker of version" in denv.log_text()


async def test_open_client_hands_over_through_its_helper(
    denv: DaemonEnv, old: Old, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ok(old.run("-p", "-s", "a", "one")) == "[echo turn 1] one\n"
    before = supervisor(denv)
    workers = {s: r["pid"] for s, r in sessions_of(old).items()}
    monkeypatch.setenv("TRIO_AGENTD_TIMING", json.dumps({"upgrade_idle": 3600}))
    with trio.fail_after(60):
        async with trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry)
        ) as client:
            assert (client.hello.app_version, client.hello.protocol) == (
                APP_VERSION, PROTOCOL_VERSION)
            assert client.hello.pid != before["pid"]
            assert await client.prompt("a", "two") == "[echo turn 2] two\n"
            rows = await client.sessions()
    assert {r["session"]: r["pid"] for r in rows} == workers
    assert gone(before["pid"])
