"""The worker process's shell: config on stdin, the start gate, its private socket,
signals and its rotating log, around :class:`._workercore.WorkerCore`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import trio

from . import _fs
from ._errors import AgentdError
from ._identity import (
    peer_credentials,
)
from ._refence import CachedRecords, registry_watcher, watched_refence
from ._rotate import Limits
from ._session import Transcript
from ._workerconfig import FAILED_LINE_MAX, WorkerConfig
from ._workercore import WorkerCore
from ._workerjournal import Journal
from .agents import (
    AgentLoadError,
    load_agent,
)
from .timing import DEFAULT_TIMING, Timing

log = logging.getLogger("trio_agentd.worker")
LOG_FORMAT = "%(asctime)s worker[%(process)d] %(levelname)s %(message)s"


def _so_peercred_pid(stream: trio.abc.Stream) -> int | None:
    """The peer's pid; -1 (never a claimed pid) for a peer of another uid."""
    creds = peer_credentials(stream)
    if creds is None:
        return None
    pid, uid = creds
    return pid if uid == os.getuid() else -1


async def run_worker(
    config: WorkerConfig,
    timing: Timing = DEFAULT_TIMING,
    on_ready: Callable[[], None] = lambda: None,
    *,
    poll_refence: bool = False,
    log_limits: Limits | None = None,
) -> None:
    """The worker process's main: bind the private socket, serve until stopped or signalled."""
    from ._fs import read_bytes
    from ._trust import prove_socket_dir

    registry = Path(config.registry)
    agent = load_agent(config.agent, config.agent_path)
    # what it opens is closed however it ends (a stop, an error, a cancellation: the fork
    # template's rehearsal cancels a run that hangs), not left to the collector
    with contextlib.ExitStack() as opened:
        watcher = registry_watcher(registry, poll=poll_refence)
        if watcher is not None:
            opened.callback(watcher.close)

        def read_record(generation: str) -> bytes | None:
            return read_bytes(registry / f"{generation}.owner" / "owner.json")

        records = CachedRecords(read_record, watcher.pending) if watcher is not None else None
        watch_claims, wait_change = (
            watched_refence(watcher, registry, timing, lambda: core.conns,
                            on_wake=records.invalidate if records is not None else lambda: None)
            if watcher is not None else (None, None)
        )
        journal = Journal(Path(config.journal))
        opened.callback(journal.close)
        transcript = Transcript(Path(config.session_dir), limits=log_limits or Limits())
        opened.callback(transcript.close)
        core = WorkerCore(
            session_id=config.session_id,
            agent=agent,
            token=config.token,
            supervisor_socket=config.supervisor_socket,
            read_record=records if records is not None else read_record,
            journal=journal,
            transcript=transcript,
            cwd=Path(config.cwd),
            timing=timing,
            peer_pid=_so_peercred_pid,
            watch_claims=watch_claims,
            wait_change=wait_change,
        )
        path = config.worker_socket
        prove_socket_dir(os.path.dirname(path))  # never bind where another user can listen
        listener = listen_unix(path)
        opened.callback(listener.socket.close)
        opened.callback(_unlink_if_same, path, os.stat(path).st_ino)
        on_ready()
        stopped_by = await _serve(core, listener)
        transcript.event("worker_stopped", pid=os.getpid(),
                         **({"signal": stopped_by[0]} if stopped_by else {}))
        transcript.sync()


async def _serve(core: WorkerCore, listener: trio.SocketListener) -> list[str]:
    """Serve ``listener`` until the worker stops; the name of the signal that stopped it, if
    one did."""
    stopped_by: list[str] = []
    with _stop_signals_received() as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if signum not in WORKER_STOP_SIGNALS:
                        log.warning("signal %s: ignored (TERM, INT, HUP or QUIT stop a worker)",
                                    name)
                        continue
                    log.info("signal %s: stopping cleanly (turns in progress may finish)", name)
                    if not stopped_by:
                        stopped_by.append(name)
                    core.stop_requested.set()

            async def accept() -> None:
                # out of descriptors (or memory): back off and go on, as trio.serve_listeners
                # does; anything else is logged and the loop starts again (never a silent stop)
                from ._exhaustion import RateLimitedLog, accept_forever
                from .timing import LOG_RATE_INTERVAL, SERVICE_RESTART_DELAY

                rl = RateLimitedLog(log, LOG_RATE_INTERVAL, clock=trio.current_time)
                while True:
                    try:
                        await accept_forever(
                            listener, lambda s: nursery.start_soon(core.serve_connection, s),
                            rl=rl, what="worker",
                        )
                        return
                    except OSError as exc:
                        rl.error(("accept", exc.errno), "worker: accept failed: %s; starting"
                                 " again in %gs", exc, SERVICE_RESTART_DELAY)
                    await trio.sleep(SERVICE_RESTART_DELAY)

            nursery.start_soon(on_signal)
            nursery.start_soon(accept)
            await core.serve()
            if stopped_by:  # an operator's signal: a clean stop, which the supervisor is told
                await core.announce_stopped(f"stopped cleanly on signal {stopped_by[0]}")
            nursery.cancel_scope.cancel()
    return stopped_by


def _unlink_if_same(path: str, ino: int) -> None:
    """Unlink the socket this worker bound, unless another has been bound there since."""
    try:
        if os.stat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass


