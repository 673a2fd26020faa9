"""The ``exec:COMMAND`` agent, and the per-turn process runner it shares with ``shell``.

Theory of operation. Each turn starts one child in a new session, so the child leads its own
process group (pgid == its pid) and everything it spawns joins that group unless it detaches on
purpose (``setsid``). The group is the turn's: when the turn ends — normally, by an error or by
cancellation — whatever is left of it is killed and the leader is reaped. The runner never reaps
the leader before it is done signalling the group: an unreaped (zombie) leader keeps its pid, so
``killpg(leader_pid)`` cannot reach an unrelated group that reused the number. It waits for the
leader's exit on its own pidfd instead, which does not reap.

No orphans: the leader starts as a tiny ``/bin/sh`` gate that waits for one line on its stdin
before it becomes the real program by ``exec`` (same pid, group and start id). In between, the
runner tells ``ctx.on_group`` the group's identity (the worker journals it), and only then
writes the line. So every group that ever runs an agent's work is in the journal; a worker
killed mid-turn leaves it running (nobody else stops it), and the worker that starts next for
the session stops it (:func:`stop_orphan_group`, identity-checked). A worker killed before the
line is written closes the pipe, and the gate exits having run nothing.

Output is read from two pipes, stdout and stderr, and yielded chunk by chunk as it arrives
(stderr as :class:`Stderr` pieces); the turn lasts until both pipes are closed by every holder
*and* the leader has exited (as ``$(...)`` in a shell does), and ends with the leader's
:class:`ExitStatus`; to a host that takes them (``ctx.pipes``), output waiting in a pipe is
offered as :class:`Waiting` instead of read. The prompt of an ``exec`` turn goes to the child's
stdin through a pipe. Writing it must not wait for the child to read it all: a child that writes
a lot before reading the rest (``cat`` with a large prompt) would fill its stdout pipe while we
sit on a full stdin pipe. So the writer runs next to every wait for output, in a nursery that
closes before each chunk is yielded (a nursery must not stay open across a ``yield`` of an async
generator), and it is resumable: it writes with non-blocking ``os.write`` and keeps its own
offset, so cancelling it loses nothing.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import subprocess
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import trio

from .._defaults import CLOSE_TIMEOUT
from .._errors import AgentdError, ErrorCode
from .._identity import (
    GroupIdentity,
    group_alive,
    kill_group_members,
    read_start_id,
    signal_group_identity_checked,
)
from ._base import AgentStartError, Chunk, ExitStatus, Stderr, TurnContext, Waiting

_T = TypeVar("_T")

KILL_GRACE = 2.0
"""Seconds between SIGTERM and SIGKILL of a cancelled turn's process group.

Well under the supervisor's ``stop_grace``, so a worker told to stop still cleans up its
children before the supervisor escalates on the worker itself.
"""

_REAP_BOUND = 2.0
"""Seconds allowed, after SIGKILL, for the leader to be reaped (it cannot ignore SIGKILL; this
only bounds a process stuck in the kernel)."""

_READ_SIZE = 256 * 1024  # one output chunk (CHUNK_MAX) per read, when that much is waiting
_PIPE_SIZE = 1 << 20
_TERM_GRACE = 0.1  # between SIGTERM and SIGKILL, once SIGINT's grace ran out
_WRITE_SIZE = 65536


def child_environment(ctx: TurnContext) -> dict[str, str]:
    """The worker's environment plus the variables that tell a child which turn it serves."""
    return {
        **os.environ,
        "TRIO_AGENTD_SESSION": ctx.session_id,
        "TRIO_AGENTD_TURN": str(ctx.turn),
    }


CANNOT_RUN, NOT_FOUND = 126, 127
"""The exit status a spawn error reports (as a shell's for a command it cannot run / find)."""


