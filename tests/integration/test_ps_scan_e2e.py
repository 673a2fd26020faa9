"""The process scan of ``ps``/``doctor`` runs only when it may find something, and then finds
what it always found: real supervisors, real sockets, a real ``/proc``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from trio_agentd import _doctor, _doctor_discover, _doctor_probe
from trio_agentd._paths import Layout

from .harness import DaemonEnv, wait_for


def _layout(env: DaemonEnv) -> Layout:
    return Layout(home=env.home, socket=env.socket, registry=env.registry)


def _count_scans(monkeypatch: pytest.MonkeyPatch, env: DaemonEnv) -> list[str]:
    """Count the process scans; the listening sockets are this test's alone (on a shared
    machine another test's supervisor, of this uid, may just have lost its socket file)."""
    scans: list[str] = []
    real = _doctor_discover.scanned_sockets
    real_listening = _doctor_discover.listening_sockets

    def ours_only(named: set[str]) -> list[tuple[str, bool, str]] | None:
        found = real_listening(named)
        root = f"{env.root}/"
        return None if found is None else [x for x in found if x[0].startswith(root)]

    monkeypatch.setattr(_doctor, "listening_sockets", ours_only)

    def counted(home: str) -> list[str]:
        scans.append(home)
        return real(home)

    monkeypatch.setattr(_doctor, "scanned_sockets", counted)
    return scans


