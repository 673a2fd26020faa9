"""Peers in the same run: supervisord, circus and pm2, measured on the figures that apply.

Each peer is installed privately under ``.bench/`` (supervisord and circus into a venv, pm2 with
npm into a prefix; cached, so a second call is fast) and run with private config, sockets and
state in a temp dir, hosting N "session" programs (``peers_programs/session.py``: an idle
Python process). Everything a run starts is killed by pid at the end, even on failure or Ctrl-C:
the daemons' pids (from their pidfiles) and every program pid seen in their status output or
process table, plus anything whose command line or environment names the run's temp dir.

Figures, per peer (``run()`` returns them as data, ``main()`` prints a table):

- ``status_cmd_ms``: whole-process time of the status command, daemon running with 10 programs,
  interleaved with ``python -c pass`` (one round = every peer and the baseline, in rotating
  order); median/min/max and the ratio of medians.
- ``daemon_kill9_survival``: 10 programs, ``kill -9`` of the peer daemon, then start the peer
  again as its documentation says; counts of programs alive after the kill, adopted (same pid
  shown running), duplicated (a new copy shown while the old one still runs), lost (nothing
  shown running).
- ``child_restart_ms``: ``kill -9`` of one program; time until a new process of that program
  (a new pid, exec'd) is a child of the daemon, read from ``/proc/<daemon>/task/*/children``;
  the peer's status must then show the new pid as running (``confirmed``). Repetitions are
  interleaved across peers and rotate over the programs, so no restart backoff kicks in.
- ``idle_cpu_pct``: 100 idle programs per peer, all peers idle in the same 30 s window; CPU of
  the daemon plus all its descendants as % of one core (utime+stime deltas).
- ``memory_mb``: daemon RSS and PSS with 100 programs; per-program RSS and PSS.

Restart settings are each peer's minimum (named in the results). circus has no SIGCHLD handler:
it finds dead processes by polling every ``check_delay`` (default 5 s), so it runs with
``check_delay=0.1`` and, for honesty about that trade, a second circus at its default is measured
too (``child_restart_ms_default_check_delay``, ``idle_cpu_pct_default_check_delay``).

Usage: ``python -m benchmarks.peers [--quick] [--json]``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / ".bench"
VENV = BENCH / "peers-venv"
NPM_PREFIX = BENCH / "npm"
SESSION_PY = Path(__file__).resolve().parent / "peers_programs" / "session.py"

SUPERVISOR_PIN = "4.3.0"
CIRCUS_PINS = ("0.19.0", "0.18.0", "0.17.2")  # newest first; older ones only if it fails
PM2_PIN = "7.0.4"

MARKER = "PEERS_BENCH_RUN"
PEERS = ("supervisord", "circus", "pm2")
FIGURES = ("status_cmd_ms", "daemon_kill9_survival", "child_restart_ms", "idle_cpu_pct",
           "memory_mb", "lifecycle_ms")
CIRCUS_CHECK_DELAY = 0.1  # s; circus's own default is 5 s (measured too, see _DEFAULT below)
_DEFAULT = "_default_check_delay"

Result = dict[str, Any]


# --------------------------------------------------------------------------------------------
# installation


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _stamp_ok(stamp: Path, want: dict[str, str]) -> bool:
    try:
        return bool(json.loads(stamp.read_text()) == want)
    except (OSError, ValueError):
        return False


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "--disable-pip-version-check",
                           *args], capture_output=True, text=True, timeout=600)


def _bin_version(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(_tail(out.stdout + out.stderr))
    return out.stdout.strip() or out.stderr.strip()


def _install_python_peer(name: str, pins: tuple[str, ...], check: list[str]) -> Result:
    """pip-install ``name`` into the peers venv (first pin that installs and runs); cached."""
    stamp = VENV / f".installed-{name}.json"
    for pin in pins:
        want = {"pin": pin, "python": sys.version.split()[0]}
        if _stamp_ok(stamp, want) and (VENV / "bin" / check[0]).exists():
            return {"version": pin, "cached": True}
    errors = []
    for pin in pins:
        out = _pip("install", "--quiet", f"{name}=={pin}")
        if out.returncode != 0:
            errors.append(f"{name}=={pin}: pip failed: {_tail(out.stderr)}")
            continue
        try:
            _bin_version([str(VENV / "bin" / check[0]), *check[1:]])
        except (RuntimeError, OSError) as exc:
            errors.append(f"{name}=={pin}: installed but does not run: {exc}")
            continue
        # users' pip writes bytecode; PYTHONDONTWRITEBYTECODE here must not make peers look slow
        subprocess.run([str(VENV / "bin" / "python"), "-m", "compileall", "-q",
                        str(_site_packages())], capture_output=True, timeout=600)
        stamp.write_text(json.dumps({"pin": pin, "python": sys.version.split()[0]}))
        return {"version": pin, "cached": False, "tried": errors}
    return {"error": "; ".join(errors)}


def _site_packages() -> Path:
    return next((VENV / "lib").glob("python3*/site-packages"))


def install() -> dict[str, Result]:
    """Install the peers under ``.bench/`` (idempotent, cached); per peer its version or error."""
    BENCH.mkdir(exist_ok=True)
    with open(BENCH / "install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once must not pip into one venv
        return _install()


def _install() -> dict[str, Result]:
    out: dict[str, Result] = {}
    t0 = time.perf_counter()
    venv_error = None
    if not (VENV / "bin" / "python").exists():
        made = subprocess.run([sys.executable, "-m", "venv", str(VENV)], capture_output=True,
                              text=True, timeout=300)
        if made.returncode != 0:
            venv_error = f"venv failed: {_tail(made.stderr)}"
    if venv_error:
        out["supervisord"] = out["circus"] = {"error": venv_error}
    else:
        out["supervisord"] = _install_python_peer("supervisor", (SUPERVISOR_PIN,),
                                                  ["supervisord", "--version"])
        out["circus"] = _install_python_peer("circus", CIRCUS_PINS, ["circusd", "--version"])
    out["pm2"] = _install_pm2()
    for r in out.values():
        r["install_s"] = round(time.perf_counter() - t0, 2)
    return out


def _install_pm2() -> Result:
    pkg = NPM_PREFIX / "node_modules" / "pm2" / "package.json"

    def installed() -> str | None:
        try:
            return str(json.loads(pkg.read_text())["version"])
        except (OSError, ValueError, KeyError):
            return None

    if installed() == PM2_PIN and (NPM_PREFIX / "node_modules" / ".bin" / "pm2").exists():
        return {"version": PM2_PIN, "cached": True}
    npm = shutil.which("npm")
    if npm is None:
        return {"error": "npm not found on PATH"}
    NPM_PREFIX.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([npm, "install", "--prefix", str(NPM_PREFIX), "--no-audit", "--no-fund",
                          f"pm2@{PM2_PIN}"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or installed() != PM2_PIN:
        return {"error": f"npm install pm2@{PM2_PIN} failed: {_tail(out.stdout + out.stderr)}"}
    return {"version": PM2_PIN, "cached": False}


# --------------------------------------------------------------------------------------------
# processes: identity, exact kills


def _ident(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(pid: int, ctime: float | None) -> bool:
    """The process ``pid`` started at ``ctime`` still runs (a zombie does not)."""
    try:
        p = psutil.Process(pid)
        return (ctime is None or p.create_time() == ctime) and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _wait_gone(pid: int, ctime: float | None, timeout: float) -> bool:
    """Reap ``pid`` (if it is our child) until it is gone; a multi-threaded process killed with
    SIGKILL stays a zombie until its last thread exits, and its pid is not free before then."""
    deadline = time.monotonic() + timeout
    while True:
        _reap(pid)
        try:
            if ctime is not None and psutil.Process(pid).create_time() != ctime:
                return True
        except psutil.Error:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (cheap: no scan of the process table)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


class Tracker:
    """Everything one run started, by pid and start time; ``kill_all`` kills exactly those."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[int, float | None] = {}
        self.daemons: set[int] = set()
        # children we had before the run are someone else's to wait for; never reap those
        self.preexisting = set(_children(os.getpid()))

    def reap_strays(self) -> None:
        """Reap zombies the peers' daemonizing left with us (we are their subreaper)."""
        for pid in _children(os.getpid()):
            if pid not in self.preexisting:
                with contextlib.suppress(psutil.Error):
                    if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        _reap(pid)

    def note(self, pid: int, daemon: bool = False) -> None:
        if pid not in self.procs or not _alive(pid, self.procs[pid]):
            self.procs[pid] = _ident(pid)
        if daemon:
            self.daemons.add(pid)

    def scan(self) -> None:
        """Note every process whose command line or environment names this run's temp dir."""
        needle = str(self.root)
        marker = f"{MARKER}={self.root}".encode()
        me = os.getpid()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            if any(needle in a for a in _cmdline(pid)):
                self.note(pid)
                continue
            with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    self.note(pid)

    def kill_all(self) -> int:
        """SIGKILL daemons first (so nothing respawns), then everything else; reap our own."""
        self.scan()
        hit = 0
        for group in (sorted(self.daemons), sorted(set(self.procs) - self.daemons)):
            for pid in group:
                if _alive(pid, self.procs.get(pid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        hit += 1
            self.scan()
        deadline = time.monotonic() + 5
        for pid, ctime in self.procs.items():
            _wait_gone(pid, ctime, max(0.0, deadline - time.monotonic()))
        self.reap_strays()
        return hit


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """Make this process the child subreaper for the body (Linux).

    The peers daemonize; their orphans would go to pid 1, which here reaps late, and a zombie
    under a stale pidfile makes circusd refuse to start ("pid file is stale"). As subreaper we
    reap exactly the pids we killed, at once, as init does on an ordinary machine.
    """
    libc: Any = None
    before = ctypes.c_int(0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(37, ctypes.byref(before), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        libc = None
    try:
        yield
    finally:
        if libc is not None:
            libc.prctl(36, before.value, 0, 0, 0)


# --------------------------------------------------------------------------------------------
# the peers


class Peer:
    """One peer daemon in a private dir, hosting programs ``s0 … s<n-1>``."""

    name = ""
    settings = ""

    def __init__(self, root: Path, n: int, tracker: Tracker, name: str = "") -> None:
        self.name = name or self.name
        self.root = root
        self.n = n
        self.tracker = tracker
        self.names = [f"s{i}" for i in range(n)]
        root.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PM2_")}
        self.env[MARKER] = str(tracker.root)
        self.py = str(VENV / "bin" / "python")

    # -- per peer
    def write_config(self) -> None:
        raise NotImplementedError

    def start_argv(self) -> list[str]:
        raise NotImplementedError

    def pidfile(self) -> Path:
        raise NotImplementedError

    def status_argv(self) -> list[str]:
        raise NotImplementedError

    def shown(self) -> dict[str, int]:
        """Program name → pid that the peer's status output shows as running."""
        raise NotImplementedError

    def log_file(self) -> Path:
        raise NotImplementedError

    def stop_argv(self) -> list[str]:
        """The peer's clean stop of its daemon and every program."""
        raise NotImplementedError

    def before_kill9(self) -> None:
        """What a careful user does so the peer can recover its programs (nothing by default)."""

    def restart_after_kill9(self) -> dict[str, Any]:
        """Start the peer again after its daemon was killed; extra facts for the result."""
        self._cli(self.start_argv())
        return {"how": "started again with the same config: " + " ".join(self._short(
            self.start_argv()))}

    # -- shared
    def program_argv(self, name: str) -> list[str]:
        return [self.py, str(SESSION_PY), str(self.tracker.root), name]

    def _short(self, argv: list[str]) -> list[str]:
        return [Path(a).name if a.startswith("/") else a for a in argv]

    def _cli(self, argv: list[str], timeout: float = 120) -> str:
        """Run a peer command that may start a daemon: output to a file, never a pipe it keeps."""
        log = self.root / "cli.log"
        with open(log, "ab") as f:
            f.write(f"$ {' '.join(argv)}\n".encode())
            f.flush()
            out = subprocess.run(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=f,
                                 stderr=subprocess.STDOUT, timeout=timeout)
        self.tracker.reap_strays()
        self.note_daemon()
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(self._short(argv))} exited {out.returncode}: "
                               f"{self.log_tail(log)}")
        return log.read_text(errors="replace")

    def status_output(self, timeout: float = 60) -> str:
        out = subprocess.run(self.status_argv(), env=self.env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=timeout)
        return out.stdout

    def log_tail(self, path: Path | None = None) -> str:
        try:
            return _tail((path or self.log_file()).read_text(errors="replace"), 6)
        except OSError as exc:
            return f"(no log: {exc})"

    def daemon_pid(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError):
                pid = int(self.pidfile().read_text().strip())
                if _alive(pid, None):
                    self.tracker.note(pid, daemon=True)
                    return pid
            if time.monotonic() > deadline:
                try:
                    content = self.pidfile().read_text().strip()
                except OSError as exc:
                    content = str(exc)
                raise RuntimeError(f"{self.name}: no live daemon pid in {self.pidfile().name} "
                                   f"({content!r}); cli: {self.log_tail(self.root / 'cli.log')}"
                                   f"; log: {self.log_tail()}")
            time.sleep(0.05)

    def note_daemon(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pidfile().read_text().strip())
            if _alive(pid, None):
                self.tracker.note(pid, daemon=True)

    def start(self, timeout: float = 120, poll: float = 0.2) -> dict[str, int]:
        self.write_config()
        self._cli(self.start_argv())
        self.daemon_pid()
        return self.wait_running(timeout, poll)

    def wait_running(self, timeout: float, poll: float = 0.2) -> dict[str, int]:
        """Until the status shows every program running with a live pid."""
        deadline = time.monotonic() + timeout
        shown: dict[str, int] = {}
        while True:
            shown = self.shown()
            for pid in shown.values():
                self.tracker.note(pid)
            if len(shown) == self.n and all(_alive(p, None) for p in shown.values()):
                return shown
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: {len(shown)}/{self.n} programs running after "
                                   f"{timeout:.0f} s; log: {self.log_tail()}")
            time.sleep(poll)

    def program_pids(self) -> dict[str, int]:
        """Program name → pid of the daemon's live child running it (from /proc)."""
        out = {}
        for pid in _children(self.daemon_pid()):
            argv = _cmdline(pid)
            if argv[-2:-1] == [str(self.tracker.root)]:
                out[argv[-1]] = pid
        return out


class Supervisord(Peer):
    name = "supervisord"
    settings = ("startsecs=0, autorestart=true (no restart delay setting exists; supervisord "
                "respawns on its next main-loop tick, poll timeout 1 s in its source)")

    @property
    def conf(self) -> Path:
        return self.root / "supervisord.conf"

    def write_config(self) -> None:
        r = self.root
        lines = [
            "[unix_http_server]", f"file={r}/supervisor.sock", "chmod=0700",
            "[supervisord]", f"logfile={r}/supervisord.log", f"pidfile={r}/supervisord.pid",
            f"childlogdir={r}", "nodaemon=false", f"directory={r}",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
            "[supervisorctl]", f"serverurl=unix://{r}/supervisor.sock",
        ]
        for name in self.names:
            lines += [f"[program:{name}]", "command=" + " ".join(self.program_argv(name)),
                      "startsecs=0", "autorestart=true", "autostart=true"]
        self.conf.write_text("\n".join(lines) + "\n")

    def start_argv(self) -> list[str]:
        return [str(VENV / "bin" / "supervisord"), "-c", str(self.conf)]

    def pidfile(self) -> Path:
        return self.root / "supervisord.pid"

    def log_file(self) -> Path:
        return self.root / "supervisord.log"

    def status_argv(self) -> list[str]:
        return [str(VENV / "bin" / "supervisorctl"), "-c", str(self.conf), "status"]

    def stop_argv(self) -> list[str]:
        return [str(VENV / "bin" / "supervisorctl"), "-c", str(self.conf), "shutdown"]

    def shown(self) -> dict[str, int]:
        out = {}
        for line in self.status_output().splitlines():
            parts = line.replace(",", " ").split()
            if len(parts) >= 4 and parts[1] == "RUNNING" and parts[2] == "pid":
                out[parts[0]] = int(parts[3])
        return out


class Circus(Peer):
    name = "circus"

    def __init__(self, root: Path, n: int, tracker: Tracker, name: str = "",
                 check_delay: float | None = CIRCUS_CHECK_DELAY) -> None:
        super().__init__(root, n, tracker, name)
        self.check_delay = check_delay
        self.settings = (
            f"check_delay={check_delay} s (circus has no SIGCHLD handler: it polls for dead "
            "processes every check_delay; its default is 5 s), respawn=true, warmup_delay=0"
            if check_delay is not None else "check_delay unset (circus default, 5 s)")

    @property
    def ini(self) -> Path:
        return self.root / "circus.ini"

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.root}/ctrl.sock"

    def write_config(self) -> None:
        r = self.root
        lines = ["[circus]", f"endpoint = {self.endpoint}",
                 f"pubsub_endpoint = ipc://{r}/pub.sock",
                 # off: the default joins a multicast group on every interface
                 "multicast_endpoint = ",
                 "statsd = false", "httpd = false",
                 f"pidfile = {r}/circusd.pid", f"logoutput = {r}/circusd.log"]
        if self.check_delay is not None:
            lines.append(f"check_delay = {self.check_delay}")
        for name in self.names:
            lines += [f"[watcher:{name}]", "cmd = " + " ".join(self.program_argv(name)),
                      "numprocesses = 1", "respawn = true", "warmup_delay = 0"]
        self.ini.write_text("\n".join(lines) + "\n")

    def start_argv(self) -> list[str]:
        return [str(VENV / "bin" / "circusd"), "--daemon", str(self.ini)]

    def pidfile(self) -> Path:
        return self.root / "circusd.pid"

    def log_file(self) -> Path:
        return self.root / "circusd.log"

    def status_argv(self) -> list[str]:
        return [str(VENV / "bin" / "circusctl"), "--endpoint", self.endpoint, "status"]

    def stop_argv(self) -> list[str]:
        return [str(VENV / "bin" / "circusctl"), "--endpoint", self.endpoint, "quit"]

    def shown(self) -> dict[str, int]:
        out = subprocess.run([str(VENV / "bin" / "circusctl"), "--endpoint", self.endpoint,
                              "--json", "stats"], env=self.env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=60)
        try:
            infos = json.loads(out.stdout)["infos"]
        except (ValueError, KeyError):
            return {}
        shown = {}
        for watcher, procs in infos.items():
            if watcher in self.names and isinstance(procs, dict):
                pids = [int(p) for p in procs if str(p).isdigit()]
                if len(pids) == 1:
                    shown[watcher] = pids[0]
        return shown


