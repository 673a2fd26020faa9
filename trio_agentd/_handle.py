"""One session as the supervisor sees it: its worker process, descriptor and link.

The handle spawns its worker with the start-gate protocol (config on stdin, descriptor written,
then ``go``), adopts a live worker from its descriptor, and reconnects or respawns when a call
finds no usable link. A command is resent over a new link with the same command id; the
worker's journal returns the stored result instead of running it twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from . import _fs
from ._errors import AgentdError, ErrorCode
from ._identity import Liveness, liveness, read_start_id, signal_group_identity_checked
from ._protocol import Response
from ._session import Transcript, now_iso, read_meta, write_meta
from ._worker import WorkerConfig
from ._workerlink import EventSink, WorkerDropped, WorkerLink, open_worker_link

if TYPE_CHECKING:
    from ._supervisor import Supervisor

log = logging.getLogger("trio_agentd.supervisor")

DESCRIPTOR_VERSION = 1


class WorkerHandle:
    def __init__(self, sup: Supervisor, session_id: str, agent: str, cwd: str) -> None:
        self.sup = sup
        self.session_id = session_id
        self.agent = agent
        self.cwd = cwd
        self.pid: int | None = None
        self.start_id: str | None = None
        self.token: str | None = None
        self.state = "stopped"
        self.restarts = 0
        self.turns = 0
        self.created_at = now_iso()
        self.last_prompt = time.monotonic()
        self.link: WorkerLink | None = None
        self._lock = trio.Lock()
        self.process: trio.Process | None = None

    # descriptor -----------------------------------------------------------------------
    @property
    def layout(self):  # type: ignore[no-untyped-def]
        return self.sup.layout

    def descriptor(self) -> dict[str, Any]:
        L = self.sup.layout
        return {
            "version": DESCRIPTOR_VERSION,
            "session": self.session_id,
            "socket": L.socket,
            "pid": self.pid,
            "start_id": self.start_id,
            "pgid": self.pid,
            "worker_socket": L.worker_socket(self.session_id),
            "token_sha256": hashlib.sha256((self.token or "").encode()).hexdigest(),
            "create": {
                "argv": [sys.executable, "-m", "trio_agentd.worker"],
                "cwd": self.cwd,
                "agent": self.agent,
                "env": {},
            },
            "journal": str(L.journal_path(self.session_id)),
            "lifecycle": self.state,
            "restarts": self.restarts,
            "created_at": self.created_at,
            "updated_at": now_iso(),
        }

    def write_descriptor(self) -> None:
        _fs.atomic_write_json(self.sup.layout.descriptor_path(self.session_id), self.descriptor())

    @classmethod
    def from_descriptor(cls, sup: Supervisor, desc: dict[str, Any]) -> WorkerHandle:
        create = desc.get("create") or {}
        h = cls(sup, str(desc["session"]), str(create.get("agent", "echo")),
                str(create.get("cwd", "/")))
        pid = desc.get("pid")
        h.pid = int(pid) if isinstance(pid, int) else None
        sid = desc.get("start_id")
        h.start_id = str(sid) if isinstance(sid, str) else None
        h.restarts = int(desc.get("restarts", 0) or 0)
        h.created_at = str(desc.get("created_at", now_iso()))
        h.state = str(desc.get("lifecycle", "stopped"))
        token_path = sup.layout.token_path(h.session_id)
        raw = _fs.read_bytes(token_path)
        h.token = raw.decode().strip() if raw else None
        h.turns = Transcript(sup.layout.session_dir(h.session_id)).turns
        return h

    # liveness ---------------------------------------------------------------------------
    def alive(self) -> bool:
        if self.pid is None:
            return False
        return liveness(self.pid, self.start_id) is not Liveness.DEAD

    def summary(self) -> dict[str, Any]:
        alive = self.alive()
        state = self.state if alive or self.state in ("stopped", "failed", "evicted") else "dead"
        return {
            "session": self.session_id,
            "agent": self.agent,
            "state": state,
            "pid": self.pid if alive else None,
            "restarts": self.restarts,
            "turns": self.turns,
            "idle_s": round(time.monotonic() - self.last_prompt, 3),
        }

    # links ------------------------------------------------------------------------------
    async def ensure_link(self) -> WorkerLink:
        """A usable authenticated link: the current one, a reconnect, or a fresh worker."""
        async with self._lock:
            if self.link is not None and not self.link.closed.is_set():
                return self.link
            self.link = None
            timing = self.sup.timing
            if self.alive() and self.token is not None:
                try:
                    with _fail_after(timing.adopt_connect_timeout, "reconnect to the worker"):
                        return await self._connect()
                except AgentdError as exc:
                    log.warning("session %s: worker %s unreachable (%s); replacing it",
                                self.session_id, self.pid, exc)
                    await self.stop_process()
            if self.pid is not None and self.state not in ("stopped", "evicted"):
                self.restarts += 1
            await self._spawn()
            with _fail_after(timing.worker_connect_timeout, "connect to the new worker"):
                return await self._connect()

    async def _connect(self) -> WorkerLink:
        assert self.token is not None
        sup = self.sup
        own = sup.ownership.record
        link = await open_worker_link(
            self.sup.layout.worker_socket(self.session_id),
            token=self.token,
            generation=sup.generation,
            pid=own.pid,
            start_id=own.start_id,
            socket=sup.layout.socket,
        )
        if link.hello.pid != self.pid:
            await link.aclose()
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"worker socket answered with pid {link.hello.pid}, expected {self.pid}",
            )
        self.link = link
        self.state = "ready"
        sup.service_nursery.start_soon(link.run_reader)
        return link

    async def _spawn(self) -> None:
        sup = self.sup
        L = sup.layout
        self.state = "starting"
        self.token = secrets.token_hex(16)
        session_dir = L.session_dir(self.session_id)
        session_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if read_meta(session_dir) is None:
            write_meta(session_dir, {"session": self.session_id, "agent": self.agent,
                                     "cwd": self.cwd, "created_at": self.created_at})
        _fs.atomic_write(L.token_path(self.session_id), self.token.encode(), mode=0o600)
        config = WorkerConfig(
            session_id=self.session_id,
            agent=self.agent,
            token=self.token,
            supervisor_socket=L.socket,
            registry=str(sup.registry.root),
            worker_socket=L.worker_socket(self.session_id),
            journal=str(L.journal_path(self.session_id)),
            session_dir=str(session_dir),
            cwd=self.cwd if _is_dir(self.cwd) else str(session_dir),
        )
        log_fd = os.open(session_dir / "worker.log",
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "trio_agentd.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_fd,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            os.close(log_fd)
        self.process = proc
        self.pid = proc.pid
        self.start_id = read_start_id(proc.pid)
        assert proc.stdin is not None
        assert proc.stdout is not None
        ready = False
        try:
            await proc.stdin.send_all(config.to_json().encode() + b"\n")
            # the descriptor is on disk before the worker does any work
            self.write_descriptor()
            await proc.stdin.send_all(b"go\n")
            await proc.stdin.aclose()
            with trio.move_on_after(sup.timing.worker_connect_timeout):
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = await proc.stdout.receive_some(64)
                    if not chunk:
                        break
                    buf += chunk
                ready = buf.strip() == b"ready"
        finally:
            with trio.move_on_after(
                sup.timing.stop_grace + sup.timing.kill_confirm_timeout + 1, shield=True
            ):
                await proc.stdout.aclose()
                if not ready:
                    await self.stop_process()
                    self.state = "failed" if self.restarts else "stopped"
                    self.write_descriptor()
        if not ready:
            tail = _tail(session_dir / "worker.log")
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"worker for session {self.session_id} did not become ready; log: {tail}",
            )
        sup.service_nursery.start_soon(self._reap, proc)
        self.state = "ready"
        self.write_descriptor()
        log.info("session %s: worker pid %s ready", self.session_id, proc.pid)

    async def _reap(self, proc: trio.Process) -> None:
        await proc.wait()
        if self.process is proc:
            self.process = None
            log.info("session %s: worker pid %s exited with %s",
                     self.session_id, proc.pid, proc.returncode)

    async def call(
        self, op: str, args: dict[str, Any], *, client_id: str, on_event: EventSink | None
    ) -> Response:
        """Send a command, reconnecting (or respawning) and resending once if the link drops."""
        last: Exception | None = None
        for _attempt in range(3):
            link = await self.ensure_link()
            try:
                return await link.call(op, args, client_id=client_id, on_event=on_event)
            except WorkerDropped as exc:
                last = exc
                with contextlib.suppress(Exception):
                    await link.aclose()
                if self.link is link:
                    self.link = None
        raise AgentdError(
            ErrorCode.WORKER_UNAVAILABLE,
            f"session {self.session_id}: worker connection kept dropping ({last})",
        )

    async def stop(self) -> None:
        """Stop the worker gracefully: a ``stop`` command, then TERM/KILL of its group."""
        async with self._lock:
            link = self.link
            if link is not None and not link.closed.is_set():
                with trio.move_on_after(self.sup.timing.stop_grace):
                    with contextlib.suppress(WorkerDropped, AgentdError):
                        await link.call("stop", {}, client_id="supervisor")
                    await self._wait_exit()
            self.link = None
            await self.stop_process()
            self.state = "stopped"
            with contextlib.suppress(OSError):
                self.write_descriptor()

    async def _wait_exit(self) -> None:
        """Wait until the worker process is gone (the caller bounds the wait)."""
        while self.alive():
            if self.process is not None:
                await self.process.wait()
            else:
                await _wait_pid_exit(self.pid)

    async def stop_process(self) -> None:
        """TERM the worker's process group, grace, KILL, confirm exit; identity-checked."""
        if self.pid is None or not self.alive():
            return
        timing = self.sup.timing
        with trio.CancelScope(shield=True):
            signal_group_identity_checked(self.pid, self.pid, self.start_id, signal.SIGTERM)
            with trio.move_on_after(timing.stop_grace):
                await self._wait_exit()
            if not self.alive():
                return
            signal_group_identity_checked(self.pid, self.pid, self.start_id, signal.SIGKILL)
            with trio.move_on_after(timing.kill_confirm_timeout):
                await self._wait_exit()


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


@contextlib.contextmanager
def _fail_after(seconds: float, what: str) -> Iterator[None]:
    """``trio.fail_after`` that raises our ``worker_unavailable`` instead of TooSlowError."""
    try:
        with trio.fail_after(seconds):
            yield
    except trio.TooSlowError:
        raise AgentdError(
            ErrorCode.WORKER_UNAVAILABLE, f"could not {what} within {seconds:g}s"
        ) from None


async def _wait_pid_exit(pid: int | None) -> None:
    """Wait for a process that is not our child to exit: a pidfd where there is one."""
    if pid is None:
        return
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


def _tail(path: Path, lines: int = 5) -> str:
    data = _fs.read_bytes(path) or b""
    return " | ".join(data.decode(errors="replace").strip().splitlines()[-lines:]) or "(empty)"