def _spawn_error(argv: Sequence[str], cwd: Path, exc: OSError) -> AgentStartError:
    """Name what could not be started and how to fix it (one line: cause and fix)."""
    if exc.filename is not None and os.fsdecode(exc.filename) == os.fsdecode(cwd):
        return AgentStartError(
            ErrorCode.BAD_REQUEST,
            f"cannot run {argv[0]!r} in the session's directory {cwd}: {exc.strerror} — create"
            " the directory or start the session with another --cwd",
        )
    name = argv[0]
    if isinstance(exc, FileNotFoundError):
        where = (
            f"at {name!r} (relative to {cwd})"
            if "/" in name
            else f"named {name!r} on PATH"
        )
        return AgentStartError(
            ErrorCode.BAD_REQUEST,
            f"agent exec:{shlex.join(argv)}: no executable {where} — install it, or name it by"
            f" its full path (exec:/full/path/to/{os.path.basename(name)} ...)",
            {"exit_status": NOT_FOUND},
        )
    if isinstance(exc, PermissionError):
        return AgentStartError(
            ErrorCode.BAD_REQUEST,
            f"agent exec:{shlex.join(argv)}: {name!r} is not executable ({exc.strerror}) — make"
            f" it executable (chmod +x) or name another program",
            {"exit_status": CANNOT_RUN},
        )
    return AgentStartError(
        ErrorCode.BAD_REQUEST,
        f"agent exec:{shlex.join(argv)}: cannot start {name!r}: {exc} — check the command",
    )


_GATE = b"go\n"
_GATE_SCRIPT = 'read -r _ || exit 125; exec "$@"'
_GATE_SCRIPT_NO_STDIN = 'read -r _ || exit 125; exec </dev/null; exec "$@"'
"""The turn's leader starts as this tiny ``/bin/sh`` gate: it reads one line (:data:`_GATE`)
from its stdin pipe before it becomes the agent's program (``exec``: same pid, group and start
id). The worker writes that line, ahead of the prompt, only once the group's identity is
journaled; ``read`` takes a pipe byte by byte, so the program gets exactly the prompt. A worker
killed before that closes the pipe's other end, and the gate exits without running anything."""


def _resolve_error(argv: Sequence[str], cwd: Path, env: dict[str, str]) -> OSError | None:
    """What ``execvp`` would fail with for ``argv[0]`` in ``cwd``, checked before the gate
    starts (the gate's ``exec`` could only report it as an exit status)."""
    if not os.path.isdir(cwd):
        err = FileNotFoundError if not os.path.exists(cwd) else NotADirectoryError
        return err(2 if err is FileNotFoundError else 20,
                   os.strerror(2 if err is FileNotFoundError else 20), os.fspath(cwd))
    name = argv[0]
    candidates = [name] if "/" in name else [
        os.path.join(d, name) for d in os.get_exec_path(env)
    ]
    denied = False
    for cand in candidates:
        path = os.path.join(cwd, cand)
        if not os.path.exists(path):
            continue
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return None
        denied = True
    if denied:
        return PermissionError(13, os.strerror(13), name)
    return FileNotFoundError(2, os.strerror(2), name)


class _StdinFeeder:
    """Writes the prompt into the child's stdin pipe, then closes the pipe.

    Resumable: ``run`` may be cancelled at any checkpoint and called again later, losing nothing,
    because it keeps its own offset and never writes through a stream that a cancelled
    ``send_all`` would leave in an unknown state.
    """

    def __init__(self, fd: int, data: bytes) -> None:
        os.set_blocking(fd, False)
        self._fd: int | None = fd
        self._data = memoryview(data)
        self._sent = 0

    @property
    def done(self) -> bool:
        return self._fd is None

    async def run(self) -> None:
        """Write until everything is written (then close) or the child closes its end.

        Cancellation: stops between writes; what was written stays written.
        """
        while self._fd is not None:
            if self._sent >= len(self._data):
                self.close()
                break
            await trio.lowlevel.wait_writable(self._fd)
            try:
                self._sent += os.write(self._fd, self._data[self._sent : self._sent + _WRITE_SIZE])
            except BlockingIOError:
                continue
            except BrokenPipeError:
                # the child closed its stdin: it does not want the rest
                self.close()

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            trio.lowlevel.notify_closing(fd)
            os.close(fd)