class Pm2(Peer):
    name = "pm2"
    settings = ("restart_delay=0 (its minimum and default; no exp_backoff_restart_delay), "
                "autorestart=true, max_restarts=1000000")

    def __init__(self, root: Path, n: int, tracker: Tracker) -> None:
        super().__init__(root, n, tracker)
        self.env["PM2_HOME"] = str(root / "pm2home")
        self.pm2 = str(NPM_PREFIX / "node_modules" / ".bin" / "pm2")

    def write_config(self) -> None:
        apps = [{"name": name, "script": str(SESSION_PY), "interpreter": self.py,
                 "args": [str(self.tracker.root), name], "exec_mode": "fork",
                 "autorestart": True, "restart_delay": 0, "max_restarts": 1000000}
                for name in self.names]
        (self.root / "ecosystem.json").write_text(json.dumps({"apps": apps}))

    def start_argv(self) -> list[str]:
        return [self.pm2, "start", str(self.root / "ecosystem.json")]

    def pidfile(self) -> Path:
        return self.root / "pm2home" / "pm2.pid"

    def log_file(self) -> Path:
        return self.root / "pm2home" / "pm2.log"

    def status_argv(self) -> list[str]:
        return [self.pm2, "jlist"]

    def stop_argv(self) -> list[str]:
        return [self.pm2, "kill"]

    def shown(self) -> dict[str, int]:
        text = self.status_output()
        self.note_daemon()
        try:
            apps = json.loads(text[text.index("["):])
        except ValueError:
            return {}
        return {a["name"]: int(a["pid"]) for a in apps
                if a.get("pm2_env", {}).get("status") == "online" and a.get("pid")}

    def before_kill9(self) -> None:
        self._cli([self.pm2, "save"])

    def restart_after_kill9(self) -> dict[str, Any]:
        # a plain start of the daemon first (any pm2 command does that) to see what it knows
        plain = self.shown()
        self._cli([self.pm2, "resurrect"])
        return {"how": "pm2 save before the kill; after it, pm2 jlist (daemon autostarts) then "
                       "pm2 resurrect",
                "shown_by_plain_restart": len(plain)}