def listen_unix(path: str) -> trio.SocketListener:
    """Bind ``path`` (mode 0600, whatever was there unlinked) and listen, on the event loop
    itself, as the supervisor binds its own socket. Trio's ``bind`` of a path runs in a
    thread (a path lookup may block); here the path is in the daemon's private socket dir,
    and nothing else runs in the worker yet, so nothing can wait behind it, while a worker's
    first thread is a good part of the time from its gate to ``ready`` (so also of a
    respawn after a ``kill -9``)."""
    from ._trust import bind_private

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return trio.SocketListener(trio.socket.from_stdlib_socket(bind_private(path)))


# what a worker does on each signal it handles (docs/operations.md has the table): these stop it
# cleanly (exit 0, reported to its supervisor: a stop, not a crash), the others are logged and
# ignored. Anything else (KILL, SEGV, ...) ends it: a crash, respawned within the restart limit.
WORKER_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
WORKER_SIGNALS = (*sorted(WORKER_STOP_SIGNALS), signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)


@contextlib.contextmanager
def _stop_signals_received() -> Iterator[AsyncIterator[int]]:
    """The worker's signals, received while it serves; once it is leaving, the stop signals
    are ignored. Its supervisor TERMs a worker that said it stopped (to be sure it is gone),
    and a stop signal's default action would end it midway, before its ``atexit`` handlers
    and its flushed log: blocked before the receiver gives the default action back, then
    ignored (a pending one with it), the worker still leaves by its own exit. (It stays
    killable: its supervisor's SIGKILL follows after ``stop_grace``.)"""
    stop = set(WORKER_STOP_SIGNALS)
    try:
        with trio.open_signal_receiver(*WORKER_SIGNALS) as signals:
            try:
                yield signals
            finally:
                signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    finally:
        for signum in stop:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)


def log_to_stderr() -> None:
    """The worker's first logging: INFO and up to stderr (until :func:`_rotating_log`).

    The level is set only where it is not INFO already: a worker forked from the template has
    it from there, and setting it clears every logger's cache, a write to each logger that
    each worker would copy."""
    logging.basicConfig(stream=sys.stderr, format=LOG_FORMAT)
    root = logging.getLogger()
    if root.level != logging.INFO:
        root.setLevel(logging.INFO)


def main() -> None:
    """``python -m trio_agentd.worker``: config on stdin, then wait for the start gate."""
    log_to_stderr()
    from ._exhaustion import raise_nofile_limit

    # soft to hard: a busy worker has the descriptors it may have. Logged only if it fails
    # (`trio-agentd daemon` logs the limits it starts with; running out names them): a worker's
    # first log line costs it about 0.3 MB of pages it would otherwise share
    raise_nofile_limit(log, report=False)
    config_line = sys.stdin.readline()
    if not config_line:
        sys.exit("trio-agentd worker: no config on stdin (workers are started by the supervisor)")
    config = WorkerConfig.from_json(config_line)
    gate = sys.stdin.readline().strip()
    if gate != "go":
        sys.exit(0)  # the supervisor died or gave up before opening the gate
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    with contextlib.suppress(OSError):
        os.chdir(config.cwd)
    os.umask(0o077)  # the worker's own files; agents' children get the umask they set
    from .timing import timing_from_env

    timing = timing_from_env()
    poll = os.environ.get("TRIO_AGENTD_REFENCE_POLL") == "1"
    log_limits = _rotating_log(Path(config.session_dir) / "worker.log")
    # no variable of the daemon's reaches an agent (the session's environment stays)
    for name in [k for k in os.environ if k.startswith("TRIO_AGENTD_")]:
        del os.environ[name]
    try:
        trio.run(functools.partial(run_worker, config, timing, _signal_ready, poll_refence=poll,
                                   log_limits=log_limits))
    except AgentLoadError as exc:
        # the whole traceback here, in worker.log; one line to the supervisor, which answers
        # the prompt with it and marks the session failed (never a restart loop)
        log.error("%s\n%s", exc.message, exc.traceback.rstrip() or "(no traceback)")
        where = os.path.join(config.session_dir, "worker.log")
        _signal_failed(f"{exc.message} (full traceback in {where})")
        sys.exit(1)
    except (AgentdError, _fs.UntrustedFile, OSError) as exc:
        # one line for the supervisor to pass on (it quotes the tail of this log)
        sys.exit(f"trio-agentd worker for session {config.session_id}: cannot start: {exc}")


def _signal_failed(cause: str) -> None:
    """Tell the supervisor, instead of ``ready``, why the agent could not be loaded: one line,
    ``failed <JSON string>``, bounded."""
    if len(cause) > FAILED_LINE_MAX // 2:
        cause = cause[: FAILED_LINE_MAX // 2 - 1] + "…"
    with contextlib.suppress(OSError):
        os.write(1, b"failed " + json.dumps(cause).encode() + b"\n")


def _rotating_log(path: Path) -> Limits:
    """Log to ``worker.log`` (our stderr) through a size-bounded handler; stderr follows it to
    each new file, so what is written there directly stays bounded too. The limits (for the
    transcript too)."""
    from ._rotate import RotatingLog, limits_from_env

    try:
        limits = limits_from_env()
    except ValueError as exc:
        limits = Limits()
        log.warning("%s; using %d bytes x %d", exc, limits.max_bytes, limits.backups)
    try:
        handler = RotatingLog(path, limits, stdio=(2,))
    except (OSError, _fs.UntrustedFile) as exc:
        log.warning("worker.log: %s; logging to stderr without rotation", exc)
        return limits
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    return limits


def _signal_ready() -> None:
    """Tell the supervisor (reading our stdout pipe) that the socket listens; then let go."""
    with contextlib.suppress(OSError):
        os.write(1, b"ready\n")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
