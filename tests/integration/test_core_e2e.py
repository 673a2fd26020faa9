"""End to end with real supervisor and worker processes on real Unix sockets."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trio_agentd._cli_exit import EXIT_OWN

from .harness import DaemonEnv, daemon_env, wait_for, wipe

RESTORED = re.compile(
    r"Restored supervisor owner record for generation (\w+) after external removal"
)


def test_fresh_machine_first_prompt_autostarts_and_continues_the_session() -> None:
    with daemon_env(fresh_machine=True) as env:
        cp = env.run("-p", "hello")
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout == "[echo turn 1] hello\n"
        cp = env.run("-p", "-s", "default", "again")
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout == "[echo turn 2] again\n"
        # the per-user defaults were used: socket in XDG_RUNTIME_DIR, state in XDG_STATE_HOME
        assert os.path.exists(env.socket)
        assert len(env.owner_records()) == 1
        assert env.owner()["socket"] == env.socket
        assert (env.home / "sessions" / "default" / "transcript.jsonl").exists()


def _seed_incident(env: DaemonEnv, delete: str) -> None:
    first = env.prompt("before", session="s1")
    assert first == "[echo turn 1] before"
    owner_before = env.owner()
    rec_dir = env.owner_records()[0]
    if delete == "files":
        (rec_dir / "owner.json").unlink()
        (rec_dir / "scope.json").unlink()
    else:
        wipe(rec_dir)
    procs = [env.popen("-p", "-s", "s1", f"launch {i}") for i in range(15)]
    results = [(p.returncode, *p.communicate(timeout=60)) for p in procs]
    results = [(p.returncode, out, err) for p, (_, out, err) in zip(procs, results, strict=True)]
    failures = [r for r in results if r[0] != 0]
    assert not failures, failures
    replies = sorted(r[1].strip() for r in results)
    assert {int(re.search(r"turn (\d+)", r).group(1)) for r in replies} == set(range(2, 17))  # type: ignore[union-attr]
    restored = RESTORED.findall(env.log_text())
    assert restored == [owner_before["generation"]]
    after = env.owner()
    assert (after["generation"], after["token"], after["pid"]) == (
        owner_before["generation"], owner_before["token"], owner_before["pid"])


@pytest.mark.parametrize("delete", ["files", "dir"])
def test_seed_incident_deleted_record_then_15_concurrent_launches_all_succeed(delete: str) -> None:
    # self-check slowed down so the 15 commands themselves must restore (single-flight)
    with daemon_env(extra_env={"TRIO_AGENTD_TIMING": '{"self_check_interval": 3600}'}) as env:
        _seed_incident(env, delete)


def test_idle_supervisor_restores_its_record_within_one_second(denv: DaemonEnv) -> None:
    denv.prompt("warm up")
    before = denv.owner()
    rec_dir = denv.owner_records()[0]
    (rec_dir / "owner.json").unlink()
    (rec_dir / "scope.json").unlink()
    # the bound is wait_for's deadline (it fails past it): timing its return again would
    # only add the cost of the last poll to the same deadline
    wait_for(lambda: (rec_dir / "owner.json").exists(), timeout=1.0, interval=0.005,
             what="the self-check to restore the record")
    after = denv.owner()
    assert (after["generation"], after["token"]) == (before["generation"], before["token"])
    wait_for(lambda: RESTORED.findall(denv.log_text()), timeout=1.0, what="the log line")
    assert RESTORED.findall(denv.log_text()) == [before["generation"]]


def test_self_heal_off_leaves_the_supervisor_wedged_with_record_missing() -> None:
    with daemon_env(extra_env={"TRIO_AGENTD_SELF_HEAL": "0"}) as env:
        env.prompt("hi")
        rec_dir = env.owner_records()[0]
        (rec_dir / "owner.json").unlink()
        cp = env.run("-p", "again")
        assert cp.returncode == EXIT_OWN
        assert "record was deleted on disk" in cp.stderr
        assert "doctor --fix" in cp.stderr
        assert cp.stderr.count("\n") == 1
        assert not (rec_dir / "owner.json").exists()
        # still answering hello: wedged, not dead
        assert env.hello() is not None


def _start_daemon(env: DaemonEnv, socket_path: str) -> subprocess.Popen[str]:
    return env.popen("--socket", socket_path, "daemon")


def test_16_supervisors_at_once_exactly_one_serves(denv: DaemonEnv) -> None:
    procs = [_start_daemon(denv, denv.socket) for _ in range(16)]
    try:
        # every loser exits; the winner keeps running
        wait_for(lambda: sum(p.poll() is not None for p in procs) == 15, timeout=60,
                 what="15 losers to exit")
        alive = [p for p in procs if p.poll() is None]
        assert len(alive) == 1
        winner = alive[0]
        hello = wait_for(lambda: denv.hello(), timeout=10, what="the winner's hello")
        assert hello is not None
        assert hello["pid"] == winner.pid
        assert len(denv.owner_records()) == 1
        owner = denv.owner()
        assert owner["pid"] == winner.pid
        for p in procs:
            if p is winner:
                continue
            assert p.returncode == 1
            _, err = p.communicate(timeout=10)
            assert f"pid {winner.pid}" in err, err
            assert owner["generation"] in err, err
            assert "already running" in err or "is held by supervisor" in err, err
        assert denv.prompt("served") == "[echo turn 1] served"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=10)


def test_two_spellings_of_one_socket_conflict(denv: DaemonEnv) -> None:
    first = _start_daemon(denv, denv.socket)
    try:
        wait_for(lambda: denv.hello(), timeout=10, what="first daemon")
        spelled = str(Path(denv.socket).parent) + "/../s//./" + Path(denv.socket).name
        second = _start_daemon(denv, spelled)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 1, err
        assert f"pid {first.pid}" in err
        assert len(denv.owner_records()) == 1
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=10)


def test_two_sockets_sharing_one_state_dir_conflict(denv: DaemonEnv) -> None:
    from trio_agentd._paths import socket_key

    other = denv.socket_at("other.sock")
    daemons = denv.home / "daemons"
    daemons.mkdir(parents=True)
    (daemons / socket_key(denv.socket)).mkdir()
    # the second socket's state dir is a symlink to the first's: one physical state dir
    (daemons / socket_key(other)).symlink_to(daemons / socket_key(denv.socket))
    first = _start_daemon(denv, denv.socket)
    try:
        wait_for(lambda: denv.hello(), timeout=10, what="first daemon")
        second = _start_daemon(denv, other)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 1, err
        assert f"pid {first.pid}" in err, err
        assert not os.path.exists(other)
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=10)


def test_deleted_socket_file_is_bound_again_within_one_second(denv: DaemonEnv) -> None:
    denv.prompt("hi")
    pid = denv.owner()["pid"]
    os.unlink(denv.socket)
    # the bound is wait_for's deadline (it fails past it)
    hello = wait_for(lambda: denv.hello(timeout=0.2), timeout=1.0, interval=0.01,
                     what="the socket to come back")
    assert hello is not None
    assert hello["pid"] == pid
    assert denv.prompt("back") == "[echo turn 2] back"


def _raw(env: DaemonEnv, payload: bytes, *, read: bool = True) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(env.socket)
    try:
        s.sendall(payload)
        if not read:
            return b""
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    finally:
        s.close()


def _responses(data: bytes) -> list[dict[str, object]]:
    return [json.loads(line) for line in data.splitlines()[1:]]


def test_hostile_input_never_stops_the_daemon(denv: DaemonEnv) -> None:
    denv.prompt("first")
    pid = denv.owner()["pid"]
    idle = []
    for _ in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(denv.socket)
        idle.append(s)
    try:
        garbage = _responses(_raw(denv, b"this is not json\n"))
        assert garbage[0]["ok"] is False
        assert garbage[0]["error"]["code"] == "bad_request"  # type: ignore[index]
        binary = _responses(_raw(denv, bytes(range(256)) + b"\n"))
        assert binary[0]["error"]["code"] == "bad_request"  # type: ignore[index]
        wrong = _responses(_raw(denv, b'{"type":"request","id":7,"op":5}\n'))
        assert wrong[0]["id"] is None or wrong[0]["id"] == 7
        assert wrong[0]["error"]["code"] == "bad_request"  # type: ignore[index]
        unknown = _responses(_raw(denv, b'{"type":"request","id":8,"op":"frobnicate"}\n'))
        assert unknown[0]["id"] == 8
        assert unknown[0]["error"]["code"] == "unknown_op"  # type: ignore[index]
        oversized = _responses(_raw(denv, b"x" * ((1 << 20) + 10)))
        assert oversized[0]["error"]["code"] == "frame_too_large"  # type: ignore[index]
        half = _raw(denv, b'{"type":"request","id":9,"op":"pi')
        assert half.count(b"\n") == 1  # only the hello: the half line never ran

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: denv.prompt(f"ok {i}", session=f"c{i}"), range(4)))
        assert replies == [f"[echo turn 1] ok {i}" for i in range(4)]
    finally:
        for s in idle:
            s.close()
    assert denv.owner()["pid"] == pid
    assert denv.hello() is not None


def test_shutdown_stops_everything_and_removes_socket_and_record(denv: DaemonEnv) -> None:
    denv.prompt("a", session="one")
    denv.prompt("b", session="two")
    workers = [d["pid"] for d in denv.descriptors()]
    assert len(workers) == 2
    # the supervisor, its worker fork template, 2 workers (and the template's spares)
    assert len(set(denv.our_pids()) - set(denv.spare_workers())) == 4
    cp = denv.run("shutdown")
    assert cp.returncode == 0, cp.stderr
    assert "stopped supervisor" in cp.stdout
    wait_for(lambda: not denv.our_pids(), timeout=10, what="all our processes to exit")
    assert not os.path.exists(denv.socket)
    assert denv.owner_records() == []
    # transcripts stay; a later prompt respawns the session with its history
    assert denv.prompt("c", session="one") == "[echo turn 2] c"


def test_socket_path_over_sun_path_limit_is_refused(denv: DaemonEnv) -> None:
    long_sock = str(denv.root / "s" / ("x" * 120 + ".sock"))
    cp = denv.run("--socket", long_sock, "-p", "hi")
    assert cp.returncode == EXIT_OWN
    assert "107-byte sun_path limit" in cp.stderr


def test_socket_dir_with_wrong_mode_is_refused(denv: DaemonEnv) -> None:
    bad = denv.root / "open"
    bad.mkdir(mode=0o755)
    bad.chmod(0o755)
    cp = denv.run("--socket", str(bad / "d.sock"), "daemon")
    assert cp.returncode == 1
    assert "chmod 700" in cp.stderr


def test_autostart_failure_reports_exit_code_and_log_tail(denv: DaemonEnv) -> None:
    cp = denv.run("-p", "hi", env={"TRIO_AGENTD_TIMING": '{"no_such_field": 1}'})
    assert cp.returncode == EXIT_OWN
    assert "exited during startup with code 2" in cp.stderr
    assert "no_such_field" in cp.stderr


def test_python_dash_m_entry_point_runs() -> None:
    cp = subprocess.run([sys.executable, "-m", "trio_agentd", "--help"], capture_output=True,
                        text=True, timeout=30)
    assert cp.returncode == 0
    assert "prompt" in cp.stdout
    assert "daemon" in cp.stdout


def test_sigterm_stops_the_supervisor_and_leaves_workers_for_the_next_one(
    denv: DaemonEnv,
) -> None:
    assert denv.prompt("one", session="keep") == "[echo turn 1] one"
    sup_pid = denv.owner()["pid"]
    worker_pid = denv.descriptors()[0]["pid"]
    os.kill(sup_pid, signal.SIGTERM)
    wait_for(lambda: sup_pid not in denv.our_pids(), timeout=10, what="the supervisor to exit")
    assert worker_pid in denv.our_pids()
    assert denv.owner_records() == []  # released cleanly
    assert not os.path.exists(denv.socket)
    # the next command autostarts a supervisor that reconnects to the same worker
    assert denv.prompt("two", session="keep") == "[echo turn 2] two"
    assert denv.owner()["pid"] != sup_pid
    assert denv.descriptors()[0]["pid"] == worker_pid


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_other_uid_is_refused_with_permission_denied(denv: DaemonEnv) -> None:
    denv.prompt("hi")
    # open the path up so another uid can reach the socket at all; SO_PEERCRED must still refuse
    os.chmod(denv.root, 0o755)
    os.chmod(denv.root / "s", 0o711)
    os.chmod(denv.socket, 0o666)
    # a forked child (this test is synchronous: no event loop here) drops to uid 65534
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(read_fd)
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(denv.socket)
            os.write(write_fd, s.recv(65536))
        finally:
            os._exit(0)
    os.close(write_fd)
    data = b""
    with os.fdopen(read_fd, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    reply = json.loads(data.splitlines()[0])
    assert reply["ok"] is False
    assert reply["error"]["code"] == "permission_denied"
    assert "uid 65534" in reply["error"]["message"]
    # our own clients refuse a socket dir others may enter: close it again first
    os.chmod(denv.root / "s", 0o700)
    assert denv.prompt("still serving") == "[echo turn 2] still serving"


def test_a_session_lives_under_one_socket_at_a_time(denv: DaemonEnv) -> None:
    other = denv.socket_at("other.sock")
    assert denv.prompt("here", session="shared") == "[echo turn 1] here"
    cp = denv.run("--socket", other, "-p", "-s", "shared", "there")
    assert cp.returncode == EXIT_OWN
    assert f"runs under the supervisor on {denv.socket}" in cp.stderr
    assert f"--socket {denv.socket}" in cp.stderr
    # once its worker is gone, another socket may take the session over, history intact
    assert denv.run("shutdown").returncode == 0
    assert denv.prompt("there", session="shared", socket=other) == "[echo turn 2] there"