class _GroupRun:
    """One started child leading its own process group, and the plumbing around it."""

    def __init__(
        self, name: str, proc: trio.Process, pidfd: int, feeder: _StdinFeeder | None,
    ) -> None:
        self.name = name
        self.proc = proc
        # the output pipes still open, each read raw (non-blocking) from its descriptor
        self.pipes: dict[bool, trio.lowlevel.FdStream] = {}  # is stderr → its pipe
        for is_err, pipe in ((False, proc.stdout), (True, proc.stderr)):
            if pipe is not None:
                assert isinstance(pipe, trio.lowlevel.FdStream)
                self.pipes[is_err] = pipe
                widen_pipe(pipe.fileno())
        self.pidfd = pidfd
        self.feeder = feeder
        self.leader_exited = False
        self.returncode: int | None = None

    @classmethod
    async def start(
        cls, argv: Sequence[str], *, ctx: TurnContext, stdin: bytes | None, merge_stderr: bool
    ) -> _GroupRun:
        """Start ``argv`` in its own session; on failure nothing is left running or open.

        Returns with no checkpoint after the process exists, so a caller that enters its
        ``try``/``finally`` right away cannot lose the process to a cancellation.

        Raises:
            AgentdError: ``bad_request`` if the program or the directory cannot be used.
        """
        env = child_environment(ctx)
        if (not_runnable := _resolve_error(argv, ctx.cwd, env)) is not None:
            raise _spawn_error(argv, ctx.cwd, not_runnable)
        child_stdin, write_end = os.pipe()  # both ends close-on-exec; Popen dups ours to 0
        feeder = _StdinFeeder(write_end, _GATE + stdin) if stdin is not None else None
        script = _GATE_SCRIPT if stdin is not None else _GATE_SCRIPT_NO_STDIN
        try:
            try:
                proc = await trio.lowlevel.open_process(
                    ["/bin/sh", "-c", script, "sh", *argv],
                    stdin=child_stdin,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                    cwd=ctx.cwd,
                    env=env,
                    start_new_session=True,
                )
            finally:
                os.close(child_stdin)
        except OSError as exc:
            _close_gate(write_end, feeder)
            raise _spawn_error(argv, ctx.cwd, exc) from None
        except BaseException:
            _close_gate(write_end, feeder)
            raise
        assert proc.stdout is not None
        pidfd = -1
        try:
            pidfd = os.pidfd_open(proc.pid)
            if ctx.on_group is not None:
                ctx.on_group(GroupIdentity(proc.pid, proc.pid, read_start_id(proc.pid)))
            if feeder is None:
                os.write(write_end, _GATE)  # an empty pipe has room: never blocks
                os.close(write_end)
            # else the feeder writes the gate line ahead of the prompt
        except Exception as exc:  # no checkpoint above: never Cancelled
            # nothing of the agent ran (the gate still waits): kill the group now, while its
            # pid is still held by the unreaped leader, and give up
            _signal_group(proc.pid, signal.SIGKILL)
            _close_gate(write_end, feeder)
            with trio.move_on_after(_REAP_BOUND, shield=True):
                await proc.wait()
                await proc.stdout.aclose()
                if proc.stderr is not None:
                    await proc.stderr.aclose()
            if pidfd >= 0:
                os.close(pidfd)
            if isinstance(exc, OSError):
                raise AgentdError(
                    ErrorCode.INTERNAL, f"cannot start the process of {argv[0]!r}: {exc}"
                ) from None
            raise
        return cls(argv[0], proc, pidfd, feeder)

    async def _feeding(self, wait: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``wait`` while the prompt is still being written; the writer stops when it ends."""
        feeder = self.feeder
        if feeder is None or feeder.done:
            return await wait()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(feeder.run)
                result = await wait()
                nursery.cancel_scope.cancel()
        except* (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as group:
            # not an ExceptionGroup out of an agent; Cancelled is left to trio
            raise AgentdError(
                ErrorCode.INTERNAL,
                f"the pipes to {self.name!r} (pid {self.proc.pid}) failed: {group.exceptions[0]}",
            ) from group
        return result

    async def receive(self, pipes: bool = False) -> tuple[bool, bytes | Waiting]:
        """The next piece of output from either pipe, as ``(from stderr, data)``; ``b""`` once
        nobody holds either pipe any more. With ``pipes``, output waiting in a pipe comes as a
        :class:`Waiting` for the host to read."""
        return await self._feeding(functools.partial(self._read_either, pipes))

    async def _read_either(self, pipes: bool) -> tuple[bool, bytes | Waiting]:
        await trio.lowlevel.checkpoint_if_cancelled()
        while self.pipes:
            for is_err, pipe in list(self.pipes.items()):
                if pipes and (count := available(pipe.fileno())) > 0:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return is_err, Waiting(pipe.fileno(), count, stderr=is_err)
                try:
                    data = os.read(pipe.fileno(), _READ_SIZE)
                except BlockingIOError:
                    continue
                if not data:  # every holder closed it
                    del self.pipes[is_err]
                    await pipe.aclose()
                    continue
                await trio.lowlevel.cancel_shielded_checkpoint()
                return is_err, data
            if self.pipes:
                await first_readable([p.fileno() for p in self.pipes.values()])
        return False, b""

    async def wait_leader_exit(self) -> None:
        """Wait until the leader has exited, without reaping it (see the module docstring)."""

        async def leader_exit() -> None:
            await trio.lowlevel.wait_readable(self.pidfd)

        await self._feeding(leader_exit)
        self.leader_exited = True

    async def finish(self, grace: float) -> None:
        """Kill what is left of the group, reap the leader, close every descriptor.

        A leader still running (a cancelled turn, as Ctrl-C at a terminal) gets SIGINT with the
        rest of its group and ``grace`` seconds to exit, then SIGTERM and, a moment later,
        SIGKILL, which also takes any member that outlived its leader (nothing started by a
        turn outlives it). The caller bounds and shields this.

        Cancellation: must not be; the caller shields it. Cut short by the caller's bound, the
        descriptors are still closed but the leader may stay unreaped.
        """
        try:
            if self.feeder is not None:
                self.feeder.close()
            pgid = self.proc.pid
            if not self.leader_exited:
                _signal_group(pgid, signal.SIGINT)
                with trio.move_on_after(grace) as waited:
                    await trio.lowlevel.wait_readable(self.pidfd)
                if waited.cancelled_caught:
                    _signal_group(pgid, signal.SIGTERM)
                    with trio.move_on_after(_TERM_GRACE):
                        await trio.lowlevel.wait_readable(self.pidfd)
            _signal_group(pgid, signal.SIGKILL)
            self.returncode = await self.proc.wait()
        finally:
            trio.lowlevel.notify_closing(self.pidfd)
            os.close(self.pidfd)
            with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
                for pipe in self.pipes.values():
                    await pipe.aclose()
                self.pipes.clear()


def available(fd: int) -> int:
    """Bytes waiting in pipe ``fd`` (``FIONREAD``)."""
    import fcntl
    import termios

    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), "little")


def widen_pipe(fd: int) -> None:
    """Give an output pipe room for more than the default 64 KiB, so a fast writer fills it
    while we send, and we read it in fewer, bigger pieces. Optional: beyond the system's
    pipe-max-size it stays as it was."""
    import fcntl

    with contextlib.suppress(OSError):  # EPERM past /proc/sys/fs/pipe-max-size; harmless
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)


async def first_readable(fds: list[int]) -> int:
    """The first of ``fds`` to turn readable (one wait, no task, for a single fd)."""
    if len(fds) == 1:
        await trio.lowlevel.wait_readable(fds[0])
        return fds[0]
    ready: list[int] = []
    async with trio.open_nursery() as nursery:

        async def wait(fd: int) -> None:
            await trio.lowlevel.wait_readable(fd)
            ready.append(fd)
            nursery.cancel_scope.cancel()

        for fd in fds:
            nursery.start_soon(wait, fd)
    return ready[0]


def _close_gate(write_end: int, feeder: _StdinFeeder | None) -> None:
    if feeder is not None:
        feeder.close()  # closes write_end
    else:
        with contextlib.suppress(OSError):
            os.close(write_end)


def _signal_group(pgid: int, sig: int) -> None:
    # the group may be empty already, or hold nothing we may signal
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def run_command(
    argv: Sequence[str],
    ctx: TurnContext,
    *,
    stdin: bytes | None,
    merge_stderr: bool,
    kill_grace: float = KILL_GRACE,
) -> AsyncGenerator[Chunk, None]:
    """Run ``argv`` as one turn, yielding its output bytes as they arrive, exactly.

    Args:
        argv: the program and its arguments (no shell).
        ctx: the turn; its ``cwd`` is the child's directory, its ids go into the environment.
        stdin: bytes for the child's stdin, or ``None`` for ``/dev/null``.
        merge_stderr: send the child's stderr into the output (one pipe keeps the order the
            two were written in); otherwise it comes as :class:`Stderr` pieces of its own.
        kill_grace: seconds between SIGTERM and SIGKILL when the turn is cancelled.

    Output is passed on byte for byte (binary-safe). The last item is the leader's
    :class:`ExitStatus` (negative: killed by that signal); a failing program is a reply with a
    status, not an error.

    Raises:
        AgentdError: ``bad_request`` if the program or the directory cannot be used.

    Cancellation: the process group gets SIGTERM, then SIGKILL after ``kill_grace`` seconds,
    and the leader is reaped, all in a shielded scope bounded by ``kill_grace`` plus a few
    seconds. The same happens when the generator is closed early (``aclose``, or trio's
    finalizer for a generator dropped unexhausted).
    """
    run = await _GroupRun.start(argv, ctx=ctx, stdin=stdin, merge_stderr=merge_stderr)
    try:
        while True:
            is_err, data = await run.receive(ctx.pipes)
            if isinstance(data, Waiting):
                yield data
                continue
            if not data:
                break
            yield Stderr(data) if is_err else data
        await run.wait_leader_exit()
    finally:
        with trio.move_on_after(kill_grace + _REAP_BOUND, shield=True):
            await run.finish(kill_grace)
    if run.returncode is None:
        raise AgentdError(
            ErrorCode.INTERNAL, f"the process of {argv[0]!r} (pid {run.proc.pid}) was not reaped"
        )
    yield ExitStatus(run.returncode)


class ExecAgent:
    """``exec:COMMAND``: any command-line program as an agent, one process per prompt.

    Not replayable: the program may have had effects that running it again would repeat.
    """

    replayable = False

    def __init__(self, argv: Sequence[str], *, kill_grace: float = KILL_GRACE) -> None:
        if not argv or not argv[0]:
            raise AgentdError(ErrorCode.BAD_REQUEST, "exec agent needs a command, e.g. exec:cat")
        self.argv = tuple(argv)
        self.kill_grace = kill_grace

    def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[Chunk]:
        """Run the command with the prompt on its stdin (then closed); yield its stdout, its
        stderr as :class:`Stderr` pieces, and last its :class:`ExitStatus`.

        The command runs in ``ctx.cwd`` with the session's environment plus
        ``TRIO_AGENTD_SESSION`` and ``TRIO_AGENTD_TURN``.

        Raises:
            AgentdError: ``bad_request`` (on first iteration) if the program is not found or
                not executable, naming it and the fix.

        Cancellation: the command's whole process group gets SIGTERM, then SIGKILL after
        ``kill_grace`` seconds, and is reaped before the cancellation propagates; nothing of
        the turn keeps running.
        """
        return run_command(
            self.argv, ctx, stdin=prompt.encode(errors="surrogateescape"), merge_stderr=False,
            kill_grace=self.kill_grace,
        )


ORPHAN_GRACE = 1.0
"""Seconds an orphaned group gets between SIGTERM and SIGKILL at a worker's start."""

