"""Real worker processes: the :class:`._handle.WorkerOps` the supervisor runs with.

Spawning follows the start-gate protocol: the config goes to the worker's stdin, the
descriptor is written, then ``go`` opens the gate; the worker answers ``ready`` on its stdout
once its socket listens. Signals are identity-checked (pid + start id), and a worker that is
not our child (adopted from a previous supervisor) is waited for with a pidfd.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket as _socket
import subprocess
from pathlib import Path
from typing import Any

import trio

from . import _fs
from ._autostart import log_tail
from ._errors import AgentdError, ErrorCode
from ._handle import WorkerHandle
from ._identity import Liveness, liveness, read_start_id, signal_group_identity_checked
from ._paths import Layout
from ._recovery import Mode, StopReason, descriptor_lifecycle
from ._registry import Ownership
from ._session import Transcript, read_meta, write_meta
from ._trust import (
    agent_environment,
    agent_import_path,
    daemon_knobs,
    isolated_python,
    prove_peer,
    prove_socket_dir,
    session_environment,
)
from ._worker import WorkerConfig
from ._workerlink import WorkerLink, link_over_stream
from .timing import Timing

DESCRIPTOR_VERSION = 1


class ProcessWorkerOps:
    def __init__(self, layout: Layout, ownership: Ownership, timing: Timing) -> None:
        self.layout = layout
        self.ownership = ownership
        self.timing = timing
        self.nursery: trio.Nursery | None = None  # for reapers; set once the supervisor runs
        self._children: dict[int, trio.Process] = {}

    # identity ---------------------------------------------------------------------------------
    def alive(self, h: WorkerHandle) -> bool:
        if h.pid is None:
            return False
        return liveness(h.pid, h.start_id) is not Liveness.DEAD

    def signal(self, h: WorkerHandle, sig: int) -> bool:
        if h.pid is None:
            return False
        return signal_group_identity_checked(h.pid, h.pid, h.start_id, sig)

    async def wait_exit(self, h: WorkerHandle) -> None:
        while h.pid is not None and self.alive(h):
            proc = self._children.get(h.pid)
            if proc is not None:
                await proc.wait()
            else:
                await _wait_pid_exit(h.pid)

    def admission_held(self) -> bool:
        return self.ownership.registry.shutdown_in_progress(self.ownership.admission_ticket)

    # links ------------------------------------------------------------------------------------
    async def connect(self, h: WorkerHandle) -> WorkerLink:
        if h.token is None:
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, "no token for this worker")
        path = self.layout.worker_socket(h.session_id)
        sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            # the token goes only to a worker of ours: the dir and the peer are proven first
            prove_socket_dir(os.path.dirname(path))
            await sock.connect(path)
            prove_peer(sock, path)
        except (OSError, AgentdError) as exc:
            sock.close()
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE, f"cannot reach worker at {path}: {exc}"
            ) from None
        except BaseException:
            sock.close()
            raise
        own = self.ownership.record
        link = await link_over_stream(
            trio.SocketStream(sock),
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
    async def spawn(self, h: WorkerHandle) -> None:
        L = self.layout
        h.token = secrets.token_hex(16)
        session_dir = L.session_dir(h.session_id)
        _fs.ensure_dir(session_dir)
        meta = read_meta(session_dir)
        if meta is None:
            meta = {"session": h.session_id, "agent": h.agent, "cwd": h.cwd,
                    "created_at": h.created_at, "socket": L.socket,
                    "env": h.env if h.env is not None else agent_environment(dict(os.environ))}
            write_meta(session_dir, meta)
        env = session_environment(meta)
        _fs.atomic_write(L.token_path(h.session_id), h.token.encode(), mode=0o600)
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
        log_fd = _fs.open_trusted(
            session_dir / "worker.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT
        )
        try:
            proc = await trio.lowlevel.open_process(
                isolated_python("trio_agentd.worker"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_fd,
                start_new_session=True,
                cwd="/",
                # the session's environment; the daemon's knobs the worker reads (and then
                # removes from its own environment, before any agent runs)
                env={**env, **daemon_knobs(os.environ)},
            )
        finally:
            os.close(log_fd)
        h.pid = proc.pid
        h.start_id = read_start_id(proc.pid)
        self._children[proc.pid] = proc
        if self.nursery is not None:
            self.nursery.start_soon(self._reap, proc)
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            await proc.stdin.send_all(config.to_json().encode() + b"\n")
            # the descriptor is on disk before the worker does any work
            self.persist(h, lifecycle=Mode.STARTING)
            await proc.stdin.send_all(b"go\n")
            await proc.stdin.aclose()
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(64)
                if not chunk:
                    break
                buf += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            buf = b""
        finally:
            with trio.move_on_after(1, shield=True):
                await proc.stdout.aclose()
        if buf.strip() != b"ready":
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"worker for session {h.session_id} exited before it was ready; log:"
                f" {log_tail(session_dir / 'worker.log', 5)}",
            )

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
            "created_at": h.created_at,
            "updated_at": _now(),
        }

    def persist(self, h: WorkerHandle, lifecycle: Mode | None = None) -> None:
        """Write the descriptor atomically (temp file, fsync, rename, fsync the directory).

        Raises:
            OSError: it could not be written (the old descriptor stays whole).
        """
        _fs.atomic_write_json(
            self.layout.descriptor_path(h.session_id), self.descriptor(h, lifecycle)
        )

    def forget(self, session_id: str) -> None:
        for p in (self.layout.descriptor_path(session_id), self.layout.token_path(session_id)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

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
                             created_at=str(desc.get("created_at") or _now()))
            pid = desc.get("pid")
            h.pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
            sid = desc.get("start_id")
            h.start_id = sid if isinstance(sid, str) else None
            restarts = desc.get("restarts", 0)
            h.restarts_loaded = restarts if isinstance(restarts, int) and restarts >= 0 else 0
            lifecycle = Mode(str(desc.get("lifecycle", "stopped")))
            reason = StopReason(str(desc.get("stop_reason") or ""))
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
        h = WorkerHandle(self, session_id, agent, cwd)
        h.env = env
        h.turns = Transcript(self.layout.session_dir(session_id)).turns
        return h


def _now() -> str:
    from ._session import now_iso

    return now_iso()


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


async def _wait_pid_exit(pid: int) -> None:
    """Wait for a process that is not our child to exit: a pidfd where there is one."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        await trio.sleep(0.01)
        return
    try:
        fd = pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
