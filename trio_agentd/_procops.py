"""Real worker processes: the :class:`._handle.WorkerOps` the supervisor runs with.

A worker is forked from the supervisor's pre-imported template (``_forkserver``) when it
can be, else exec'd (``python -E -P -m trio_agentd.worker``); either way spawning follows the
start-gate protocol: the config goes to the worker's stdin, the
descriptor is written, then ``go`` opens the gate; the worker answers ``ready`` on its stdout
once its socket listens, or ``failed <JSON string>`` when its agent cannot be loaded (an
``agent_failed`` error: the session fails with that cause, and is not respawned). Signals are
identity-checked (pid + start id), and a worker that is not our child (adopted from a previous
supervisor) is waited for with a pidfd.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from . import _fs
from ._autostart import log_tail
from ._errors import AgentdError, ErrorCode
from ._exhaustion import RateLimitedLog, exhaustion_error, is_exhaustion
from ._forkserver import ForkServer
from ._groupwrite import GroupWriter
from ._handle import WorkerHandle
from ._identity import (
    Liveness,
    liveness,
    read_start_id,
    signal_group_identity_checked,
    signal_identity_checked,
)
from ._paths import Layout
from ._recovery import Mode, RecoveryState, StopReason, descriptor_lifecycle
from ._registry import Ownership
from ._session import Transcript, read_meta
from ._storage import STORAGE_ERRNOS, storage_error
from ._trust import (
    agent_environment,
    agent_import_path,
    daemon_knobs,
    isolated_python,
    prove_peer,
    prove_socket_dir,
    session_environment,
)
from ._workerconfig import FAILED_LINE_MAX, WorkerConfig
from ._workerlink import WorkerLink, link_over_stream
from .timing import (
    LINK_CLOSE_TIMEOUT,
    LOG_RATE_INTERVAL,
    MAX_PARALLEL_SPAWNS,
    MAX_SPARE_WORKERS,
    MIN_WAKE,
    SPARE_DEMAND_WINDOW,
    Timing,
)

log = logging.getLogger("trio_agentd.supervisor")

DESCRIPTOR_VERSION = 1


_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def kill_pending(pid: int) -> bool:
    """Has ``pid`` been sent a ``SIGKILL`` it has not acted on yet? The kernel marks it
    pending in every thread of the process as it is sent, so it shows in ``SigPnd`` at once,
    while the process may not run (and so exit, closing its sockets) for a while. ``False``
    where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return sigkill_in_status(f.read())
    except OSError:
        return False


def sigkill_in_status(status: bytes) -> bool:
    """Does a ``/proc/<pid>/status`` text show ``SIGKILL`` pending (thread or process)?"""
    for line in status.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")):
            try:
                if int(line.split()[1], 16) & _SIGKILL_BIT:
                    return True
            except (IndexError, ValueError):
                return False
    return False


