"""A cleaner deletes the state under a live supervisor: it is made again from memory, so a
later crash still finds every worker to adopt."""

from __future__ import annotations

import os
import signal

from .harness import DaemonEnv, wait_for, wipe


def test_deleted_state_and_registry_are_made_again_and_adoption_still_works(
    denv: DaemonEnv,
) -> None:
    assert denv.prompt("one", session="w") == "[echo turn 1] one"
    worker = next(d["pid"] for d in denv.descriptors() if d["session"] == "w")
    state = denv.state_dir()
    wipe(state)
    wipe(denv.registry)
    wipe(denv.home / "sessions" / "w")
    # the supervisor's self-check makes it all again: descriptor, token, owner record, meta
    wait_for(lambda: (state / "workers" / "w.json").exists(), timeout=10,
             what="the descriptor to be written again")
    assert (state / "workers" / "w.token").exists()
    wait_for(lambda: denv.owner_records() != [], timeout=10, what="the owner record again")
    wait_for(lambda: (denv.home / "sessions" / "w" / "session.json").exists(), timeout=10,
             what="the session's metadata again")
    assert (denv.home / "sessions" / "w").stat().st_mode & 0o777 == 0o700
    # the proof: a crash now still adopts the same worker
    os.kill(int(denv.owner()["pid"]), signal.SIGKILL)
    assert denv.prompt("two", session="w") == "[echo turn 2] two"
    assert next(d["pid"] for d in denv.descriptors() if d["session"] == "w") == worker


def test_ps_finds_a_supervisor_that_lost_every_file_by_its_command_line(
    denv: DaemonEnv,
) -> None:
    import json

    other = denv.socket_at("other.sock")
    timing = json.dumps({"self_check_interval": 3600})  # no healing: every file stays lost
    p = denv.popen("--socket", other, "daemon", env={"TRIO_AGENTD_TIMING": timing})
    wait_for(lambda: denv.hello(other), timeout=30, what="the supervisor on other.sock")
    wipe(denv.registry)
    wipe(denv.home / "daemons")
    cp = denv.run("ps", "--json")
    assert cp.returncode == 0, cp.stderr
    rows = {r["socket"]: r for r in json.loads(cp.stdout)}
    assert other in rows
    assert rows[other]["pid"] == p.pid


def test_a_command_line_names_its_socket() -> None:
    from trio_agentd._doctor_discover import daemon_socket_of

    py = "/usr/bin/python3"
    assert daemon_socket_of([py, "-E", "-P", "-m", "trio_agentd", "--socket", "/s/d.sock",
                             "--home", "/h", "daemon", "--autostarted"]) == "/s/d.sock"
    assert daemon_socket_of([py, "-m", "trio_agentd", "--socket=/x.sock", "daemon"]) == "/x.sock"
    assert daemon_socket_of([py, "-m", "trio_agentd.worker"]) is None
    assert daemon_socket_of([py, "-m", "trio_agentd", "-p", "hi"]) is None
    assert daemon_socket_of(["trio-agentd", "daemon"]) is None  # the default socket: known
    assert daemon_socket_of([py, "-m", "trio_agentd", "daemon", "--socket"]) is None
