"""Files and sockets another user could have written, as the same uid can arrange them: a socket
dir that others may enter, state files writable by others. Real supervisors and workers.

(Attacks by a second uid are in test_security_e2e.py; these need no root.)
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest
import trio

import trio_agentd
from trio_agentd import AgentdError
from trio_agentd._cli_exit import EXIT_OWN

from .harness import DaemonEnv, wait_for


class _Listener:
    """A listening socket that records every byte any client sends it."""

    def __init__(self, path: str) -> None:
        self.received = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(0.5)
                conn.sendall(b'{"type":"hello","protocol":1,"app_version":"0.1.0",'
                             b'"generation":"f","pid":1,"start_id":null,"socket":"x"}\n')
                try:
                    while chunk := conn.recv(65536):
                        self.received += chunk
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


async def test_open_client_proves_the_socket_dir_before_sending(denv: DaemonEnv) -> None:
    sock_dir = denv.root / "s"
    listener = _Listener(denv.socket)
    try:
        os.chmod(sock_dir, 0o755)  # others may enter: someone else could have put this there
        with trio.fail_after(30), pytest.raises(AgentdError) as info:
            async with trio_agentd.open_client(
                denv.socket, home=str(denv.home), registry=str(denv.registry), autostart=False
            ) as client:
                await client.prompt("s", "my secret prompt")
        assert info.value.code == "permission_denied"
        assert f"socket directory {sock_dir} has mode 0755" in info.value.message
    finally:
        listener.close()
    assert listener.received == b""


def test_cli_refuses_a_socket_dir_others_may_enter_and_sends_nothing(denv: DaemonEnv) -> None:
    listener = _Listener(denv.socket)
    try:
        os.chmod(denv.root / "s", 0o711)
        cp = denv.run("-p", "my secret prompt")
    finally:
        listener.close()
    assert cp.returncode == EXIT_OWN
    assert cp.stderr.count("\n") == 1
    assert "Traceback" not in cp.stderr
    assert cp.stderr.startswith(f"trio-agentd: error: socket directory {denv.root / 's'}")
    assert "chmod 700" in cp.stderr
    assert listener.received == b""


def test_ps_and_doctor_show_a_foreign_socket_and_leave_it_alone(denv: DaemonEnv) -> None:
    listener = _Listener(denv.socket)
    try:
        os.chmod(denv.root / "s", 0o755)
        cp = denv.run("ps", "--json")
        assert cp.returncode == 0, cp.stderr
        rows = {r["socket"]: r for r in json.loads(cp.stdout)}
        assert rows[denv.socket]["status"] == "foreign"
        fix = denv.run("doctor", "--fix")
        assert fix.returncode == 3, fix.stdout + fix.stderr
        assert "not yours" in fix.stdout
        off = denv.run("shutdown", "--all", "--force")
        assert "left alone" in off.stdout
        assert os.path.exists(denv.socket)  # neither removed it
    finally:
        listener.close()
    assert listener.received == b""


def test_a_descriptor_others_can_write_is_not_adopted(denv: DaemonEnv) -> None:
    assert denv.prompt("one", session="w") == "[echo turn 1] one"
    desc = next((denv.home / "daemons").glob("*/workers/w.json"))
    sup = denv.owner()["pid"]
    assert denv.run("shutdown").returncode == 0
    wait_for(lambda: sup not in denv.our_pids(), timeout=20, what="the supervisor to stop")
    os.chmod(desc, 0o666)
    # the next supervisor refuses the descriptor with a logged reason and serves on
    assert denv.prompt("hello", session="other") == "[echo turn 1] hello"
    wait_for(lambda: "not trusted" in denv.log_text(), timeout=10, what="the logged refusal")
    assert f"skipping worker descriptor {desc}" in denv.log_text()


def test_a_journal_others_can_write_is_refused_not_replayed(denv: DaemonEnv) -> None:
    assert denv.prompt("one", session="j") == "[echo turn 1] one"
    journal = next((denv.home / "daemons").glob("*/journal/j.jsonl"))
    assert denv.run("shutdown").returncode == 0  # stops the worker too
    wait_for(lambda: not denv.our_pids(), timeout=20, what="everything to stop")
    os.chmod(journal, 0o666)
    cp = denv.run("-p", "-s", "j", "two")
    assert cp.returncode == EXIT_OWN
    assert "Traceback" not in cp.stderr
    log = Path(next((denv.home / "sessions" / "j").glob("worker.log"))).read_text()
    assert f"{journal} has mode 0666 (group or others may write it) — not trusted" in log


def test_an_owner_record_others_can_write_is_restored_as_corrupt(denv: DaemonEnv) -> None:
    assert denv.prompt("one") == "[echo turn 1] one"
    record = denv.owner_records()[0] / "owner.json"
    os.chmod(record, 0o666)
    # the next command finds it untrusted (read as corrupt) and restores a record of its own
    assert denv.prompt("two") == "[echo turn 2] two"
    assert record.stat().st_mode & 0o777 == 0o600
    assert "not trusted" in denv.log_text()


async def test_open_client_autostart_imports_nothing_from_the_cwd(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = denv.root / "project"
    cwd.mkdir()
    marker = denv.root / "imported"
    for name in ("json", "types", "trio", "sniffio", "argparse"):
        (cwd / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\nraise ImportError('shadow')\n"
        )
    monkeypatch.chdir(cwd)
    with trio.fail_after(60):
        async with trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry)
        ) as client:
            assert await client.prompt("auto", "hi") == "[echo turn 1] hi\n"
    assert not marker.exists(), marker.read_text()
    sup = denv.owner()["pid"]
    assert os.readlink(f"/proc/{sup}/cwd") == "/"