_ORPHAN_POLL = 0.02


async def stop_orphan_group(group: GroupIdentity, *, grace: float = ORPHAN_GRACE) -> str:
    """Stop a turn's process group that outlived its worker (SIGTERM, ``grace``, SIGKILL).

    Identity-checked: only a group whose leader is still the recorded incarnation is signalled;
    a gone (or reused) leader means the group is left alone. Returns what happened:
    ``"gone"`` (nothing to stop), ``"stopped"`` (it exited on SIGTERM), ``"killed"`` (it needed
    SIGKILL), or ``"alive"`` (something of it still runs after SIGKILL, bounded wait).

    Cancellation: stops waiting; whatever was signalled stays signalled.
    """
    if not signal_group_identity_checked(group.pgid, group.pid, group.start_id, signal.SIGTERM):
        return "gone"
    if await _gone_within(group, grace):
        return "stopped"
    # the leader is the group's identity: while it runs, the whole group; once it is gone,
    # the members still in its group and session, each pinned by a pidfd
    if not signal_group_identity_checked(group.pgid, group.pid, group.start_id,
                                         signal.SIGKILL):
        kill_group_members(group, signal.SIGKILL)
    return "killed" if await _gone_within(group, _REAP_BOUND) else "alive"


async def _gone_within(group: GroupIdentity, seconds: float) -> bool:
    """Poll (an orphan is nobody's child: no pidfd of ours could tell when its members
    exit) until nothing of the group runs; ``False`` once ``seconds`` ran out."""
    deadline = trio.current_time() + seconds
    while True:
        if not _members_running(group):
            return True
        if trio.current_time() >= deadline:
            return False
        await trio.sleep(_ORPHAN_POLL)


def _leader_running(group: GroupIdentity) -> bool:
    sid = read_start_id(group.pid)
    return sid is not None and sid == group.start_id and not _zombie(group.pid)


def _members_running(group: GroupIdentity) -> bool:
    """Does any non-zombie process still belong to the group? (Zombies wait for a reaper
    that may never come: an orphan's parent is init, or whatever subreaper adopted it.)"""
    if not group_alive(group.pgid):
        return False
    return _leader_running(group) or bool(kill_group_members(group, 0))


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2 :][:1] in (b"Z", b"X")
