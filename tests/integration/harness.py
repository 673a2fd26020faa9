"""Real processes in private temp dirs, and cleanup that kills exactly what a test started.

Every process a test starts (the CLI, autostarted supervisors, their workers) inherits a unique
``TRIO_AGENTD_HOME``; :meth:`DaemonEnv.our_pids` finds them by that marker in
``/proc/<pid>/environ`` — by pid, never by name — and teardown SIGKILLs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], *, timeout: float, interval: float = 0.01, what: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _environ_of(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2 :][:1] in (b"Z", b"X")


@dataclass
class DaemonEnv:
    root: Path
    env: dict[str, str] = field(default_factory=dict)
    fresh_machine: bool = False
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def home(self) -> Path:
        if self.fresh_machine:
            return self.root / "userhome" / ".local" / "state" / "trio-agentd"
        return self.root / "home"

    @property
    def registry(self) -> Path:
        if self.fresh_machine:
            return self.home / "supervisor-owners"
        return self.root / "reg"

    @property
    def socket(self) -> str:
        if self.fresh_machine:
            return str(self.root / "run" / "trio-agentd" / "daemon.sock")
        return str(self.root / "s" / "d.sock")

    def socket_at(self, name: str) -> str:
        return str(self.root / "s" / name)

    @property
    def marker(self) -> bytes:
        return f"TA_TEST_RUN={self.root}".encode()

    # running the CLI ----------------------------------------------------------------------
    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "trio_agentd", *args]

    def run(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args), env={**self.env, **(env or {})}, capture_output=True, text=True,
            timeout=timeout, stdin=subprocess.DEVNULL,
        )

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Start a CLI process; teardown kills it (by pid) if it still runs and closes its pipes."""
        p = subprocess.Popen(
            self.argv(*args), env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        )
        self.procs.append(p)
        return p

    def prompt(self, text: str, *, session: str = "default", socket: str | None = None) -> str:
        extra = ["--socket", socket] if socket else []
        cp = self.run(*extra, "-p", "-s", session, text)
        assert cp.returncode == 0, f"prompt failed ({cp.returncode}): {cp.stderr}"
        return cp.stdout.strip()

    # looking at state ----------------------------------------------------------------------
    def owner_records(self) -> list[Path]:
        return sorted(self.registry.glob("*.owner"))

    def owner(self) -> dict[str, Any]:
        recs = self.owner_records()
        assert len(recs) == 1, f"expected one owner record, found {recs}"
        return dict(json.loads((recs[0] / "owner.json").read_bytes()))

    def state_dir(self) -> Path:
        dirs = sorted((self.home / "daemons").iterdir())
        assert len(dirs) == 1, dirs
        return dirs[0]

    def log_text(self) -> str:
        return "".join(
            p.read_text(errors="replace") for p in (self.home / "daemons").glob("*/daemon.log")
        )

    def descriptors(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_bytes())
                for p in (self.home / "daemons").glob("*/workers/*.json")]

    def hello(self, socket_path: str | None = None, timeout: float = 2.0) -> dict[str, Any] | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(socket_path or self.socket)
            data = b""
            while b"\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    return None
                data += chunk
            return dict(json.loads(data.split(b"\n", 1)[0]))
        except OSError:
            return None
        finally:
            s.close()

    def our_pids(self) -> list[int]:
        me = os.getpid()
        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            if self.marker in _environ_of(pid).split(b"\0") and not _is_zombie(pid):
                pids.append(pid)
        return sorted(pids)

    def fork_templates(self) -> list[int]:
        """Our supervisors' worker fork templates (``--template``, in their supervisor's
        session; the workers they fork lead sessions of their own)."""
        out = []
        for pid in self.our_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    template = f.read().split(b"\0")[-2:-1] == [b"--template"]
                with open(f"/proc/{pid}/stat", "rb") as f:
                    sid = int(f.read().rsplit(b")", 1)[1].split()[3])
            except (OSError, IndexError, ValueError):
                continue
            if template and sid != pid:
                out.append(pid)
        return out

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
                p.communicate(timeout=10)
        for _ in range(3):
            pids = self.our_pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(AssertionError):
                wait_for(lambda: not self.our_pids(), timeout=5, what="our processes to exit")


@contextlib.contextmanager
def daemon_env(*, fresh_machine: bool = False, extra_env: dict[str, str] | None = None
               ) -> Iterator[DaemonEnv]:
    """A private home, registry and socket dir; everything started inside is killed after."""
    root = Path(tempfile.mkdtemp(prefix="ta-", dir="/tmp"))
    env = DaemonEnv(root, fresh_machine=fresh_machine)
    (root / "s").mkdir(mode=0o700)
    (root / "userhome").mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRIO_AGENTD_", "XDG_"))}
    base["HOME"] = str(root / "userhome")
    base["TA_TEST_RUN"] = str(root)  # the marker every process we start inherits
    # a private runtime dir: ps/doctor discovery scans the default socket dir
    base["XDG_RUNTIME_DIR"] = str(root / "run")
    (root / "run").mkdir(mode=0o700)
    if fresh_machine:
        # nothing but HOME and XDG dirs: the per-user defaults pick every path
        base["XDG_STATE_HOME"] = str(root / "userhome" / ".local" / "state")
    else:
        base["TRIO_AGENTD_HOME"] = str(env.home)
        base["TRIO_AGENTD_REGISTRY_DIR"] = str(env.registry)
        base["TRIO_AGENTD_SOCKET"] = env.socket
    base.update(extra_env or {})
    env.env = base
    try:
        yield env
    finally:
        env.kill_all()
        shutil.rmtree(root, ignore_errors=True)


def failure_status(cp: subprocess.CompletedProcess[Any]) -> int:
    """The exit status the CLI gives when trio-agentd itself fails: 125 for a prompt (never
    confused with an agent's own status), 1 for every other command."""
    from trio_agentd.cli import EXIT_FAIL, EXIT_OWN

    return EXIT_OWN if "-p" in cp.args or "prompt" in cp.args else EXIT_FAIL
