"""Another local user attacks the victim's daemon: end to end, with real processes.

The victim is this test's uid (root); the attacker is uid 65534 (nobody), run with
``subprocess`` ``user=``/``group=``/``extra_groups=[]``. The attacker's processes do not carry the
harness marker: each is killed by pid in a ``finally``.

The victim's CLI is the installed console script (not ``python -m``, which imports from the cwd
by design). Shared directories (a stand-in for ``/tmp``) are private 1777 dirs from the
``shared`` fixture, passed as ``TMPDIR``, so the real ``/tmp/trio-agentd-0`` is never touched.

What every client owes (contract): prove the socket's directory (owned by us, no group/other
bits, not a symlink) before sending a byte, and the peer's uid (SO_PEERCRED) after connecting;
on failure exit 1 with one line ``trio-agentd: error: ...`` naming the path, and the listener
gets zero bytes.

Each test showed its hole on the code before the proofs existed (the prompt reached the
attacker, evil.sh ran, the supervisor imported from the client's cwd, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trio_agentd._version import APP_VERSION, PROTOCOL_VERSION

from .harness import DaemonEnv, daemon_env, failure_status, wait_for

ATTACKER = 65534
# the attacker cannot run the venv's python (it lives under /root): a system python, stdlib only
ATTACKER_PYTHON = "/usr/bin/python3"
CLI = Path(sys.executable).parent / "trio-agentd"
SECRET = "my secret prompt"
SHADOWED = ("trio", "sniffio", "types", "json", "shlex")
# documented per-turn variables for agents (agents/_shell.py), not the daemon's internals
AGENT_API_VARS = ("TRIO_AGENTD_SESSION=", "TRIO_AGENTD_TURN=")

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="needs root: the victim is root and the attacker is started as uid 65534 (nobody)",
    ),
    pytest.mark.skipif(not os.path.exists(ATTACKER_PYTHON),
                       reason=f"the attacker's processes need {ATTACKER_PYTHON}"),
]

# --- the attacker ------------------------------------------------------------------------------


def as_attacker(code: str, *args: str) -> None:
    """Run a short python snippet as uid 65534; it must succeed."""
    cp = subprocess.run(
        [ATTACKER_PYTHON, "-I", "-c", code, *args], user=ATTACKER, group=ATTACKER,
        extra_groups=[], env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True,
        text=True, timeout=30, stdin=subprocess.DEVNULL,
    )
    assert cp.returncode == 0, f"attacker step failed: {cp.stderr}"


def attacker_mkdir(path: Path, mode: int = 0o700) -> None:
    as_attacker("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], int(sys.argv[2]))",
                str(path), str(mode))


# Binds PATH, answers every connection with HELLO (pid set to its own unless --keep-pid), reads
# one request line and answers it with an error, then logs every byte the client sent.
# "--drop" binds as root, then becomes uid 65534, then listens: SO_PEERCRED reports the
# credentials of listen() time, so the socket file is root's but the peer is the attacker.
_FAKE_LISTENER = r"""
import json, os, socket, sys, threading
path, log, hello = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
flags = sys.argv[4:]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
if "--drop" in flags:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
if "--keep-pid" not in flags:
    hello["pid"] = os.getpid()
s.listen(16)
lock = threading.Lock()
def note(line):
    with lock, open(log, "a") as f:
        f.write(line + "\n")
def serve(c):
    note("accept")
    got = b""
    try:
        c.settimeout(20)
        c.sendall(json.dumps(hello).encode() + b"\n")
        while b"\n" not in got:
            chunk = c.recv(65536)
            if not chunk:
                break
            got += chunk
        if b"\n" in got:
            rid = json.loads(got.split(b"\n", 1)[0]).get("id")
            c.sendall(json.dumps({"type": "response", "id": rid, "ok": False, "error": {
                "code": "internal", "message": "fake listener"}}).encode() + b"\n")
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            got += chunk
    except (OSError, ValueError):
        pass
    finally:
        c.close()
        note("closed " + got.hex())
print("ready", flush=True)
while True:
    conn, _ = s.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


class FakeListener:
    def __init__(self, proc: subprocess.Popen[str], log: Path, path: Path) -> None:
        self.proc, self.log, self.path = proc, log, path

    def _lines(self) -> list[str]:
        try:
            return self.log.read_text().splitlines()
        except FileNotFoundError:
            return []

    def received(self) -> bytes:
        """Every byte any client sent, once every accepted connection has ended."""
        def settled() -> list[str] | None:
            lines = self._lines()
            accepts = sum(line == "accept" for line in lines)
            closed = [line for line in lines if line.startswith("closed")]
            return closed if len(closed) == accepts else None

        wait_for(lambda: settled() is not None, timeout=30, what="the listener's connections")
        return b"".join(bytes.fromhex(line.split(" ", 1)[1]) for line in settled() or [])

    def alive(self) -> bool:
        return self.proc.poll() is None