def _make(name: str, root: Path, n: int, tracker: Tracker) -> Peer:
    if name == "supervisord":
        return Supervisord(root / name, n, tracker)
    if name == "circus":
        return Circus(root / name, n, tracker)
    if name == "circus" + _DEFAULT:
        return Circus(root / name, n, tracker, name, check_delay=None)
    if name == "pm2":
        return Pm2(root / name, n, tracker)
    raise ValueError(name)


# --------------------------------------------------------------------------------------------
# figures


def _stats(samples: list[float], scale: float = 1000.0) -> dict[str, float]:
    return {"median": round(statistics.median(samples) * scale, 2),
            "min": round(min(samples) * scale, 2), "max": round(max(samples) * scale, 2),
            "n": len(samples)}


def _err(exc: BaseException) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}"}


def status_cmd_ms(peers: list[Peer], rounds: int) -> dict[str, Result]:
    """Status command vs ``python -c pass``, interleaved; ratio of medians. Whole processes,
    by a blocking wait (:func:`._common.run_timed`)."""
    from ._common import run_timed

    base_argv = [sys.executable, "-c", "pass"]
    slots: list[Peer | None] = [None, *peers]
    samples: dict[str, list[float]] = {p.name: [] for p in peers}
    base: list[float] = []
    failed: dict[str, str] = {}
    for i in range(rounds + 1):  # round 0 warms caches and is not counted
        k = i % len(slots)
        for slot in slots[k:] + slots[:k]:
            if slot is None:
                dt, rc = run_timed(base_argv, env=dict(os.environ))
                if i:
                    base.append(dt)
                continue
            dt, rc = run_timed(slot.status_argv(), env=slot.env)
            if rc != 0:
                failed[slot.name] = f"exit {rc}: {' '.join(slot._short(slot.status_argv()))}"
            elif i:
                samples[slot.name].append(dt)
    out: dict[str, Result] = {}
    b = _stats(base)
    for p in peers:
        if p.name in failed or not samples[p.name]:
            out[p.name] = {"error": failed.get(p.name, "no samples")}
            continue
        s: Result = dict(_stats(samples[p.name]))
        s["ratio_to_python_c_pass"] = round(s["median"] / b["median"], 2)
        s["python_c_pass_median"] = b["median"]
        s["command"] = " ".join(p._short(p.status_argv()))
        s["programs"] = p.n
        out[p.name] = s
    return out


