"""A fork server for workers, the supervisor's side: :class:`ForkServer` runs the
pre-imported *template* process (:mod:`._forktemplate`, which says what it does and why) and
asks it for workers.

The supervisor side (:class:`ForkServer`) runs the template in the service nursery, restarts
it when it dies (after ``fork_template_restart_delay``, doubling while it keeps dying before it
is ready) and answers ``None`` to :meth:`ForkServer.spawn` whenever it cannot fork — no
template (yet), a request that timed out, an environment whose interpreter settings differ
from the template's — so the caller execs the worker as before. The template exits when its
socket closes: with the supervisor, also on ``kill -9``.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno as _errno
import json
import logging
import math
import os
import signal
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from . import _earlytemplate
from ._earlytemplate import TEMPLATE_FLAG, isolated_python
from ._forktemplate import HEADER, MAX_MESSAGE, interpreter_env

# its timing: see trio_agentd.timing
from .timing import FORK_TEMPLATE_EXIT_POLL as EXIT_POLL
from .timing import FORK_TEMPLATE_EXIT_WAIT as EXIT_WAIT
from .timing import FORK_TEMPLATE_MAX_RESTART_DELAY as MAX_RESTART_DELAY
from .timing import FORK_TEMPLATE_READY_TIMEOUT as READY_TIMEOUT
from .timing import FORK_TEMPLATE_REQUEST_TIMEOUT as REQUEST_TIMEOUT
from .timing import MIN_WAKE, SPARE_RETRY_DELAY

TYPE_CHECKING = False
if TYPE_CHECKING:
    import trio

log = logging.getLogger("trio_agentd.supervisor")

class _EarlyProcess:
    """A template :mod:`._earlytemplate` started before the daemon's imports, with the little
    of ``trio.Process`` the fork server uses; its exit is waited for with a pidfd."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._child = _earlytemplate.Child(pid)

    @property
    def returncode(self) -> int | None:
        return self._child.poll()

    def kill(self) -> None:
        if self.returncode is None:  # (never a signal to a reaped pid, which may be reused)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def wait(self) -> int:
        import trio

        while (status := self.returncode) is None:
            try:
                fd = os.pidfd_open(self.pid)
            except OSError:
                await trio.sleep(EXIT_POLL)  # no pidfd to spare: look again
                continue
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                os.close(fd)
        return status


@dataclass(slots=True)
class _Pending:
    """One request's answer, in the order the requests were sent."""

    done: trio.Event
    reply: object = None


@dataclass(slots=True)
class Spare:
    """A spare worker: forked, parked on ``sock`` until it is given one session's start."""

    pid: int
    start_id: str | None
    sock: socket.socket
    interpreter: dict[str, str | None]


