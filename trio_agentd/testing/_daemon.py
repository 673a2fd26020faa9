"""Real daemons in private temp dirs, and cleanup that kills exactly what a test started.

Every process a test starts (the CLI, autostarted supervisors, their workers) inherits a unique
``TA_TEST_RUN`` marker in its environment; :meth:`DaemonEnv.our_pids` finds them by that marker
in ``/proc/<pid>/environ`` — by pid, never by name — and teardown SIGKILLs them.

This module imports no trio and none of trio-agentd's daemon code (its /proc reads are the
package's own, ``_identity``'s): the CLI runs in subprocesses, and
:meth:`DaemonEnv.open_client` imports the client when it is called.
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
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._identity import is_zombie, proc_cmdline, proc_environ, proc_stat_fields
from ..timing import TEST_CLI_TIMEOUT, TEST_KILL_CONFIRM_TIMEOUT, TEST_SHUTDOWN_TIMEOUT

if TYPE_CHECKING:
    from .._client import Client
    from ..timing import Timing

T = TypeVar("T")

# the environment variable whose value marks every process a DaemonEnv started
MARKER_VARIABLE = "TA_TEST_RUN"
# sockaddr_un.sun_path, less its NUL; the longest socket a daemon binds (a worker's) in the
# socket dir is this name's length
_SUN_PATH_MAX = 107
_WORKER_SOCKET_NAME = "w-01234567-0123456789.sock"


def wait_for(
    predicate: Callable[[], T], *, timeout: float, interval: float = 0.01, what: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns a truthy value, and return that value.

    For waiting on real processes and files (a sleep would guess; this waits for the event
    itself, with a deadline).

    Raises:
        AssertionError: ``timeout`` seconds passed first (the message names ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def fits_socket_dir(path: Path) -> bool:
    """Whether a :class:`DaemonEnv` rooted at ``path`` has room for its sockets: a worker's
    socket path in ``path/s`` must fit ``sun_path`` (107 bytes)."""
    worker_socket = os.path.join(os.path.abspath(path), "s", _WORKER_SOCKET_NAME)
    return len(os.fsencode(worker_socket)) <= _SUN_PATH_MAX


@dataclass
class DaemonEnv:
    """A private trio-agentd installation's paths, and the processes started in it.

    Made by :func:`daemon_env` (or the ``agentd_daemon`` pytest fixture). No daemon runs until
    something asks for one: the first command (``run("-p", ...)``, :meth:`prompt`,
    :meth:`open_client`) autostarts the supervisor on :attr:`socket`, serving :attr:`home`.

    Attributes:
        root: the dir everything lives in.
        env: the environment for processes the test starts (:meth:`run`, :meth:`popen`):
            the test's own, less every ``TRIO_AGENTD_*`` and ``XDG_*`` variable, plus
            ``HOME``, ``XDG_RUNTIME_DIR``, ``TMPDIR`` (so a fork template's rehearsal
            scratch stays inside :attr:`root`) and the paths here, and the ``TA_TEST_RUN``
            marker.
        fresh_machine: paths come from ``HOME`` and ``XDG_*`` alone (the per-user defaults),
            not from ``TRIO_AGENTD_*`` variables.
        procs: the CLI processes :meth:`popen` started.
    """

    root: Path
    env: dict[str, str] = field(default_factory=dict)
    fresh_machine: bool = False
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def home(self) -> Path:
        """The daemon's home (state dirs, sessions, logs)."""
        if self.fresh_machine:
            return self.root / "userhome" / ".local" / "state" / "trio-agentd"
        return self.root / "home"

    @property
    def registry(self) -> Path:
        """The owner-record registry dir."""
        if self.fresh_machine:
            return self.home / "supervisor-owners"
        return self.root / "reg"

    @property
    def socket(self) -> str:
        """The supervisor's socket (its dir is private to the test)."""
        if self.fresh_machine:
            return str(self.root / "run" / "trio-agentd" / "daemon.sock")
        return str(self.root / "s" / "d.sock")

    def socket_at(self, name: str) -> str:
        """Another socket path in the private socket dir (for a second supervisor)."""
        return str(self.root / "s" / name)

    @property
    def marker(self) -> bytes:
        """The ``TA_TEST_RUN=...`` entry every process started here has in its environment."""
        return f"{MARKER_VARIABLE}={self.root}".encode()

    # running the CLI ----------------------------------------------------------------------
    def argv(self, *args: str) -> list[str]:
        """``python -m trio_agentd ARGS`` with this interpreter."""
        return [sys.executable, "-m", "trio_agentd", *args]

    def run(self, *args: str, timeout: float = TEST_CLI_TIMEOUT,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run the CLI (``trio-agentd ARGS``) against this daemon and wait for it: the sync
        client. Its output is captured as text; a first command autostarts the supervisor.

        Raises:
            subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds
                (:data:`trio_agentd.timing.TEST_CLI_TIMEOUT` by default).
        """
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
        """``trio-agentd -p -s SESSION TEXT``: the reply, stripped.

        Raises:
            AssertionError: the CLI failed (its exit status and stderr in the message).
        """
        extra = ["--socket", socket] if socket else []
        cp = self.run(*extra, "-p", "-s", session, text)
        assert cp.returncode == 0, f"prompt failed ({cp.returncode}): {cp.stderr}"
        return cp.stdout.strip()

    @contextlib.asynccontextmanager
    async def open_client(
        self, *, autostart: bool = True, timing: Timing | None = None
    ) -> AsyncIterator[Client]:
        """``trio_agentd.open_client`` bound to this daemon's socket, home and registry: the
        async client (autostarting the supervisor unless ``autostart=False``).

        A supervisor it autostarts inherits this process's environment: it carries the
        marker (and so is killed at teardown) only if ``TA_TEST_RUN`` is set here, as the
        ``agentd_daemon`` fixture does.
        """
        from .._client import open_client
        from ..timing import DEFAULT_TIMING

        async with open_client(
            self.socket, home=str(self.home), registry=str(self.registry), autostart=autostart,
            timing=timing or DEFAULT_TIMING,
        ) as client:
            yield client

    # looking at state ----------------------------------------------------------------------
    def owner_records(self) -> list[Path]:
        """The owner records in the registry (one per live supervisor)."""
        return sorted(self.registry.glob("*.owner"))

    def owner(self) -> dict[str, Any]:
        """The one supervisor's owner record (asserts there is exactly one)."""
        recs = self.owner_records()
        assert len(recs) == 1, f"expected one owner record, found {recs}"
        return dict(json.loads((recs[0] / "owner.json").read_bytes()))

    def state_dir(self) -> Path:
        """The one daemon's state dir under the home (asserts there is exactly one)."""
        dirs = sorted((self.home / "daemons").iterdir())
        assert len(dirs) == 1, dirs
        return dirs[0]

    def log_text(self) -> str:
        """Every daemon log under the home, concatenated."""
        return "".join(
            p.read_text(errors="replace") for p in (self.home / "daemons").glob("*/daemon.log")
        )

    def descriptors(self) -> list[dict[str, Any]]:
        """Every worker descriptor (one per session the daemon knows)."""
        return [json.loads(p.read_bytes())
                for p in (self.home / "daemons").glob("*/workers/*.json")]

    def hello(self, socket_path: str | None = None, timeout: float = 2.0) -> dict[str, Any] | None:
        """The hello of the supervisor on the socket, or None if none answers."""
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
        """The live processes (not this one) that carry this env's marker, by pid."""
        me = os.getpid()
        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            if self.marker in proc_environ(pid) and not is_zombie(pid):
                pids.append(pid)
        return sorted(pids)

    def _forked_by_templates(self) -> list[tuple[int, bool]]:
        """Our processes that run a template's command line (``... --template``): the
        templates and the workers they forked, each with whether it was forked by a template.

        A forked worker leads its own session, but only once it has called ``setsid``: one
        forked a moment ago is still in the template's session. Its parent tells (a template's
        parent is its supervisor; a worker whose template died leads its session by then)."""
        rows = []
        for pid in self.our_pids():
            argv, fields = proc_cmdline(pid), proc_stat_fields(pid)
            try:
                if argv is None or argv[-1:] != [b"--template"] or fields is None:
                    continue
                # fields after comm: 1 the parent, 3 the session
                rows.append((pid, int(fields[1]), int(fields[3]) == pid))
            except (IndexError, ValueError):
                continue
        runs_template = {pid for pid, _parent, _leader in rows}
        return [(pid, leader or parent in runs_template) for pid, parent, leader in rows]

    def fork_templates(self) -> list[int]:
        """Our supervisors' worker fork templates (``--template``, in their supervisor's
        session; the workers they fork lead sessions of their own)."""
        return [pid for pid, forked in self._forked_by_templates() if not forked]

    def spare_workers(self) -> list[int]:
        """Our supervisors' spare workers: forked by a template (its command line, and a
        template its parent or a session of its own), and named by no worker descriptor
        (parked, no session yet; or forked a moment ago). Read while nothing starts: a spare
        being handed a session is in between."""
        workers = {d.get("pid") for d in self.descriptors()}
        return [pid for pid, forked in self._forked_by_templates()
                if forked and pid not in workers]

    def shutdown(self, timeout: float = TEST_SHUTDOWN_TIMEOUT) -> None:
        """``trio-agentd shutdown`` if a supervisor answers on :attr:`socket`: it stops its
        workers and exits, removing its socket and owner record. Nothing else is touched;
        :meth:`kill_all` removes whatever is left."""
        if self.hello() is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.run("shutdown", timeout=timeout)

    def kill_all(self) -> None:
        """SIGKILL every process this env started (the :meth:`popen` ones, then every pid that
        carries the marker), and wait until they are gone."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
                p.communicate(timeout=TEST_KILL_CONFIRM_TIMEOUT)
        for _ in range(3):
            pids = self.our_pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(AssertionError):
                wait_for(lambda: not self.our_pids(), timeout=TEST_KILL_CONFIRM_TIMEOUT,
                         what="our processes to exit")


@contextlib.contextmanager
def daemon_env(
    *,
    root: Path | None = None,
    fresh_machine: bool = False,
    extra_env: dict[str, str] | None = None,
    shutdown: bool = False,
) -> Iterator[DaemonEnv]:
    """A private home, registry and socket dir; everything started inside is killed after.

    Args:
        root: the dir to use (it must exist, be private and short enough for the sockets:
            :func:`fits_socket_dir`); it is left in place. Default: a new dir under ``/tmp``,
            removed after.
        fresh_machine: see :attr:`DaemonEnv.fresh_machine`.
        extra_env: more variables for the processes started.
        shutdown: at exit, ``trio-agentd shutdown`` first (:meth:`DaemonEnv.shutdown`), then
            kill what is left; else kill at once.
    """
    made = root is None
    root = Path(tempfile.mkdtemp(prefix="ta-", dir="/tmp")) if root is None else Path(root)
    env = DaemonEnv(root, fresh_machine=fresh_machine)
    (root / "s").mkdir(mode=0o700)
    (root / "userhome").mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRIO_AGENTD_", "XDG_"))}
    base["HOME"] = str(root / "userhome")
    base[MARKER_VARIABLE] = str(root)  # the marker every process we start inherits
    # a private runtime dir: ps/doctor discovery scans the default socket dir
    base["XDG_RUNTIME_DIR"] = str(root / "run")
    (root / "run").mkdir(mode=0o700)
    # temporary files (a fork template's rehearsal scratch, which a kill at teardown would
    # leave behind) inside the env too: removed with it
    base["TMPDIR"] = str(root / "tmp")
    (root / "tmp").mkdir(mode=0o700)
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
        try:
            if shutdown:
                env.shutdown()
        finally:
            env.kill_all()
            if made:
                shutil.rmtree(root, ignore_errors=True)