def _restart_once(peer: Peer, name: str, timeout: float = 30) -> tuple[float, bool]:
    daemon = peer.daemon_pid()
    root = str(peer.tracker.root)
    before = peer.program_pids()
    old = before[name]
    os.kill(old, signal.SIGKILL)
    t0 = time.perf_counter()
    new = None
    while new is None:
        for pid in _children(daemon):
            if pid != old and pid not in before.values():
                argv = _cmdline(pid)
                if argv[-2:] == [root, name]:
                    new = pid
                    break
        else:
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"{peer.name}: no new {name} within {timeout} s")
            time.sleep(0.002)
    dt = time.perf_counter() - t0
    peer.tracker.note(new)
    _reap(old)
    deadline = time.monotonic() + 15
    confirmed = False
    while time.monotonic() < deadline and not confirmed:
        confirmed = peer.shown().get(name) == new
        if not confirmed:
            time.sleep(0.05)
    return dt, confirmed


def child_restart_ms(peers: list[Peer], reps: dict[str, int]) -> dict[str, Result]:
    """kill -9 one program → a new process of it; interleaved across peers, rotating programs."""
    samples: dict[str, list[float]] = {p.name: [] for p in peers}
    confirmed: dict[str, int] = {p.name: 0 for p in peers}
    failed: dict[str, str] = {}
    for i in range(max(reps.values())):
        for p in peers:
            if p.name in failed or i >= reps[p.name]:
                continue
            try:
                dt, ok = _restart_once(p, p.names[i % p.n])
            except Exception as exc:
                failed[p.name] = f"{type(exc).__name__}: {exc}"
                continue
            samples[p.name].append(dt)
            confirmed[p.name] += ok
    out: dict[str, Result] = {}
    for p in peers:
        if p.name in failed:
            out[p.name] = {"error": failed[p.name], "done": len(samples[p.name])}
            continue
        s: Result = dict(_stats(samples[p.name]))
        s["confirmed_by_status"] = confirmed[p.name]
        s["setting"] = p.settings
        out[p.name] = s
    return out


