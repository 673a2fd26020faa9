"""ps, doctor, doctor --fix and shutdown --all with real processes."""

from __future__ import annotations

import json
import os
import signal

import pytest

from .harness import DaemonEnv, daemon_env, wait_for

FOOTER = ('! {sock}: supervisor lost its ownership record — run "trio-agentd doctor --fix" to'
          " restart it (sessions are preserved)")


def _ps(env: DaemonEnv) -> list[dict[str, object]]:
    cp = env.run("ps", "--json")
    assert cp.returncode == 0, cp.stderr
    return list(json.loads(cp.stdout))


def _by_socket(rows: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {str(r["socket"]): r for r in rows}


def test_doctor_fix_restarts_only_the_daemon_that_lost_its_record() -> None:
    with daemon_env(extra_env={"TRIO_AGENTD_SELF_HEAL": "0"}) as env:
        healthy = env.socket_at("healthy.sock")
        assert env.prompt("one", session="keep") == "[echo turn 1] one"
        assert env.prompt("hi", session="other", socket=healthy) == "[echo turn 1] hi"
        rows = _by_socket(_ps(env))
        wedged_gen, wedged_pid = rows[env.socket]["generation"], rows[env.socket]["pid"]
        healthy_pid = rows[healthy]["pid"]
        worker = next(d["pid"] for d in env.descriptors() if d["session"] == "keep")

        (env.registry / f"{wedged_gen}.owner" / "owner.json").unlink()

        rows = _by_socket(_ps(env))
        assert rows[env.socket]["status"] == "ownership-lost"
        assert rows[env.socket]["cause"] == "record-missing"
        assert rows[env.socket]["is_default"] is True
        assert rows[healthy]["status"] == "current"
        doctor = env.run("doctor")
        assert doctor.returncode == 3
        assert FOOTER.format(sock=env.socket) in doctor.stdout
        assert healthy not in "".join(
            line for line in doctor.stdout.splitlines() if line.startswith("!"))

        fix = env.run("doctor", "--fix")
        assert fix.returncode == 0, fix.stdout + fix.stderr
        assert f"killed pid {wedged_pid}, exit confirmed" in fix.stdout
        rows = _by_socket(_ps(env))
        assert rows[env.socket]["status"] == "current"
        assert rows[env.socket]["generation"] != wedged_gen
        assert rows[env.socket]["pid"] != wedged_pid
        assert wedged_pid not in env.our_pids()
        # the session's worker was re-adopted, not respawned, and answers
        assert env.prompt("two", session="keep") == "[echo turn 2] two"
        assert next(d["pid"] for d in env.descriptors() if d["session"] == "keep") == worker
        # the healthy daemon was never touched
        assert rows[healthy]["pid"] == healthy_pid
        assert env.run("doctor").returncode == 0


def test_sigstopped_supervisor_is_unreachable_and_doctor_fix_replaces_it(denv: DaemonEnv) -> None:
    assert denv.prompt("one", session="s") == "[echo turn 1] one"
    pid = denv.owner()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        rows = _by_socket(_ps(denv))
        assert rows[denv.socket]["status"] == "unreachable"
        assert rows[denv.socket]["pid"] == pid
        fix = denv.run("doctor", "--fix")
        assert fix.returncode == 0, fix.stdout + fix.stderr
        wait_for(lambda: pid not in denv.our_pids(), timeout=5, what="the stopped one to die")
        assert denv.prompt("two", session="s") == "[echo turn 2] two"
        assert denv.owner()["pid"] != pid
    finally:
        if pid in denv.our_pids():
            os.kill(pid, signal.SIGCONT)


def test_doctor_kills_a_stopped_supervisor_without_letting_it_run_again(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repair's kill never resumes what it kills: a revoked supervisor that ran for a
    moment between a SIGCONT and the SIGKILL (a loaded machine gives it that moment) would
    answer the clients queued on it "ownership_lost" instead of leaving them to its
    successor."""
    from trio_agentd import _doctor_repair
    from trio_agentd._identity import read_start_id, signal_identity_checked
    from trio_agentd._paths import Layout

    denv.prompt("one", session="s")
    pid = denv.owner()["pid"]
    start_id = read_start_id(pid)
    sent: list[int] = []

    def recording(p: int, sid: str | None, sig: int) -> bool:
        sent.append(sig)
        return signal_identity_checked(p, sid, sig)

    monkeypatch.setattr(_doctor_repair, "signal_identity_checked", recording)
    os.kill(pid, signal.SIGSTOP)
    try:
        hooks = _doctor_repair.RealHooks(Layout(home=denv.home, socket=denv.socket,
                                         registry=denv.registry))
        assert hooks.kill(pid, start_id) is True
        assert sent == [signal.SIGKILL]
        assert pid not in denv.our_pids()
    finally:
        if pid in denv.our_pids():
            os.kill(pid, signal.SIGCONT)


def test_a_revoked_supervisor_once_resumed_cannot_restore_its_record_and_exits(
    denv: DaemonEnv,
) -> None:
    from trio_agentd._doctor_repair import RealHooks
    from trio_agentd._paths import Layout

    denv.prompt("one", session="s")
    owner = denv.owner()
    pid = owner["pid"]
    worker = denv.descriptors()[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    # what doctor --fix does before its kill: tombstone + record moved aside
    RealHooks(Layout(home=denv.home, socket=denv.socket, registry=denv.registry)).revoke(
        owner["generation"])
    os.kill(pid, signal.SIGCONT)
    wait_for(lambda: pid not in denv.our_pids(), timeout=10, what="the revoked one to exit")
    assert denv.owner_records() == []  # it did not restore its record
    assert "was revoked; exiting" in denv.log_text()
    assert worker in denv.our_pids()  # its workers were left for the next supervisor
    assert denv.prompt("two", session="s") == "[echo turn 2] two"


def test_shutdown_all_leaves_nothing_and_sessions_come_back(denv: DaemonEnv) -> None:
    other = denv.socket_at("second.sock")
    denv.prompt("a", session="one")
    denv.prompt("b", session="two", socket=other)
    # 2 supervisors, their fork templates, 2 workers (and the templates' spares)
    assert len(set(denv.our_pids()) - set(denv.spare_workers())) == 6
    cp = denv.run("shutdown", "--all")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    wait_for(lambda: not denv.our_pids(), timeout=15, what="everything to stop")
    assert not os.path.exists(denv.socket)
    assert not os.path.exists(other)
    assert denv.owner_records() == []
    assert denv.prompt("c", session="one") == "[echo turn 2] c"


def test_shutdown_all_force_kills_a_wedged_supervisor(denv: DaemonEnv) -> None:
    denv.prompt("a", session="one")
    pid = denv.owner()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        plain = denv.run("shutdown", "--all")
        assert plain.returncode == 1
        assert "use --force" in plain.stdout
        forced = denv.run("shutdown", "--all", "--force")
        assert forced.returncode == 0, forced.stdout + forced.stderr
        wait_for(lambda: not denv.our_pids(), timeout=15, what="everything to stop")
        assert not os.path.exists(denv.socket)
    finally:
        if pid in denv.our_pids():
            os.kill(pid, signal.SIGCONT)


def test_doctor_with_nothing_running_says_so_and_exits_0() -> None:
    with daemon_env() as env:
        cp = env.run("doctor")
        assert cp.returncode == 0
        assert "nothing found" in cp.stdout
        assert _ps(env) == []


def test_orphan_socket_file_is_reported_and_removed(denv: DaemonEnv) -> None:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(denv.socket)
    s.close()  # a socket file nobody listens on
    rows = _by_socket(_ps(denv))
    assert rows[denv.socket]["status"] == "orphan-file"
    assert denv.run("doctor").returncode == 3
    fix = denv.run("doctor", "--fix")
    assert fix.returncode == 0, fix.stdout
    assert not os.path.exists(denv.socket)