def fake_hello(socket_path: Path) -> dict[str, Any]:
    return {"type": "hello", "protocol": PROTOCOL_VERSION, "app_version": APP_VERSION,
            "generation": "f" * 32, "pid": 1, "start_id": None, "socket": str(socket_path),
            "capabilities": []}


@contextlib.contextmanager
def fake_listener(path: Path, log_dir: Path, hello: dict[str, Any] | None = None, *,
                  drop_after_bind: bool = False, keep_pid: bool = False
                  ) -> Iterator[FakeListener]:
    """The attacker's listener on ``path``; killed by pid when the block ends."""
    log = log_dir / f"capture-{path.parent.name}-{path.name}.log"
    flags = (["--drop"] if drop_after_bind else []) + (["--keep-pid"] if keep_pid else [])
    who: dict[str, Any] = {} if drop_after_bind else {
        "user": ATTACKER, "group": ATTACKER, "extra_groups": []}
    proc = subprocess.Popen(
        [ATTACKER_PYTHON, "-I", "-c", _FAKE_LISTENER, str(path), str(log),
         json.dumps(hello or fake_hello(path)), *flags],
        env={"PATH": "/usr/bin:/bin"}, cwd="/", stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **who,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until it listens, or it died
        assert line == "ready\n", f"fake listener did not start: {proc.communicate()[1]}"
        yield FakeListener(proc, log, path)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


# --- the victim ----------------------------------------------------------------------------------


@pytest.fixture
def shared() -> Iterator[Path]:
    """A world-writable sticky dir (mode 1777, root-owned): a private stand-in for /tmp."""
    d = Path(tempfile.mkdtemp(prefix="ta-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_cli(env: DaemonEnv, *args: str, extra: dict[str, str] | None = None,
            unset: tuple[str, ...] = (), cwd: Path | None = None, umask: int = -1,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The victim runs the installed ``trio-agentd`` console script."""
    e = {k: v for k, v in env.env.items() if k not in unset}
    e.update(extra or {})
    return subprocess.run(
        [str(CLI), *args], env=e, cwd=cwd or env.root, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL, umask=umask,
    )


def fallback_env(shared: Path) -> dict[str, Any]:
    """No XDG_RUNTIME_DIR and no explicit socket: the socket is ``$TMPDIR/trio-agentd-<uid>``."""
    return {"extra": {"TMPDIR": str(shared)}, "unset": ("XDG_RUNTIME_DIR", "TRIO_AGENTD_SOCKET")}


def fallback_dir(shared: Path) -> Path:
    return shared / f"trio-agentd-{os.getuid()}"


def assert_refused(cp: subprocess.CompletedProcess[str], path: Path,
                   words: tuple[str, ...] = ("owned", "mode")) -> None:
    out = cp.stdout + cp.stderr
    assert "Traceback" not in out, out
    assert cp.returncode == failure_status(cp), out
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1, cp.stderr
    assert lines[0].startswith("trio-agentd: error: "), cp.stderr
    assert str(path) in lines[0], cp.stderr
    assert any(w in lines[0] for w in words), cp.stderr


def bound_paths(pid: int) -> set[str]:
    """Unix socket paths bound by sockets that process ``pid`` holds (from /proc/net/unix)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    out = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes:
                out.add(parts[7])
    return out


# --- 1, 2: the fallback socket dir in a shared /tmp ---------------------------------------------


def test_attacker_precreated_fallback_dir_gets_no_byte_of_the_prompt(
    shared: Path, denv: DaemonEnv
) -> None:
    d = fallback_dir(shared)
    attacker_mkdir(d)
    with fake_listener(d / "daemon.sock", shared) as fake:
        cp = run_cli(denv, "-p", "-s", "s", SECRET, **fallback_env(shared))
        got = fake.received()
        assert SECRET.encode() not in got
        assert got == b""
        assert_refused(cp, d)
        assert sorted(os.listdir(d)) == ["daemon.sock"]  # nothing of ours was put there


def _root_0777(shared: Path) -> Path:
    d = fallback_dir(shared)
    d.mkdir()
    os.chmod(d, 0o777)
    return d


def _attacker_symlink(shared: Path) -> Path:
    target = shared / "attackers-dir"
    attacker_mkdir(target)
    as_attacker("import os, sys; os.symlink(sys.argv[1], sys.argv[2])",
                str(target), str(fallback_dir(shared)))
    return target


@pytest.mark.parametrize("make", [_root_0777, _attacker_symlink], ids=["root-0777", "symlink"])
def test_unsafe_fallback_dir_is_refused_never_reused_or_chmodded(
    shared: Path, denv: DaemonEnv, make: Any
) -> None:
    listen_dir: Path = make(shared)  # where the attacker's socket really is
    d = fallback_dir(shared)
    before = os.lstat(d)
    with fake_listener(listen_dir / "daemon.sock", shared) as fake:
        cp = run_cli(denv, "-p", "-s", "s", SECRET, **fallback_env(shared))
        assert fake.received() == b""
        assert_refused(cp, d, ("owned", "mode", "symlink"))
        after = os.lstat(d)
        assert (after.st_mode, after.st_uid, after.st_ino) == (
            before.st_mode, before.st_uid, before.st_ino)
        assert sorted(os.listdir(d)) == ["daemon.sock"]


# --- 3: XDG_RUNTIME_DIR owned by the attacker; a root-owned dir with an attacker peer ----------


def test_attacker_owned_runtime_dir_swapped_under_a_running_supervisor(shared: Path) -> None:
    # sudo -E: XDG_RUNTIME_DIR still names the other user's runtime dir
    xdg = shared / "xdg"
    attacker_mkdir(xdg)
    # the self-check would otherwise re-bind the real socket inside the attacker's new dir
    # (a race the attacker can re-win at will); keep the scenario deterministic
    with daemon_env(extra_env={"XDG_RUNTIME_DIR": str(xdg),
                               "TRIO_AGENTD_TIMING": '{"self_check_interval": 3600}'}) as env:
        unset = ("TRIO_AGENTD_SOCKET",)
        cp = run_cli(env, "-p", "-s", "s", "first", unset=unset)
        assert cp.returncode == 0, cp.stderr
        sock_dir = xdg / "trio-agentd"
        real_hello = env.hello(str(sock_dir / "daemon.sock"))
        assert real_hello is not None
        as_attacker("import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.aside')",
                    str(sock_dir))
        attacker_mkdir(sock_dir)
        with fake_listener(sock_dir / "daemon.sock", shared, real_hello, keep_pid=True) as fake:
            cp = run_cli(env, "-p", "-s", "s", SECRET, unset=unset)
            assert fake.received() == b""
            assert_refused(cp, sock_dir)


def test_listener_of_another_uid_in_our_own_private_dir_is_refused(
    shared: Path, denv: DaemonEnv
) -> None:
    sock = Path(denv.socket)
    assert os.stat(sock.parent).st_uid == os.getuid()  # root-owned, 0700: the dir proof passes
    with fake_listener(sock, shared, drop_after_bind=True) as fake:
        assert os.stat(sock).st_uid == os.getuid()  # even the socket file is ours
        cp = run_cli(denv, "-p", "-s", "s", SECRET)
        assert fake.received() == b""
        assert_refused(cp, sock, ("uid",))


# --- 4: the supervisor re-binds only into a proven dir ------------------------------------------


def test_supervisor_does_not_rebind_into_a_dir_the_attacker_recreated(
    shared: Path, denv: DaemonEnv
) -> None:
    from .test_core_e2e import RESTORED

    sub = shared / "sub"
    sub.mkdir(mode=0o700)
    sock = sub / "d.sock"
    cp = run_cli(denv, "--socket", str(sock), "-p", "-s", "s", "first")
    assert cp.returncode == 0, cp.stderr
    pid = int(denv.owner()["pid"])
    assert str(sock) in bound_paths(pid)
    # a tmp cleaner removes the dir; the attacker recreates it, world-writable
    shutil.rmtree(sub)
    attacker_mkdir(sub, 0o777)
    # the self-check's clock: it restores a deleted record, then checks the socket in the same
    # round; two restores in a row mean at least one full round saw the attacker's dir (a
    # supervisor that exits rather than serve from a dir it cannot prove is fine too)
    for n in (1, 2):
        if pid not in denv.our_pids():
            break
        (denv.registry / f"{denv.owner()['generation']}.owner" / "owner.json").unlink()

        def round_done(n: int = n) -> bool:
            return len(RESTORED.findall(denv.log_text())) >= n or pid not in denv.our_pids()

        wait_for(round_done, timeout=10, what=f"self-check round {n}")
    # the supervisor put nothing there: no socket bound again, no lease or autostart lock
    assert os.listdir(sub) == []
    # whatever the supervisor did, the attacker now owns the path
    as_attacker("import os, sys\ntry: os.unlink(sys.argv[1])\nexcept FileNotFoundError: pass",
                str(sock))
    with fake_listener(sock, shared) as fake:
        cp = run_cli(denv, "--socket", str(sock), "-p", "-s", "s", SECRET)
        assert fake.received() == b""
        assert_refused(cp, sub)


# --- 5: umask 000, and records planted by someone else -----------------------------------------


def _modes(env: DaemonEnv, sock_dir: Path) -> list[str]:
    """Every dir that is not 0700 and every file writable by group or other."""
    bad = []
    for top in (env.home, env.registry, sock_dir):
        for dirpath, _dirnames, filenames in os.walk(top):
            st = os.lstat(dirpath)
            if stat.S_IMODE(st.st_mode) != 0o700:
                bad.append(f"{dirpath} {stat.S_IMODE(st.st_mode):04o}")
            for name in filenames:
                m = stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode)
                if m & 0o022:
                    bad.append(f"{dirpath}/{name} {m:04o}")
    return bad


def test_every_dir_is_0700_under_umask_000(denv: DaemonEnv) -> None:
    # the client creates the socket dir too: no TRIO_AGENTD_SOCKET, the XDG default
    cp = run_cli(denv, "-p", "-s", "work", "hi", unset=("TRIO_AGENTD_SOCKET",), umask=0)
    assert cp.returncode == 0, cp.stderr
    sock_dir = Path(denv.env["XDG_RUNTIME_DIR"]) / "trio-agentd"
    assert (denv.home / "sessions" / "work").is_dir()
    assert denv.owner_records()
    assert _modes(denv, sock_dir) == []


def _plant_foreign_owner(meta: Path) -> None:
    os.chown(meta.parent, ATTACKER, ATTACKER)
    os.chown(meta, ATTACKER, ATTACKER)


def _plant_world_writable(meta: Path) -> None:
    os.chmod(meta, 0o666)


@pytest.mark.parametrize("plant", [_plant_foreign_owner, _plant_world_writable],
                         ids=["owned-by-attacker", "world-writable"])
def test_planted_session_metadata_never_runs_its_agent(denv: DaemonEnv, plant: Any) -> None:
    cp = run_cli(denv, "-p", "-s", "first", "hi", umask=0)
    assert cp.returncode == 0, cp.stderr
    marker = denv.root / "evil-ran"
    evil = denv.root / "evil.sh"
    evil.write_text(f"#!/bin/sh\ntouch {marker}\necho pwned\n")
    evil.chmod(0o755)
    meta = json.loads((denv.home / "sessions" / "first" / "session.json").read_bytes())
    meta.update(session="work", agent=f"exec:{evil}")
    planted = denv.home / "sessions" / "work" / "session.json"
    planted.parent.mkdir(mode=0o700)
    planted.write_text(json.dumps(meta))
    plant(planted)
    cp = run_cli(denv, "-p", "-s", "work", "hi", umask=0)
    out = cp.stdout + cp.stderr
    assert not marker.exists(), out
    assert "pwned" not in out
    assert "Traceback" not in out, out


# --- 6: nothing is imported from a cwd ----------------------------------------------------------


def _shadow_dir(where: Path, markers: Path) -> Path:
    where.mkdir()
    for mod in SHADOWED:
        (where / f"{mod}.py").write_text(
            "import os as _os\n"
            f"open({str(markers / (where.name + '-' + mod))!r} + '-' + str(_os.getpid()), 'w')"
            ".close()\n"
            f"raise ImportError('shadow {mod} imported from {where}')\n"
        )
    return where


def test_shadowing_modules_in_the_client_cwd_are_never_imported(denv: DaemonEnv) -> None:
    markers = denv.root / "markers"
    markers.mkdir()
    client_cwd = _shadow_dir(denv.root / "client-cwd", markers)
    # autostart (supervisor, then a worker) from a cwd full of shadows
    cp = run_cli(denv, "-p", "-s", "a", "hi", cwd=client_cwd)
    assert (cp.returncode, cp.stdout) == (0, "[echo turn 1] hi\n"), cp.stderr
    cp = run_cli(denv, "-p", "-s", "b", "--agent", "shell", "echo answered", cwd=client_cwd)
    assert (cp.returncode, cp.stdout) == (0, "answered\n"), cp.stderr
    assert sorted(os.listdir(markers)) == []


def test_shadowing_modules_in_a_session_cwd_are_never_imported(denv: DaemonEnv) -> None:
    markers = denv.root / "markers"
    markers.mkdir()
    session_cwd = _shadow_dir(denv.root / "session-cwd", markers)
    assert run_cli(denv, "-p", "-s", "a", "hi").returncode == 0  # autostart from a clean cwd
    # sessions whose cwd is full of shadows: each worker chdirs there, then imports lazily
    cp = run_cli(denv, "-p", "-s", "b", "--agent", "shell", "echo answered", cwd=session_cwd)
    assert (cp.returncode, cp.stdout) == (0, "answered\n"), cp.stderr
    cp = run_cli(denv, "-p", "-s", "c", "--agent", "exec:cat", "cat too", cwd=session_cwd)
    assert (cp.returncode, cp.stdout) == (0, "cat too"), cp.stderr  # its bytes, nothing added
    assert sorted(os.listdir(markers)) == []


def test_autostarted_supervisor_leaves_the_client_cwd_and_has_umask_077(
    denv: DaemonEnv,
) -> None:
    where = denv.root / "somewhere"
    where.mkdir()
    cp = run_cli(denv, "-p", "hi", cwd=where)
    assert cp.returncode == 0, cp.stderr
    pid = int(denv.owner()["pid"])
    status = Path(f"/proc/{pid}/status").read_text()
    umask = next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:"))
    assert (os.readlink(f"/proc/{pid}/cwd"), umask) == ("/", "0077")


# --- 7: agents see the creating client's environment, none of the daemon's ---------------------


def _agent_env(env: DaemonEnv, session: str) -> list[str]:
    cp = run_cli(env, "-p", "-s", session, "--agent", "shell", "env",
                 extra={"MY_CLIENT_VAR": "1"})
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.splitlines()


def _assert_clean(lines: list[str]) -> None:
    internal = [ln for ln in lines
                if ln.startswith("TRIO_AGENTD_") and not ln.startswith(AGENT_API_VARS)]
    assert internal == []
    assert "MY_CLIENT_VAR=1" in lines  # set only in the client that created the session


def test_agent_environment_after_autostart(denv: DaemonEnv) -> None:
    assert run_cli(denv, "-p", "-s", "warm", "hi").returncode == 0  # autostart, no MY_CLIENT_VAR
    _assert_clean(_agent_env(denv, "envs"))


def test_agent_environment_after_doctor_fix_has_no_admission_ticket() -> None:
    with daemon_env(extra_env={"TRIO_AGENTD_SELF_HEAL": "0"}) as env:
        assert run_cli(env, "-p", "-s", "keep", "one").returncode == 0
        wedged = env.owner()["pid"]
        (env.owner_records()[0] / "owner.json").unlink()
        fix = run_cli(env, "doctor", "--fix")
        assert fix.returncode == 0, fix.stdout + fix.stderr
        assert env.owner()["pid"] != wedged
        lines = _agent_env(env, "envs")
        assert not [ln for ln in lines if ln.startswith("TRIO_AGENTD_ADMISSION_TICKET")]
        _assert_clean(lines)


# --- 8: ps and doctor --------------------------------------------------------------------------


@contextlib.contextmanager
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """One of the victim's own processes (an editor, say), killed by pid when the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_ps_reports_a_foreign_socket_and_doctor_fix_leaves_it_alone(
    shared: Path, denv: DaemonEnv
) -> None:
    from trio_agentd._identity import read_start_id

    d = fallback_dir(shared)
    attacker_mkdir(d)
    sock = d / "daemon.sock"
    with bystander() as victim:
        # the fake hello names one of the victim's processes, with its real start id (anyone
        # can read /proc/PID/stat): a doctor that trusted it would kill that process as root
        hello = {**fake_hello(sock), "pid": victim.pid, "start_id": read_start_id(victim.pid)}
        with fake_listener(sock, shared, hello, keep_pid=True) as fake:
            cp = run_cli(denv, "ps", "--json", **fallback_env(shared))
            assert cp.returncode == 0, cp.stderr
            rows = {r["socket"]: r for r in json.loads(cp.stdout)}
            assert rows[str(sock)]["status"] == "foreign", rows
            fix = run_cli(denv, "doctor", "--fix", **fallback_env(shared))
            assert "Traceback" not in fix.stdout + fix.stderr
            assert victim.poll() is None, fix.stdout
            assert fake.alive()
            assert sorted(os.listdir(d)) == ["daemon.sock"], fix.stdout
            assert stat.S_ISSOCK(os.lstat(sock).st_mode)
            assert fake.received() == b""