def test_a_healthy_supervisor_is_listed_without_a_process_scan(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert denv.prompt("one", session="a") == "[echo turn 1] one"
    scans = _count_scans(monkeypatch, denv)
    monkeypatch.setenv("XDG_RUNTIME_DIR", denv.env["XDG_RUNTIME_DIR"])
    found = _doctor.survey(_layout(denv))
    assert [(f.socket, str(f.verdict.status)) for f in found] == [(denv.socket, "current")]
    assert scans == []
    assert _doctor.survey(_layout(denv), scan=True)[0].socket == denv.socket
    assert len(scans) == 1


def test_ps_finds_a_supervisor_no_file_names_beside_a_healthy_one(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    other, p = _second_supervisor_without_files(denv)
    cp = denv.run("ps", "--json")
    assert cp.returncode == 0, cp.stderr
    rows = {r["socket"]: r for r in json.loads(cp.stdout)}
    assert rows[denv.socket]["status"] == "current"
    assert other in rows
    assert rows[other]["pid"] == p.pid



def test_another_homes_supervisor_costs_no_scan_until_its_socket_file_goes(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert denv.prompt("one", session="a") == "[echo turn 1] one"
    other = denv.socket_at("other.sock")  # a supervisor of another home and registry
    p = denv.popen("--socket", other, "--home", str(denv.root / "home2"),
                   "--registry", str(denv.root / "reg2"), "daemon")
    wait_for(lambda: denv.hello(other), timeout=30, what="the supervisor on other.sock")
    scans = _count_scans(monkeypatch, denv)
    monkeypatch.setenv("XDG_RUNTIME_DIR", denv.env["XDG_RUNTIME_DIR"])
    # its socket listens and no file of this home names it: its lease names its pid, whose
    # command line says it serves another home — not ours, and no scan needed to know it
    found = _doctor.survey(_layout(denv))
    assert [(f.socket, str(f.verdict.status)) for f in found] == [(denv.socket, "current")]
    assert scans == []

    # its socket file deleted: a listener whose file is gone might be ours, so the scan runs
    # (and finds it serves another home)
    os.unlink(other)
    found = _doctor.survey(_layout(denv))
    assert [(f.socket, str(f.verdict.status)) for f in found] == [(denv.socket, "current")]
    assert scans == [str(denv.home)]  # a string: the scan imports no pathlib
    assert p.poll() is None


def _record_sockets(env: DaemonEnv) -> list[str] | None:
    try:
        return [json.loads((r / "owner.json").read_bytes())["socket"]
                for r in env.owner_records()]
    except (OSError, ValueError):
        return None  # being written


def test_listening_sockets_show_a_deleted_socket_file(tmp_path: Path) -> None:
    path = str(tmp_path / "x.sock")
    worker = str(tmp_path / "w-1234-abcd.sock")
    with socket.socket(socket.AF_UNIX) as s, socket.socket(socket.AF_UNIX) as w:
        s.bind(path)
        s.listen()
        w.bind(worker)
        w.listen()
        listeners = _doctor_discover.listening_sockets({path})
        assert listeners is not None
        assert (path, True, "ours") in listeners
        assert not [entry for entry in listeners if entry[0] == worker]  # a worker's: skipped
        os.unlink(path)
        listeners = _doctor_discover.listening_sockets(set())
        assert listeners is not None
        assert (path, False, "gone") in listeners


def test_hello_probes_run_at_once(tmp_path: Path) -> None:
    """ps reads every supervisor's hello concurrently: here each listener says hello only once
    all of them are connected, which probes made one after another would never see (the
    first would wait for its hello until its timeout)."""
    import threading

    sock_dir = tmp_path / "s"
    sock_dir.mkdir(mode=0o700)
    paths = [str(sock_dir / f"d{i}.sock") for i in range(5)]
    listeners = []
    for path in paths:
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lst.bind(path)
        lst.listen(1)
        listeners.append(lst)

    def serve() -> None:
        conns = [lst.accept()[0] for lst in listeners]  # every probe connected first
        for i, conn in enumerate(conns):
            conn.sendall(json.dumps({"type": "hello", "generation": f"g{i}"}).encode() + b"\n")
            conn.close()

    class Patient:
        connect_timeout = 1.0
        hello_timeout = 20.0  # the test's deadline: a sequential probe fails only after it

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        got = _doctor_probe.probe_hellos([*paths, str(sock_dir / "none.sock")],
                                   Patient())  # type: ignore[arg-type]
    finally:
        for lst in listeners:
            lst.close()
    server.join(timeout=20)
    assert not server.is_alive()
    for i, path in enumerate(paths):
        result = got[path]
        assert not isinstance(result, _doctor_probe.Untrusted)
        assert result[:2] == (True, True)
        assert result[2] is not None
        assert result[2]["generation"] == f"g{i}"
    assert got[str(sock_dir / "none.sock")] == (False, False, None)


def test_an_untrusted_socket_dir_does_not_stop_the_other_probes(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(mode=0o700)
    bad.mkdir(mode=0o755)
    bad.chmod(0o755)
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(str(good / "d.sock"))
    lst.listen(1)
    try:
        got = _doctor_probe.probe_hellos([str(bad / "d.sock"), str(good / "d.sock")])
    finally:
        lst.close()
    assert isinstance(got[str(bad / "d.sock")], _doctor_probe.Untrusted)
    assert got[str(good / "d.sock")] == (True, True, None)  # accepted, no hello in time


def test_another_programs_socket_without_a_lease_costs_no_scan(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listening ``*.sock`` of this user that no file names and that has no lease (a test
    server, another program's) is no supervisor of this home when none of the processes that
    hold a flock serves it: no process scan for it."""
    assert denv.prompt("one", session="a") == "[echo turn 1] one"
    scans = _count_scans(monkeypatch, denv)
    monkeypatch.setenv("XDG_RUNTIME_DIR", denv.env["XDG_RUNTIME_DIR"])
    with socket.socket(socket.AF_UNIX) as lst:
        lst.bind(denv.socket_at("relay.sock"))
        lst.listen()
        found = _doctor.survey(_layout(denv))
    assert [(f.socket, str(f.verdict.status)) for f in found] == [(denv.socket, "current")]
    assert scans == []


def test_a_supervisor_that_lost_its_files_and_its_lease_file_is_found_by_its_flock(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its records, descriptors and lease file deleted, a supervisor still holds its lease's
    flock: it is found among the flock holders (``scan=False``: not by the process scan)."""
    other, p = _second_supervisor_without_files(denv, lease_file=False)
    scans = _count_scans(monkeypatch, denv)
    monkeypatch.setenv("XDG_RUNTIME_DIR", denv.env["XDG_RUNTIME_DIR"])
    found = {f.socket: f for f in _doctor.survey(_layout(denv), scan=False)}
    assert str(found[denv.socket].verdict.status) == "current"
    assert (found[other].verdict.pid, str(found[other].verdict.status)) == (
        p.pid, "ownership-lost")
    assert scans == []


def test_flock_holders_are_read_from_proc_locks() -> None:
    text = (b"1: FLOCK  ADVISORY  WRITE 4242 fe:00:2159697 0 EOF\n"
            b"1: -> FLOCK  ADVISORY  WRITE 4343 fe:00:2159697 0 EOF\n"
            b"2: POSIX  ADVISORY  READ 4444 fe:00:5677185 128 128\n"
            b"3: FLOCK  ADVISORY  READ 0 fe:00:2172399 0 EOF\n"
            b"4: FLOCK  ADVISORY  WRITE 4242 fe:00:2172399 0 EOF\n")
    assert _doctor_discover.parse_flock_holders(text) == [4242]
    with open(f"{os.environ.get('TMPDIR', '/tmp')}/.flock-test-{os.getpid()}", "w") as f:
        import fcntl

        try:
            fcntl.flock(f, fcntl.LOCK_EX)
            assert os.getpid() in (_doctor_discover.flock_holders() or [])
        finally:
            os.unlink(f.name)


def test_a_socket_without_a_lease_imports_no_json(tmp_path: Path) -> None:
    """An unnamed listening socket with no lease file: saying so costs ps no ``json`` (whose
    import, with ``re``, costs more than the rest of a ps)."""
    import ast
    import subprocess
    import sys

    import trio_agentd

    (tmp_path / "run").mkdir(mode=0o700)
    code = ("import sys, _socket; from trio_agentd import _doctor;"
            " from trio_agentd._paths import Layout; before = set(sys.modules);"
            " s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM);"
            f" s.bind({str(tmp_path / 'relay.sock')!r}); s.listen();"
            f" _doctor.survey(Layout(home={str(tmp_path / 'h')!r},"
            f" socket={str(tmp_path / 's' / 'd.sock')!r}, registry={str(tmp_path / 'r')!r}));"
            " print(sorted(m for m in ('json', 're') if m in set(sys.modules) - before))")
    env = {"PYTHONPATH": str(Path(trio_agentd.__file__).parents[1]),
           "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         check=True, env=env, timeout=60)
    assert ast.literal_eval(out.stdout) == []


def test_a_hello_probe_ends_its_side_at_once(tmp_path: Path) -> None:
    """The probe sends nothing, and says so (EOF) as soon as its peer is proven: a supervisor
    finishes the connection in the wake-up that answers it. Here the listener answers only
    once it has read that end, which a probe that kept its side open would never show."""
    import threading

    sock_dir = tmp_path / "s"
    sock_dir.mkdir(mode=0o700)
    path = str(sock_dir / "d.sock")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(path)
    lst.listen(1)
    lst.settimeout(20)
    heard: list[bytes] = []

    def serve() -> None:
        conn = lst.accept()[0]
        with conn:
            conn.settimeout(20)
            heard.append(conn.recv(1))  # b"": the probe's end
            conn.sendall(b'{"type": "hello", "generation": "g"}\n')

    class Patient:
        connect_timeout = 1.0
        hello_timeout = 20.0  # the test's deadline

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        got = _doctor_probe.probe_hellos([path], Patient())  # type: ignore[arg-type]
    finally:
        server.join(timeout=20)
        lst.close()
    assert heard == [b""]
    result = got[path]
    assert not isinstance(result, _doctor_probe.Untrusted)
    assert result[2] is not None
    assert result[2]["generation"] == "g"


def test_ps_reads_one_proc_stat_per_supervisor(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor that answers its hello costs ``ps`` one read of its ``/proc/<pid>/stat``
    (after the hello: its record's liveness and the final re-check share it), and none for
    its sessions' workers (they change no status when the hello came)."""
    import builtins
    import re

    assert denv.prompt("one", session="a") == "[echo turn 1] one"
    assert denv.prompt("two", session="b") == "[echo turn 1] two"
    monkeypatch.setenv("XDG_RUNTIME_DIR", denv.env["XDG_RUNTIME_DIR"])
    stat = re.compile(r"/proc/(\d+)/stat")
    reads: list[int] = []
    real_open, real_os_open = builtins.open, os.open

    def counted(path: object) -> None:
        if isinstance(path, str) and (m := stat.fullmatch(path)):
            reads.append(int(m[1]))

    def io_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        counted(file)
        return real_open(file, *args, **kwargs)

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        counted(path)
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", io_open)
    monkeypatch.setattr(os, "open", os_open)
    found = _doctor.survey(_layout(denv), scan=False)
    monkeypatch.undo()
    assert [(f.socket, str(f.verdict.status)) for f in found] == [(denv.socket, "current")]
    assert reads == [found[0].verdict.pid]


def test_a_scope_is_read_only_where_its_record_could_not_be(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scope.json`` is the immutable part of ``owner.json``: ``ps`` reads it only in a record
    dir whose ``owner.json`` it could not read (there it still names the socket)."""
    timing = json.dumps({"self_check_interval": 3600})  # no healing: a deleted record stays so
    other = denv.socket_at("other.sock")  # only its record dir names it
    denv.popen("--socket", other, "daemon", env={"TRIO_AGENTD_TIMING": timing})
    wait_for(lambda: denv.hello(other), timeout=30, what="the supervisor on other.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", denv.env["XDG_RUNTIME_DIR"])
    read: list[str] = []
    real = _doctor_discover._read_trusted

    def counted(path: str) -> bytes | None:
        read.append(path)
        return real(path)

    monkeypatch.setattr(_doctor_discover, "_read_trusted", counted)
    found = {f.socket: str(f.verdict.status) for f in _doctor.survey(_layout(denv), scan=False)}
    assert found == {other: "current"}
    assert [p for p in read if p.endswith("scope.json")] == []

    (rec,) = denv.owner_records()
    (rec / "owner.json").unlink()
    read.clear()
    found = {f.socket: str(f.verdict.status) for f in _doctor.survey(_layout(denv), scan=False)}
    assert found == {other: "ownership-lost"}
    assert [p for p in read if p.endswith("scope.json")] == [str(rec / "scope.json")]


def _second_supervisor_without_files(
    denv: DaemonEnv, *, lease_file: bool = True
) -> tuple[str, subprocess.Popen[str]]:
    """A healthy default supervisor with a session, and a second one on ``other.sock`` (not in
    the default socket dir: only its files name it) whose records and descriptors are deleted,
    and its lease file too unless ``lease_file``; the default one has healed its own files
    (250 ms self-check), the other, with no self-check, has not. Its socket and process."""
    assert denv.prompt("one", session="a") == "[echo turn 1] one"
    other = denv.socket_at("other.sock")
    timing = json.dumps({"self_check_interval": 3600})  # no healing: its files stay lost
    p = denv.popen("--socket", other, "daemon", env={"TRIO_AGENTD_TIMING": timing})
    wait_for(lambda: denv.hello(other), timeout=30, what="the supervisor on other.sock")
    for gone in (denv.registry, denv.home / "daemons"):  # at once: the default one heals
        os.rename(gone, f"{gone}.gone")
        shutil.rmtree(f"{gone}.gone")
    if not lease_file:
        os.unlink(f"{other}.lock")
    wait_for(lambda: _record_sockets(denv) == [denv.socket], timeout=10,
             what="the default supervisor's record again")
    return other, p