class ProcessWorkerOps:
    def __init__(self, layout: Layout, ownership: Ownership, timing: Timing) -> None:
        self.layout = layout
        self.ownership = ownership
        self.timing = timing
        self.nursery: trio.Nursery | None = None  # for reapers; set once the supervisor runs
        self._children: dict[int, trio.Process] = {}
        # the template that forks workers (started by start_template, or the first spawn)
        self.forkserver: ForkServer | None = None
        # session → why its last start or connect ran out of resources or of room for its
        # files (cleared by a connect that succeeds): the supervisor answers
        # resource_exhausted or storage_error, not "failed"
        self.exhausted: dict[str, AgentdError] = {}
        self.rl = RateLimitedLog(log, LOG_RATE_INTERVAL, clock=trio.current_time)
        # descriptor and token writes, committed in groups (a service task runs it)
        self.writer = GroupWriter()
        # worker starts run at most this many at once (each handle's spawn takes a slot)
        self.spawn_limiter = trio.CapacityLimiter(MAX_PARALLEL_SPAWNS)

    def start_template(self) -> None:
        """Start the fork template (and its spares) now, in ``nursery``: the first session's
        start then finds it ready instead of waiting for a Python start and the imports."""
        if self.forkserver is None and self.nursery is not None:
            fs = self.forkserver = ForkServer(self.timing.fork_template_restart_delay,
                                              max_spares=MAX_SPARE_WORKERS,
                                              demand_window=SPARE_DEMAND_WINDOW)
            self.nursery.start_soon(fs.run)

    # identity ---------------------------------------------------------------------------------
    def alive(self, h: WorkerHandle) -> bool:
        if h.pid is None:
            return False
        return liveness(h.pid, h.start_id) is not Liveness.DEAD

    def serving(self, h: WorkerHandle) -> bool:
        return self.alive(h) and h.pid is not None and not kill_pending(h.pid)

    def signal(self, h: WorkerHandle, sig: int) -> bool:
        if h.pid is None:
            return False
        if signal_group_identity_checked(h.pid, h.pid, h.start_id, sig):
            return True
        if h.pid not in self._children and signal_identity_checked(h.pid, h.start_id, sig):
            # a worker forked a moment ago has no group of its own yet (its ``setsid`` is
            # its first act, but the template answers with its pid at once); before its
            # gate it has no children either: the process is all there is to signal
            return True
        proc = self._children.get(h.pid)
        if proc is not None and proc.returncode is None:
            # our own child, not yet reaped: its pid (and so its group, which it leads) cannot
            # have been reused, so no identity check is needed — and that check reads /proc,
            # which fails when we are out of descriptors
            try:
                os.killpg(h.pid, sig)
            except (ProcessLookupError, PermissionError):
                return False
            return True
        return False

    async def wait_exit(self, h: WorkerHandle) -> None:
        while h.pid is not None and self.alive(h):
            proc = self._children.get(h.pid)
            if proc is not None:
                await proc.wait()
            else:
                await _wait_pid_exit(h.pid)

    def admission_held(self) -> bool:
        try:
            return self.ownership.registry.shutdown_in_progress(self.ownership.admission_ticket)
        except OSError as exc:
            # cannot tell (out of descriptors): go on; a start then fails the same way and
            # says so, and a worker started meanwhile is fenced by the registry anyway
            self.rl.error(("admission", exc.errno), "cannot probe the shutdown admission: %s",
                          exc)
            return False

    # links ------------------------------------------------------------------------------------
    async def connect(self, h: WorkerHandle) -> WorkerLink:
        if h.token is None:
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, "no token for this worker")
        path = self.layout.worker_socket(h.session_id)
        stream: trio.SocketStream | None = None
        try:
            # the token goes only to a worker of ours: the dir and the peer are proven first
            prove_socket_dir(os.path.dirname(path))
            stream = await trio.open_unix_socket(path)
            prove_peer(stream.socket, path)
        except (OSError, AgentdError) as exc:
            if stream is not None:
                stream.socket.close()
            if isinstance(exc, OSError) and is_exhaustion(exc):
                raise self._resource_error(h, exc, f"cannot reach worker at {path}") from None
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE, f"cannot reach worker at {path}: {exc}"
            ) from None
        except BaseException:
            if stream is not None:
                stream.socket.close()
            raise
        self.exhausted.pop(h.session_id, None)
        own = self.ownership.record
        link = await link_over_stream(
            stream,
            token=h.token,
            generation=own.generation,
            pid=own.pid,
            start_id=own.start_id,
            socket=self.layout.socket,
        )
        if link.hello.pid != h.pid:
            await link.aclose()
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"worker socket answered with pid {link.hello.pid}, expected {h.pid}",
            )
        return link

    # processes --------------------------------------------------------------------------------
    def _resource_error(self, h: WorkerHandle, exc: OSError, what: str) -> AgentdError:
        """The AgentdError for an OSError of a start or connect; an exhaustion (or a worker
        file that could not be written for want of room) is recorded: the session is started
        again by the next command, not left failed."""
        if is_exhaustion(exc):
            err = exhaustion_error(exc, what)
            self.exhausted[h.session_id] = err
            self.rl.error(("start", exc.errno), "session %s: %s", h.session_id, err.message)
            return err
        if exc.errno in STORAGE_ERRNOS:
            err = storage_error(exc.filename or self.layout.home, exc,
                                what=f"a file of session {h.session_id}'s worker")
            self.exhausted[h.session_id] = err
            self.rl.error(("start", exc.errno), "session %s: could not start its worker: %s",
                          h.session_id, err.message)
            return err
        return AgentdError(ErrorCode.WORKER_UNAVAILABLE, f"{what}: {exc}")

    async def spawn(self, h: WorkerHandle) -> None:
        """Start the session's worker (the start-gate protocol).

        Raises:
            AgentdError: ``resource_exhausted`` when a pipe, fork, exec or file could not be
                had for want of resources (EMFILE, ENFILE, EAGAIN, ENOMEM): no worker is left
                running; ``worker_unavailable`` for any other failure.
        """
        self.exhausted.pop(h.session_id, None)
        try:
            await self._spawn(h)
        except OSError as exc:
            raise self._resource_error(
                h, exc, f"could not start the worker of session {h.session_id}"
            ) from None
        except _fs.UntrustedFile as exc:
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"could not start the worker of session {h.session_id}: {exc}",
            ) from None

    async def _spawn(self, h: WorkerHandle) -> None:
        L = self.layout
        h.token = secrets.token_hex(16)
        session_dir = L.session_dir(h.session_id)
        _fs.ensure_dir(session_dir)
        meta = read_meta(session_dir)
        new_meta = meta is None
        if meta is None:
            meta = {"session": h.session_id, "agent": h.agent, "cwd": h.cwd,
                    "created_at": h.created_at, "socket": L.socket,
                    "env": h.env if h.env is not None else agent_environment(dict(os.environ))}
        env = session_environment(meta)
        cwd = h.cwd if _is_dir(h.cwd) else str(session_dir)
        config = WorkerConfig(
            session_id=h.session_id,
            agent=h.agent,
            token=h.token,
            supervisor_socket=L.socket,
            registry=str(self.ownership.registry.root),
            worker_socket=L.worker_socket(h.session_id),
            journal=str(L.journal_path(h.session_id)),
            session_dir=str(session_dir),
            cwd=cwd,
            agent_path=agent_import_path(cwd, env),
        )
        # the session's environment; the daemon's knobs the worker reads (and then removes
        # from its own environment, before any agent runs)
        worker_env = {**env, **daemon_knobs(os.environ)}
        log_fd = _fs.open_trusted(
            session_dir / "worker.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT
        )
        try:
            started = await self._fork(worker_env, log_fd)
            if started is None:
                proc = await trio.lowlevel.open_process(
                    isolated_python("trio_agentd.worker"),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log_fd,
                    start_new_session=True,
                    cwd="/",
                    env=worker_env,
                )
                self._children[proc.pid] = proc
                if self.nursery is not None:
                    self.nursery.start_soon(self._reap, proc)
                assert proc.stdin is not None
                assert proc.stdout is not None
                pid, stdin, stdout = proc.pid, proc.stdin, proc.stdout
            else:
                pid, stdin, stdout = started
        finally:
            os.close(log_fd)
        start_id = read_start_id(pid)
        if start_id is None:
            # its identity could not be read (out of descriptors?): a worker we could never
            # signal identity-checked must not run. It has not passed its gate: no children.
            why = _identity_unreadable(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with trio.move_on_after(self.timing.kill_confirm_timeout, shield=True):
                await stdin.aclose()
                await self._wait_gone(pid)
            raise why
        h.pid = pid
        h.start_id = start_id
        try:
            await stdin.send_all(config.to_json().encode() + b"\n")
            # the descriptor is on disk before the worker does any work (a write that fails
            # fails the start: the caller stops the worker, which has not passed its gate).
            # The worker's files are staged together, no wait between them, so one commit (one
            # flush) makes them all durable: a file staged before the fork would be committed
            # on its own while the fork runs, and the descriptor would wait for a second one
            try:
                if new_meta:
                    with _naming(session_dir / "session.json"):
                        self._write(session_dir / "session.json",
                                    json.dumps(meta, sort_keys=True).encode())
                with _naming(L.token_path(h.session_id)):
                    self._write(L.token_path(h.session_id), h.token.encode())
                with _naming(L.descriptor_path(h.session_id)):
                    self.persist(h, lifecycle=Mode.STARTING)
                    await self.writer.durable(path=L.descriptor_path(h.session_id))
                for path in (L.token_path(h.session_id), session_dir / "session.json"):
                    with _naming(path):
                        await self.writer.durable(path=path)
            except OSError as exc:
                raise _DescriptorUnwritten(exc) from None
            await stdin.send_all(b"go\n")
            await stdin.aclose()
            buf = b""
            while not buf.endswith(b"\n") and len(buf) <= FAILED_LINE_MAX:
                chunk = await stdout.receive_some(64)
                if not chunk:
                    break
                buf += chunk
        except _DescriptorUnwritten as exc:
            raise exc.error from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            buf = b""
        finally:
            with trio.move_on_after(LINK_CLOSE_TIMEOUT, shield=True):
                await stdin.aclose()
                await stdout.aclose()
        if buf.startswith(b"failed ") and buf.endswith(b"\n"):
            # the agent cannot be loaded: the worker says why, in one line, and exits
            try:
                cause = json.loads(buf[len(b"failed "):])
            except ValueError:
                cause = None
            if isinstance(cause, str):
                raise AgentdError(ErrorCode.AGENT_FAILED, cause)
        if buf.strip() != b"ready":
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"worker for session {h.session_id} exited before it was ready; log:"
                f" {log_tail(session_dir / 'worker.log', 5)}",
            )

    async def _fork(
        self, env: dict[str, str], log_fd: int
    ) -> tuple[int, trio.lowlevel.FdStream, trio.lowlevel.FdStream] | None:
        """A worker forked by the template: (pid, its stdin, its stdout), or ``None`` when
        the template cannot fork it now (the worker is exec'd). A parked spare is taken
        first (no fork). The first spawn starts the template if nothing did and waits for
        it; while one that died is restarted, workers are exec'd."""
        self.start_template()
        fs = self.forkserver
        if fs is None:
            return None
        fs.note_spawn(trio.current_time())
        with trio.move_on_after(self.timing.worker_connect_timeout):
            await fs.settled.wait()
        in_r, in_w = os.pipe()
        try:
            out_r, out_w = os.pipe()
        except BaseException:
            os.close(in_r)
            os.close(in_w)
            raise
        pid = None
        try:
            spare = fs.take_spare(env) if fs.usable_for(env) else None
            if spare is not None and await fs.start_spare(spare, env, (in_r, out_w, log_fd)):
                pid = spare.pid  # forked ahead of need: no fork now
            else:
                pid = await fs.spawn(env, (in_r, out_w, log_fd))
        finally:
            os.close(in_r)
            os.close(out_w)
            if pid is None:
                os.close(in_w)
                os.close(out_r)
        if pid is None:
            return None
        return pid, trio.lowlevel.FdStream(in_w), trio.lowlevel.FdStream(out_r)

    async def _wait_gone(self, pid: int) -> None:
        proc = self._children.get(pid)
        if proc is not None:
            await proc.wait()
            return
        while liveness(pid, read_start_id(pid)) is not Liveness.DEAD:
            await _wait_pid_exit(pid)

    async def _reap(self, proc: trio.Process) -> None:
        try:
            await proc.wait()
        finally:
            self._children.pop(proc.pid, None)

    # descriptors ------------------------------------------------------------------------------
    def descriptor(self, h: WorkerHandle, lifecycle: Mode | None = None) -> dict[str, Any]:
        """The descriptor's content. An operator's stop asked for and not done makes the
        lifecycle ``stopping`` whatever the handle's mode, with ``stop_reason`` (kill, evict,
        shutdown): written before the worker is told, so a successor finishes it. Once
        stopped the reason stays (``evict``: the session is evicted)."""
        L = self.layout
        reason = h.stop_reason
        life = descriptor_lifecycle(lifecycle or h.mode.value, reason)
        return {
            "version": DESCRIPTOR_VERSION,
            "session": h.session_id,
            "socket": L.socket,
            "pid": h.pid,
            "start_id": h.start_id,
            "pgid": h.pid,
            "worker_socket": L.worker_socket(h.session_id),
            "token_sha256": hashlib.sha256((h.token or "").encode()).hexdigest(),
            "create": {
                "argv": isolated_python("trio_agentd.worker"),
                "cwd": h.cwd,
                "agent": h.agent,
                "env": {},
            },
            "journal": str(L.journal_path(h.session_id)),
            "lifecycle": str(life),
            "stop_reason": str(reason),
            "restarts": h.restarts,
            # why it is failed (shown by `sessions`; a successor supervisor shows it too)
            "failure": h.state.failure if life is Mode.FAILED else h.agent_failure,
            "agent_failed": h.state.agent_failed,
            "created_at": h.created_at,
            "updated_at": _now(),
        }

    def persist(self, h: WorkerHandle, lifecycle: Mode | None = None) -> None:
        """Write the descriptor atomically: staged now, committed with the others by the
        writer's task (:meth:`durable` waits for it); at once if that task does not run.

        Raises:
            OSError: it could not be written (the old descriptor stays whole).
        """
        self._write(self.layout.descriptor_path(h.session_id),
                    json.dumps(self.descriptor(h, lifecycle), sort_keys=True).encode())

    def _write(self, path: Path, data: bytes) -> None:
        if self.writer.running:
            self.writer.stage(path, data)
        else:
            _fs.atomic_write(path, data)

    async def durable(self) -> None:
        """Return once every descriptor and token written so far is on disk (a commit that
        failed is logged by the writer; the state of memory is written again at the next
        change)."""
        await self.writer.durable()

    async def forget(self, session_id: str) -> None:
        """Delete the session's descriptor and token, and return once neither can come back: a
        group commit that was writing one when it was dropped unlinks it as it ends."""
        for p in (self.layout.descriptor_path(session_id), self.layout.token_path(session_id)):
            self.writer.drop(p)
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        await self.writer.settled()

    def load(self, path: Path) -> tuple[WorkerHandle, bool, Mode]:
        """A handle from a descriptor file: (handle, its worker is alive, recorded lifecycle).

        A recorded operator's stop (``stop_reason``) is on the handle, ``loaded_stop_reason``.

        Raises:
            ValueError: the descriptor is unreadable, foreign or malformed.
        """
        try:
            desc = json.loads(_fs.read_bytes(path) or b"")
        except _fs.UntrustedFile:
            raise
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable: {exc}") from None
        if not isinstance(desc, dict):
            raise ValueError("not a JSON object")
        if desc.get("socket") != self.layout.socket:
            raise ValueError(f"belongs to socket {desc.get('socket')!r}")
        from ._session import check_session_id

        try:
            session_id = check_session_id(str(desc["session"]))
            create = desc.get("create") or {}
            if not isinstance(create, dict):
                raise TypeError("create is not an object")
            h = WorkerHandle(self, session_id, str(create.get("agent", "echo")),
                             str(create.get("cwd", "/")),
                             created_at=str(desc.get("created_at") or _now()),
                             spawn_limiter=self.spawn_limiter)
            pid = desc.get("pid")
            h.pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
            sid = desc.get("start_id")
            h.start_id = sid if isinstance(sid, str) else None
            restarts = desc.get("restarts", 0)
            h.restarts_loaded = restarts if isinstance(restarts, int) and restarts >= 0 else 0
            lifecycle = Mode(str(desc.get("lifecycle", "stopped")))
            reason = StopReason(str(desc.get("stop_reason") or ""))
            failure = desc.get("failure")
            failure = failure if isinstance(failure, str) else ""
            if lifecycle is Mode.FAILED:
                h.state = RecoveryState(failure=failure,
                                        agent_failed=desc.get("agent_failed") is True)
            elif lifecycle is Mode.READY:
                h.agent_failure = failure
        except (KeyError, TypeError, ValueError, AgentdError) as exc:
            raise ValueError(f"malformed: {exc}") from None
        if lifecycle in (Mode.STOPPING, Mode.STOPPED):
            # an operator's stop in progress is finished by the supervise task; a finished one
            # is kept (evicted; killed and not yet forgotten). A ``stopping`` without a reason
            # is recovery's own stop: the worker is adopted as before.
            h.loaded_stop_reason = reason
            h.evicted = lifecycle is Mode.STOPPED and reason is StopReason.EVICT
        raw = _fs.read_bytes(self.layout.token_path(session_id))
        h.token = raw.decode(errors="replace").strip() if raw else None
        h.turns = Transcript(self.layout.session_dir(session_id)).turns
        # (a stop needs no token: it signals the recorded process, identity-checked)
        stop = h.loaded_stop_reason is not StopReason.NONE
        return h, self.alive(h) and (h.token is not None or stop), lifecycle

    def new_handle(
        self, session_id: str, agent: str, cwd: str, env: dict[str, str] | None = None
    ) -> WorkerHandle:
        h = WorkerHandle(self, session_id, agent, cwd, spawn_limiter=self.spawn_limiter)
        h.env = env
        h.turns = Transcript(self.layout.session_dir(session_id)).turns
        return h


class _DescriptorUnwritten(Exception):
    """The descriptor of a starting worker could not be written (carries the OSError past
    the handler for a worker that went away during its start)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An ``OSError`` raised inside names ``path`` (a failed write says which file)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = os.fspath(path)
        raise


def _now() -> str:
    from ._session import now_iso

    return now_iso()


def _identity_unreadable(pid: int) -> Exception:
    """Why the start id of our new child ``pid`` could not be read: the OSError of reading
    it (EMFILE…), or a ``worker_unavailable``."""
    try:
        with open(f"/proc/{pid}/stat", "rb"):
            pass
    except OSError as exc:
        if is_exhaustion(exc):
            return exc
    return AgentdError(ErrorCode.WORKER_UNAVAILABLE,
                       f"could not read the identity of the new worker pid {pid}")


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


async def _wait_pid_exit(pid: int) -> None:
    """Wait for a process that is not our child to exit: a pidfd where there is one."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        await trio.sleep(MIN_WAKE)
        return
    try:
        fd = pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:
        # no descriptor to spare (EMFILE): poll instead; the caller checks liveness again
        await trio.sleep(MIN_WAKE)
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