def daemon_kill9_survival(peer: Peer) -> Result:
    """kill -9 the daemon with its programs running; start it again; what became of them."""
    shown = peer.wait_running(30)
    old = {name: (pid, _ident(pid)) for name, pid in shown.items()}
    peer.before_kill9()
    daemon = peer.daemon_pid()
    os.kill(daemon, signal.SIGKILL)
    if not _wait_gone(daemon, peer.tracker.procs.get(daemon), 10):
        raise RuntimeError(f"{peer.name}: daemon {daemon} still there 10 s after SIGKILL")
    time.sleep(0.5)
    alive_after = sum(_alive(pid, ct) for pid, ct in old.values())
    extra = peer.restart_after_kill9()
    peer.daemon_pid()
    settle = time.monotonic() + 10  # give it time to show everything it will show
    after: dict[str, int] = {}
    while time.monotonic() < settle:
        after = peer.shown()
        if len(after) == peer.n:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    after = peer.shown()
    for pid in after.values():
        peer.tracker.note(pid)
    counts = {"adopted": 0, "duplicated": 0, "respawned": 0, "lost": 0}
    for name, (pid, ct) in old.items():
        now = after.get(name)
        if now is None:
            counts["lost"] += 1
        elif now == pid:
            counts["adopted"] += 1
        elif _alive(pid, ct):
            counts["duplicated"] += 1
        else:
            counts["respawned"] += 1
    orphans = sum(_alive(pid, ct) and after.get(name) != pid for name, (pid, ct) in old.items())
    return {"programs": len(old), "alive_after_kill": alive_after, **counts,
            "unmanaged_survivors": orphans, **extra}