class ForkServer:
    """The template of one supervisor: started by :meth:`run` (in the service nursery),
    restarted when it dies, killed when :meth:`run` is cancelled.

    Requests are pipelined: each is sent whole (one sender at a time) and its answer is read,
    in order, by one reader task, so many spawns are forked back to back. A template that
    leaves a request unanswered for ``REQUEST_TIMEOUT`` is wedged: it is killed (every request
    waiting gets ``None``: exec) and started again. A caller cancelled while it waits simply
    stops waiting; the answer is read and dropped (a worker forked for it finds its stdin
    closed before the gate and exits).

    Spares (:meth:`take_spare`): while a template is ready, ``spare_target()`` spares are
    kept forked and parked (at least one; more after a burst of spawns, see :meth:`note_spawn`).
    A spare holds only ``/dev/null`` and its end of a socketpair whose other end only this
    object holds: it is given exactly one start, or exits when that socket closes — on a
    drop, on the supervisor's exit and on its ``kill -9`` alike.
    """

    def __init__(self, restart_delay: float, *, max_spares: int = 0,
                 demand_window: float = 10.0) -> None:
        import trio

        self.restart_delay = restart_delay
        self.pid: int | None = None  # the running template's
        self.ready = trio.Event()  # set while a template is ready; replaced when it dies
        self.starts = 0
        # set once the first template is ready or has failed: the first spawns wait for it
        self.settled = trio.Event()
        self._sock: trio.socket.SocketType | None = None
        self._env: dict[str, str] = {}
        self._send_lock = trio.Lock()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._wake = trio.Event()
        self._proc: trio.Process | _EarlyProcess | None = None
        self.max_spares = max_spares
        self.demand_window = demand_window
        self.spares: collections.deque[Spare] = collections.deque()
        self._demand: collections.deque[float] = collections.deque()  # spawn times, recent
        self._spares_changed = trio.Event()
        self.spares_used = 0
        # how many spares are parked now: ``await fs.parked.wait_value(lambda n: n > 0)``
        from trio_util import AsyncValue

        self.parked: AsyncValue[int] = AsyncValue(0)
        self._spare_failure: str | None = None  # the last cause logged

    async def run(self) -> None:
        """Keep a template running until cancelled (then kill it); never raises else."""
        import trio

        delay = self.restart_delay
        try:
            while True:
                ok = False
                try:
                    ok = await self._run_once()
                except* (OSError, ValueError) as group:
                    # (also from inside _run_once's nursery: its reader and spare tasks)
                    log.error("the worker fork template failed: %s",
                              "; ".join(str(e) for e in group.exceptions))
                finally:
                    self.settled.set()
                status = self._proc.returncode if self._proc is not None else None
                delay = self.restart_delay if ok else min(delay * 2, MAX_RESTART_DELAY)
                log.warning("the worker fork template exited (status %s); new workers are"
                            " exec'd until it is started again in %gs", status, delay)
                await trio.sleep(delay)
        finally:
            self._close()
            self.drop_spares()
            if self._proc is not None:
                with trio.move_on_after(EXIT_WAIT, shield=True):
                    await self._proc.wait()
                if self._proc.returncode is not None:
                    self._clear_scratch()

    def _clear_scratch(self) -> None:
        """Remove what the killed template left of a rehearsal run it was in (no later template
        may start to clear it: the supervisor is stopping)."""
        from ._scratch import clear_stale, root_of

        try:
            clear_stale(root_of(self._env))
        except OSError as exc:
            log.warning("the worker fork template's rehearsal scratch directory could not be"
                        " removed: %s", exc)

    async def _run_once(self) -> bool:
        """Start a template and wait for it to exit; whether it ever got ready.

        Raises:
            OSError: it could not be started (no descriptors, no processes left…).
            ValueError: it answered garbage.
        """
        import trio

        self._proc = None
        early = _earlytemplate.take()
        if early is not None:
            ours = socket.socket(fileno=early.sock_fd)
            self._env = early.env
            self._proc = _EarlyProcess(early.pid)
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._env = dict(os.environ)
            try:
                self._proc = await trio.lowlevel.open_process(
                    [*isolated_python("trio_agentd.worker"), TEMPLATE_FLAG],
                    stdin=theirs.fileno(), stdout=subprocess.DEVNULL, cwd="/", env=self._env,
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
        self.starts += 1
        self._sock = trio.socket.from_stdlib_socket(ours)
        ok = False
        try:
            with trio.move_on_after(READY_TIMEOUT):
                reply = await self._read_reply()
                ok = isinstance(reply, dict) and reply.get("ready") == self._proc.pid
            if ok:
                self.pid = self._proc.pid
                self.ready.set()
            else:
                log.error("the worker fork template did not start (its errors, if any, are"
                          " above); new workers are exec'd")
                self._proc.kill()
            self.settled.set()
            async with trio.open_nursery() as nursery:
                if ok:
                    nursery.start_soon(self._read_replies, self._proc)
                    if self.max_spares > 0:
                        nursery.start_soon(self._keep_spares_logged)
                await self._proc.wait()
                nursery.cancel_scope.cancel()
            return ok
        finally:
            self._close()

    def _close(self) -> None:
        import trio

        self.pid = None
        if self.ready.is_set():
            self.ready = trio.Event()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        while self._pending:  # the template is gone: nobody answers these (exec instead)
            self._pending.popleft().done.set()
        if self._proc is not None and self._proc.returncode is None:
            # cancelled (the supervisor stops): the template goes too (its socket is closed
            # anyway; it would exit on its own)
            with contextlib.suppress(OSError):
                self._proc.kill()

    def _wedged(self, proc: trio.Process | _EarlyProcess) -> None:
        import trio

        with contextlib.suppress(OSError):
            proc.kill()
        if self.ready.is_set():
            self.ready = trio.Event()
        while self._pending:
            self._pending.popleft().done.set()

    async def _read_replies(self, proc: trio.Process | _EarlyProcess) -> None:
        """Answer the pending requests in order; a template silent for ``REQUEST_TIMEOUT``
        with a request pending (or answering garbage) is killed."""
        import trio

        while True:
            while not self._pending:
                await self._wake.wait()
                self._wake = trio.Event()
            reply: object = None
            with trio.move_on_after(REQUEST_TIMEOUT):
                try:
                    reply = await self._read_reply()
                except (OSError, ValueError, trio.ClosedResourceError,
                        trio.BrokenResourceError):
                    reply = None
            if not isinstance(reply, dict):
                log.warning("the worker fork template did not answer; exec'ing workers until"
                            " it is started again")
                self._wedged(proc)
                return
            if self._pending:
                head = self._pending.popleft()
                head.reply = reply
                head.done.set()

    async def _read_reply(self) -> object:
        assert self._sock is not None
        head = await self._recv_exactly(HEADER.size)
        if head is None:
            return None
        (size,) = HEADER.unpack(head)
        if size > MAX_MESSAGE:
            return None
        body = await self._recv_exactly(size)
        return None if body is None else json.loads(body)

    async def _recv_exactly(self, n: int) -> bytes | None:
        assert self._sock is not None
        buf = b""
        while len(buf) < n:
            chunk = await self._sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def usable_for(self, env: Mapping[str, str]) -> bool:
        return self.ready.is_set() and interpreter_env(env) == interpreter_env(self._env)

    async def _request(self, body: bytes, fds: list[int]) -> dict[str, object] | None:
        """Send one request and wait for its answer; ``None`` when no template answers."""
        import trio

        data = HEADER.pack(len(body)) + body
        pending = _Pending(trio.Event())
        async with self._send_lock:
            sock, proc = self._sock, self._proc
            if sock is None or proc is None or not self.ready.is_set():
                return None
            # queued before the first byte goes: the reader may read the answer before this
            # task runs again
            self._pending.append(pending)
            self._wake.set()
            try:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = await sock.sendmsg([data], anc)
                while sent < len(data):  # a big environment: the rest
                    sent += await sock.send(data[sent:])
            except (OSError, trio.ClosedResourceError, trio.BrokenResourceError):
                self._wedged(proc)
                return None
            except BaseException:
                # cancelled halfway: the stream is garbled, the template goes (and restarts)
                self._wedged(proc)
                raise
        await pending.done.wait()
        return pending.reply if isinstance(pending.reply, dict) else None

    async def spawn(self, env: Mapping[str, str], fds: tuple[int, int, int]) -> int | None:
        """Fork a worker with these stdin, stdout and stderr descriptors (the caller keeps
        and closes them) and this environment; its pid, or ``None`` when no template can
        fork it now (the caller execs the worker).

        Raises:
            OSError: the template could not fork (EAGAIN, ENOMEM…).

        Cancellation: the caller stops waiting; the template forks anyway, and that worker
        exits at once (the caller closes its stdin).
        """
        if not self.usable_for(env):
            return None
        body = json.dumps({"env": dict(env)}).encode()
        if len(body) > MAX_MESSAGE:
            return None
        reply = await self._request(body, list(fds))
        if reply is None:
            return None
        pid = reply.get("pid")
        if isinstance(pid, int) and pid > 0:
            return pid
        code = reply.get("errno")
        raise OSError(code if isinstance(code, int) else _errno.EIO,
                      str(reply.get("error") or "fork failed"))

    # spares ---------------------------------------------------------------------------------
    def note_spawn(self, now: float) -> None:
        """A worker is being started: counted in the recent demand the spares are sized by."""
        self._demand.append(now)
        self._spares_changed.set()

    def spare_target(self, now: float) -> int:
        """How many spares to keep: the starts of the last ``demand_window`` (at least one),
        at most ``max_spares``."""
        while self._demand and now - self._demand[0] >= self.demand_window:
            self._demand.popleft()
        return max(1, min(len(self._demand), self.max_spares)) if self.max_spares else 0

    def take_spare(self, env: Mapping[str, str]) -> Spare | None:
        """A parked spare that can start a worker with ``env`` (it is no longer in the pool:
        nobody else gets it), or ``None``."""
        wanted = interpreter_env(env)
        for spare in list(self.spares):
            if spare.interpreter == wanted:
                self.spares.remove(spare)
                self.parked.value = len(self.spares)
                self._spares_changed.set()
                return spare
        return None

    async def start_spare(self, spare: Spare, env: Mapping[str, str],
                          fds: tuple[int, int, int]) -> bool:
        """Give ``spare`` its one start: these descriptors and this environment. ``False``
        when it cannot take it (gone, or not the process it was); it is closed either way."""
        import trio

        from ._identity import read_start_id

        body = json.dumps({"env": dict(env)}).encode()
        data = HEADER.pack(len(body)) + body
        try:
            if len(body) > MAX_MESSAGE or read_start_id(spare.pid) != spare.start_id:
                return False
            sock = trio.socket.from_stdlib_socket(spare.sock)
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = await sock.sendmsg([data], anc)
            while sent < len(data):
                sent += await sock.send(data[sent:])
        except OSError as exc:
            log.info("spare worker pid %s could not take a start (%s); forking one",
                     spare.pid, exc)
            return False
        finally:
            spare.sock.close()  # it reads one request: this end is of no more use
        self.spares_used += 1
        return True

    def drop_spares(self) -> None:
        """Close every spare's socket: each exits at once."""
        while self.spares:
            self.spares.popleft().sock.close()
        self.parked.value = 0

    def _spare_error(self, exc: OSError) -> None:
        """Logged once per cause until a spare is forked again (out of descriptors, the
        same error comes every retry)."""
        cause = f"{exc.errno}:{exc}"
        if cause != self._spare_failure:
            log.warning("could not fork a spare worker: %s; worker starts fork as they come",
                        exc)
        self._spare_failure = cause

    async def _keep_spares_logged(self) -> None:
        """:meth:`_keep_spares`; a bug there costs the spares, never the template or the
        supervisor (logged with its traceback)."""
        try:
            await self._keep_spares()
        except Exception:
            log.exception("spare workers: stopped keeping them (worker starts fork as they"
                          " come)")
            self.drop_spares()

    async def _keep_spares(self) -> None:
        """While this template runs: fork spares up to the target, drop those beyond it."""
        import trio

        from ._identity import read_start_id

        while True:
            now = trio.current_time()
            target = self.spare_target(now)
            while len(self.spares) > target:
                self.spares.pop().sock.close()
                self.parked.value = len(self.spares)
            if len(self.spares) < target and self.usable_for(self._env):
                try:
                    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                except OSError as exc:
                    # out of descriptors (or memory): no spare for now; starts fork as before
                    self._spare_error(exc)
                    await trio.sleep(max(self.restart_delay, SPARE_RETRY_DELAY))
                    continue
                try:
                    reply = await self._request(json.dumps({"spare": True}).encode(),
                                                [theirs.fileno()])
                except BaseException:
                    ours.close()  # cancelled: a spare forked meanwhile sees EOF and exits
                    raise
                finally:
                    theirs.close()
                pid = None if reply is None else reply.get("pid")
                if not isinstance(pid, int) or pid <= 0:
                    ours.close()
                    if reply is not None:
                        self._spare_error(OSError(reply.get("errno") or 0,
                                                  str(reply.get("error") or "fork failed")))
                    await trio.sleep(max(self.restart_delay, SPARE_RETRY_DELAY))
                    continue
                self.spares.append(Spare(pid, read_start_id(pid), ours,
                                         interpreter_env(self._env)))
                self.parked.value = len(self.spares)
                self._spare_failure = None
                continue
            self._spares_changed = trio.Event()
            # the demand ages out: look again once the oldest start leaves the window
            wait = (self._demand[0] + self.demand_window - now) if self._demand else math.inf
            with trio.move_on_after(max(wait, MIN_WAKE)):
                await self._spares_changed.wait()