def _tree(pid: int) -> list[psutil.Process]:
    try:
        d = psutil.Process(pid)
        return [d, *d.children(recursive=True)]
    except psutil.Error:
        return []


def _cpu(procs: list[psutil.Process]) -> dict[tuple[int, float], float]:
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[(p.pid, p.create_time())] = t.user + t.system
    return out


def idle_cpu_pct(peers: list[Peer], window: float) -> dict[str, Result]:
    """All peers idle in the same window: CPU of each daemon + descendants, % of one core."""
    start = {p.name: _cpu(_tree(p.daemon_pid())) for p in peers}
    t0 = time.perf_counter()
    time.sleep(window)
    wall = time.perf_counter() - t0
    out: dict[str, Result] = {}
    for p in peers:
        end = _cpu(_tree(p.daemon_pid()))
        daemon_key = next(iter(end), None)
        used = sum(v - start[p.name].get(k, 0.0) for k, v in end.items())
        daemon_used = (end[daemon_key] - start[p.name].get(daemon_key, 0.0)
                       if daemon_key else 0.0)
        out[p.name] = {"total_pct": round(100 * used / wall, 3), "cpu_s": round(used, 3),
                       "daemon_pct": round(100 * daemon_used / wall, 3),
                       "programs": p.n, "processes": len(end), "window_s": round(wall, 1)}
        if isinstance(p, Circus):
            out[p.name]["setting"] = f"check_delay={p.check_delay or '5 (default)'} s"
    return out


def memory_mb(peer: Peer) -> Result:
    mb = 1024 * 1024
    daemon = psutil.Process(peer.daemon_pid())
    dm = daemon.memory_full_info()
    rss: list[float] = []
    pss: list[float] = []
    for pid in peer.program_pids().values():
        with contextlib.suppress(psutil.Error):
            m = psutil.Process(pid).memory_full_info()
            rss.append(m.rss / mb)
            pss.append(getattr(m, "pss", float("nan")) / mb)
    out: Result = {"daemon_rss": round(dm.rss / mb, 1),
                   "daemon_pss": round(getattr(dm, "pss", float("nan")) / mb, 1),
                   "programs": len(rss)}
    if rss:
        r, s = _stats(rss, 1.0), _stats(pss, 1.0)
        out.update({"program_rss_median": round(r["median"], 1),
                    "program_rss_max": round(r["max"], 1),
                    "program_pss_median": round(s["median"], 1),
                    "program_pss_max": round(s["max"], 1),
                    "total_pss": round(dm.pss / mb + sum(pss), 1)})
    return out


# --------------------------------------------------------------------------------------------
# the run


LIFECYCLE_POLL = 0.02  # s between status commands while waiting for "all running"


def _stop_and_wait(peer: Peer, timeout: float = 120) -> float:
    """Seconds from the peer's clean-stop command to its daemon and every program gone."""
    pids = {peer.daemon_pid(): None, **{p: None for p in peer.program_pids().values()}}
    idents = {pid: _ident(pid) for pid in pids}
    t0 = time.perf_counter()
    subprocess.run(peer.stop_argv(), env=peer.env, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    deadline = time.monotonic() + timeout
    for pid, ctime in idents.items():
        if not _wait_gone(pid, ctime, max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"{peer.name}: pid {pid} still running {timeout:.0f} s after "
                               f"{' '.join(peer._short(peer.stop_argv()))}")
    dt = time.perf_counter() - t0
    peer.tracker.reap_strays()
    return dt


def _start_one(name: str, root: Path, tracker: Tracker) -> float:
    """Start ``name`` with 1 program, until its status first shows it running; then stop it.
    The start's seconds."""
    one = _make(name, root, 1, tracker)
    t0 = time.perf_counter()
    one.start(poll=LIFECYCLE_POLL)
    dt = time.perf_counter() - t0
    _stop_and_wait(one)
    return dt


def lifecycle_ms(name: str, root: Path, tracker: Tracker, n: int, reps: int) -> Result:
    """Startup (no daemon) → 1 program reported running; launch → ``n`` reported running;
    clean stop with ``n`` → daemon and programs gone. The clock of a start runs from the
    start command to the status command that first shows every program running with a live
    pid (status polled every ``LIFECYCLE_POLL`` s)."""
    startup: list[float] = []
    launch: list[float] = []
    stop: list[float] = []
    for i in range(reps):
        startup.append(_start_one(name, root / f"one{i}", tracker))
        many = _make(name, root / f"many{i}", n, tracker)
        t0 = time.perf_counter()
        many.start(poll=LIFECYCLE_POLL)
        launch.append(time.perf_counter() - t0)
        stop.append(_stop_and_wait(many))
        tracker.kill_all()
    return {"startup": _stats(startup), "launch": _stats(launch), "stop": _stats(stop),
            "programs": n, "reps": reps, "status_poll_s": LIFECYCLE_POLL}


def startup_pair(rival: str, root: Path, tracker: Tracker, reps: int) -> Result:
    """Startup of ``rival`` (start command with 1 program until its status first shows it
    running, as in :func:`lifecycle_ms`) interleaved with a cold ``trio-agentd -p hi`` (a
    fresh private environment, no daemon, until the reply is printed): A B A B …, so both
    meet the same machine; the figure is the ratio of the medians."""
    from ._common import private_env, run_timed

    theirs: list[float] = []
    ours: list[float] = []
    for i in range(reps):
        theirs.append(_start_one(rival, root / f"pair{i}", tracker))
        tracker.kill_all()
        with private_env() as env:
            out, err = env.root / "pair.out", env.root / "pair.err"
            with open(out, "wb") as o, open(err, "wb") as e:
                dt, rc = run_timed(env.cli("-p", "hi"), env=env.env, stdout=o, stderr=e,
                                   limit=60)
            if rc != 0 or "hi" not in out.read_text(errors="replace"):
                raise RuntimeError(f"cold trio-agentd -p hi failed ({rc}): "
                                   f"{_tail(err.read_text(errors='replace'))}")
            ours.append(dt)
            env.run("shutdown")
        tracker.reap_strays()  # (our supervisor, orphaned by its CLI, exits as our child)
    return {"rival": rival, "rival_ms": _stats(theirs), "trio_agentd_ms": _stats(ours),
            "ratio_of_medians": statistics.median(ours) / statistics.median(theirs),
            "reps": reps}


def _try(fn: Callable[[], Result]) -> Result:
    try:
        return fn()
    except Exception as exc:
        return _err(exc)


def run(quick: bool = False) -> dict[str, Any]:
    """Install, run and measure every peer; ``{peer: {figure: {numbers or "error"}}}``."""
    small, rounds = 10, (7 if quick else 15)
    big, window = (20, 10.0) if quick else (100, 30.0)
    reps = 10 if quick else 20
    default_reps = 3 if quick else 5

    installed = install()
    results: dict[str, Result] = {name: {"install": installed[name]} for name in PEERS}
    usable = [n for n in PEERS if "error" not in installed[n]]
    for name in PEERS:
        if name not in usable:
            for fig in FIGURES:
                results[name][fig] = {"error": f"not installed: {installed[name]['error']}"}

    root = Path(tempfile.mkdtemp(prefix="peers-", dir="/tmp"))
    tracker = Tracker(root)
    with _subreaper():
        try:
            _phase_small(root / "a", small, rounds, reps, default_reps, usable, tracker,
                         results)
            tracker.kill_all()
            _phase_big(root / "b", big, window, usable, tracker, results)
            tracker.kill_all()
            for name in usable:
                results[name]["lifecycle_ms"] = _try(functools.partial(
                    lifecycle_ms, name, root / "c" / name, tracker, big, 1 if quick else 3))
                tracker.kill_all()
            if "supervisord" in usable:
                results["supervisord"]["startup_pair"] = _try(functools.partial(
                    startup_pair, "supervisord", root / "d", tracker, 5 if quick else 15))
                tracker.kill_all()
        finally:
            tracker.kill_all()
            shutil.rmtree(root, ignore_errors=True)
    return results


def _key(peer_name: str, fig: str) -> tuple[str, str]:
    """Where a figure of (a variant of) a peer goes: ``circus_default_check_delay`` → circus."""
    base = peer_name.removesuffix(_DEFAULT)
    return base, fig + peer_name[len(base):]


def _start_all(names: list[str], root: Path, n: int, tracker: Tracker,
               results: dict[str, Result], figures: tuple[str, ...]) -> list[Peer]:
    peers = []
    for name in names:
        peer = _make(name, root, n, tracker)
        try:
            peer.start()
        except Exception as exc:
            for fig in figures:
                base, key = _key(name, fig)
                results[base].setdefault(key, _err(exc))
            continue
        peers.append(peer)
    return peers


def _store(results: dict[str, Result], fig: str, peers: list[Peer],
           fn: Callable[[], dict[str, Result]]) -> None:
    try:
        measured = fn()
    except Exception as exc:
        measured = {p.name: _err(exc) for p in peers}
    for name, r in measured.items():
        base, key = _key(name, fig)
        results[base][key] = r


def _phase_small(root: Path, n: int, rounds: int, reps: int, default_reps: int,
                 usable: list[str], tracker: Tracker, results: dict[str, Result]) -> None:
    figs = ("status_cmd_ms", "child_restart_ms", "daemon_kill9_survival")
    names = usable + (["circus" + _DEFAULT] if "circus" in usable else [])
    peers = _start_all(names, root, n, tracker, results, figs)
    main = [p for p in peers if not p.name.endswith(_DEFAULT)]
    _store(results, "status_cmd_ms", main, lambda: status_cmd_ms(main, rounds))
    # circus at its default check_delay (5 s) joins only the first few rounds: ~2.5 s each
    counts = {p.name: default_reps if p.name.endswith(_DEFAULT) else reps for p in peers}
    _store(results, "child_restart_ms", peers, lambda: child_restart_ms(peers, counts))
    for p in main:
        results[p.name]["daemon_kill9_survival"] = _try(functools.partial(daemon_kill9_survival, p))


def _phase_big(root: Path, n: int, window: float, usable: list[str], tracker: Tracker,
               results: dict[str, Result]) -> None:
    figs = ("idle_cpu_pct", "memory_mb")
    names = usable + (["circus" + _DEFAULT] if "circus" in usable else [])
    peers = _start_all(names, root, n, tracker, results, figs)
    time.sleep(2.0)  # let start-up work finish before the idle window
    _store(results, "idle_cpu_pct", peers, lambda: idle_cpu_pct(peers, window))
    for p in peers:
        if not p.name.endswith(_DEFAULT):
            results[p.name]["memory_mb"] = _try(functools.partial(memory_mb, p))


# --------------------------------------------------------------------------------------------
# the table


def _fmt(fig: str, r: Result) -> str:
    if "error" in r:
        return "ERROR: " + str(r["error"]).replace("\n", " | ")[:300]
    if fig == "install":
        return f"{r['version']}" + (" (cached)" if r.get("cached") else "")
    if fig.startswith(("status_cmd_ms", "child_restart_ms")):
        s = (f"median {r['median']:.1f} ms  min {r['min']:.1f}  max {r['max']:.1f}  "
             f"(n={r['n']})")
        if "ratio_to_python_c_pass" in r:
            s += f"  {r['ratio_to_python_c_pass']:.2f}x python -c pass"
        if "confirmed_by_status" in r:
            s += f"  status confirmed {r['confirmed_by_status']}/{r['n']}"
        return s
    if fig == "daemon_kill9_survival":
        s = (f"{r['programs']} programs: alive after kill {r['alive_after_kill']}, adopted "
             f"{r['adopted']}, duplicated {r['duplicated']}, respawned {r['respawned']}, lost "
             f"{r['lost']}; unmanaged survivors {r['unmanaged_survivors']}")
        if "shown_by_plain_restart" in r:
            s += f"; plain daemon restart showed {r['shown_by_plain_restart']}"
        return s
    if fig.startswith("idle_cpu_pct"):
        return (f"{r['total_pct']:.2f} % of a core (daemon {r['daemon_pct']:.2f} %), "
                f"{r['programs']} programs, {r['window_s']} s")
    if fig == "lifecycle_ms":
        return "  ".join(f"{k} median {r[k]['median']:.0f} ms (min {r[k]['min']:.0f}, max "
                         f"{r[k]['max']:.0f}, n={r[k]['n']})"
                         for k in ("startup", "launch", "stop"))
    if fig == "memory_mb":
        return (f"daemon RSS {r['daemon_rss']} MB (PSS {r['daemon_pss']}); per program RSS "
                f"{r.get('program_rss_median')} MB, PSS {r.get('program_pss_median')} MB "
                f"(median of {r['programs']})")
    return json.dumps(r)


def table(results: dict[str, Any]) -> str:
    lines = []
    for peer, figs in results.items():
        lines.append(f"== {peer}")
        for fig, r in figs.items():
            lines.append(f"  {fig:36s} {_fmt(fig, r)}")
    return "\n".join(lines)


def main() -> None:
    quick = "--quick" in sys.argv[1:]

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    t0 = time.perf_counter()
    results = run(quick=quick)
    print(table(results))
    print(f"\n{'quick' if quick else 'full'} run took {time.perf_counter() - t0:.0f} s")
    if "--json" in sys.argv[1:]:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
