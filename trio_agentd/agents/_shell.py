"""The ``shell`` agent: one ``/bin/sh`` per session, each prompt a command line typed into it.

What a user gets. ``cd``, variables, functions, aliases and background jobs carry over from one
prompt to the next, as in a terminal. Each prompt's stdout is yielded as ``bytes``, its stderr
as :class:`Stderr` pieces, and its exit status (the shell's ``$?``) last as :class:`ExitStatus`.
A prompt with a syntax error runs nothing and ends with status 2. ``exit`` ends the shell: the
prompt ends with the shell's exit status, and the next prompt starts a new shell.

Design (no in-band marker). The shell is started once, in its own session (so it leads its own
process group), with

- stdin ``/dev/null`` (every command's stdin), stdout and stderr on two pipes of their own that
  live as long as the shell;
- a Unix socketpair as its control channel, moved by the bootstrap script to fd
  :data:`CONTROL_FD`. The worker sends each prompt on it as a header line ``SEQ TURN LINES``
  followed by the prompt split at its newlines into exactly ``LINES`` lines (the shell joins
  them back, so the text arrives exactly, whatever it contains); the shell answers
  ``R<seq>\\0`` once it has read the whole prompt and ``S<seq>\\0<status>\\0<cwd>\\0`` once the
  command line has finished. A path cannot contain NUL, so the answer cannot be misread.

Every command runs with the control fd closed (a redirection on the function that runs the
prompt with ``eval``, undone afterwards), so no program it starts can read a prompt or write an
answer; nothing the command prints, on either stream, can end the turn. The turn ends when the
status arrives; output already written by then (everything the command's processes wrote before
they exited) is drained, by the byte count the pipes hold at that moment, before the status is
yielded; what background jobs write between prompts is dropped at the start of the next prompt
(and logged), so one prompt's output never shows up in the next one's. The reads only use
builtins (``read``, ``printf``, ``eval``), so a prompt that empties ``PATH`` or defines
functions called ``read`` or ``printf`` does not break the loop. Fd :data:`CONTROL_FD` is the
shell's: a prompt may use it, but what it opens there is closed again when the prompt ends.

Cancel (the turn's cancel scope: Ctrl-C on ``trio-agentd -p``, ``trio-agentd cancel``) stops
the command, not the shell: the shell and every process the turn started get SIGINT. The shell
traps INT and TERM (re-armed before every prompt, so a prompt's own traps of them last until
the next prompt) and returns from the function that runs the prompt with ``eval``, so the
rest of the command line does not run; in a function the prompt itself defined, only that function
returns, and the escalation below ends the rest. Background jobs of earlier prompts are not
signalled, as at a terminal: a process belongs to the turn if it is in the shell's group and
started no earlier than the turn did, in the clock ticks of ``/proc/PID/stat``; a turn starts
in a later tick than the shell's last answer (a prompt sent within that tick waits for the
next, at most one tick), so a process of an earlier turn never shares the turn's tick. (A
process's environment cannot tell: a shell's fork that has not exec'd yet, or a subshell that
never does, shows the shell's own environment from its start.) After ``kill_grace`` seconds
without an answer the turn's processes get SIGTERM (the shell too, which traps it), then
SIGKILL; once the shell answers, whatever the turn started that still runs gets SIGTERM and,
a moment later, SIGKILL. A shell that still does not answer (it was killed, or ignores both
signals) is killed with its whole group and reaped, and the next prompt starts a new one; so
is a shell cut off while it was still being sent the prompt (it had not started the command).

Orphans and restarts. Every turn tells ``ctx.on_group`` the shell's process group (the same
one, turn after turn) before it sends the prompt, so a worker killed mid-turn leaves a journaled
group that the next worker stops. A worker that dies closes its end of the control socket: an
idle shell reads EOF and exits, and on any exit of its own the shell sends SIGHUP to its group
(background jobs end as at a closed terminal; ``nohup`` ones stay). The shell's cwd after every
prompt is kept in ``<session dir>/shell.cwd`` (atomically replaced when it changes); a new shell
(the worker restarted, or the old shell exited or had to be killed) starts there, or in the
session's directory if that is gone, and the first answer of a new shell in a session that had
one begins with a one-line :class:`Stderr` notice saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path

import trio

from .._errors import AgentdError, ErrorCode
from .._fs import atomic_write, read_bytes
from .._identity import GroupIdentity, read_start_id
from ._base import Chunk, ExitStatus, Stderr, TurnContext, Waiting
from ._exec import (
    KILL_GRACE,
    _spawn_error,
    available,
    child_environment,
    first_readable,
    widen_pipe,
)

log = logging.getLogger("trio_agentd.agents.shell")

SHELL = "/bin/sh"
CONTROL_FD = 8
"""The shell's end of the control socket (a one-digit fd: ``dash`` takes no other)."""

CWD_FILE = "shell.cwd"
"""In the session's directory: the shell's cwd after its last prompt, as raw bytes."""

_READ_SIZE = 256 * 1024  # one output chunk per read, when that much is waiting (no Waiting)
_TERM_GRACE = 0.1  # between SIGTERM and SIGKILL, once SIGINT's grace ran out
_ANSWER_BOUND = 2.0  # for the shell to answer after what it ran got SIGKILL
_CLOSE_BOUND = 2.0  # for a shell to exit once its control socket is closed
_CONTROL_MAX = 65536  # the longest answer the shell may send (its cwd is at most PATH_MAX)

# The bootstrap. Names start with __trio_agentd_ so that no user variable collides. A trapped
# signal interrupts dash's ``read`` (status 1, as at EOF): ``sig`` tells the two apart.
_BOOTSTRAP = f"""\
exec {CONTROL_FD}<&0 </dev/null
__trio_agentd_nl='
'
__trio_agentd_busy=0
__trio_agentd_sig=0
__trio_agentd_traps() {{
  trap '__trio_agentd_sig=1
    [ "$__trio_agentd_busy" = 1 ] && {{ __trio_agentd_busy=0; return 130; }}' INT
  trap '__trio_agentd_sig=1
    [ "$__trio_agentd_busy" = 1 ] && {{ __trio_agentd_busy=0; return 143; }}' TERM
}}
__trio_agentd_traps
trap 'trap "" HUP; kill -HUP 0 2>/dev/null' EXIT
__trio_agentd_run() {{
  __trio_agentd_busy=1
  eval "$__trio_agentd_cmd"
  __trio_agentd_st=$?
  __trio_agentd_busy=0
  return "$__trio_agentd_st"
}}
while :; do
  __trio_agentd_sig=0
  if ! IFS=' ' read -r __trio_agentd_seq __trio_agentd_turn __trio_agentd_n <&{CONTROL_FD}
  then
    [ "$__trio_agentd_sig" = 1 ] && continue
    break
  fi
  __trio_agentd_cmd=
  while [ "$__trio_agentd_n" -gt 0 ]; do
    IFS= read -r __trio_agentd_line <&{CONTROL_FD} || exit 125
    __trio_agentd_n=$((__trio_agentd_n - 1))
    __trio_agentd_cmd=$__trio_agentd_cmd$__trio_agentd_line
    [ "$__trio_agentd_n" -gt 0 ] && __trio_agentd_cmd=$__trio_agentd_cmd$__trio_agentd_nl
  done
  export TRIO_AGENTD_TURN="$__trio_agentd_turn"
  __trio_agentd_traps
  command printf 'R%s\\0' "$__trio_agentd_seq" >&{CONTROL_FD} || exit 125
  if (eval "set -n;$__trio_agentd_cmd") {CONTROL_FD}<&-; then
    __trio_agentd_run {CONTROL_FD}<&-
    __trio_agentd_st=$?
  else
    __trio_agentd_st=2
  fi
  __trio_agentd_busy=0
  command printf 'S%s\\0%s\\0%s\\0' "$__trio_agentd_seq" "$__trio_agentd_st" "$PWD" \\
    >&{CONTROL_FD} || exit 125
done
"""


class _ProtocolError(Exception):
    """The shell sent something on its control socket that is not an answer."""


class _Shell:
    """One running shell: its process, its pipes, its control socket, and what it answered."""

    def __init__(
        self, proc: trio.Process, pidfd: int, control: socket.socket, out_fd: int, err_fd: int,
        cwd: bytes,
    ) -> None:
        self.proc = proc
        self.pidfd = pidfd
        self.control = control
        self.out_fd = out_fd
        self.err_fd = err_fd
        self.cwd = cwd  # as it last said (or where it started)
        self.group = GroupIdentity(proc.pid, proc.pid, read_start_id(proc.pid))
        self.seq = 0
        self.torn = False  # a prompt was sent in part only: the shell cannot be trusted
        self._answers = bytearray()
        self.acked = 0  # the last seq whose prompt it read
        self.status: dict[int, int] = {}  # seq -> status, for the prompt in flight
        self.control_eof = False
        self.out_open = True
        self.err_open = True
        self.exited = False  # its pidfd turned readable (it is unreaped until ``reap``)
        self.returncode: int | None = None
        # the clock tick its last turn ended in: every process an earlier turn started, started
        # no later
        self.answered_at = 0

    @classmethod
    async def start(cls, program: str, ctx: TurnContext, cwd: bytes) -> _Shell:
        """Start a shell in ``cwd``; on failure nothing is left running or open.

        Returns with no checkpoint after the process exists.

        Raises:
            AgentdError: ``bad_request`` if the shell cannot be started there.
        """
        ours, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = await trio.lowlevel.open_process(
                [program, "-c", _BOOTSTRAP, "sh"],
                stdin=theirs.fileno(),
                stdout=out_w,
                stderr=err_w,
                cwd=cwd,
                env=child_environment(ctx),
                start_new_session=True,
            )
        except OSError as exc:
            _close_all(ours, out_r, err_r)
            raise _spawn_error([program], Path(os.fsdecode(cwd)), exc) from None
        except BaseException:
            _close_all(ours, out_r, err_r)
            raise
        finally:
            theirs.close()
            os.close(out_w)
            os.close(err_w)
        ours.setblocking(False)
        os.set_blocking(out_r, False)
        os.set_blocking(err_r, False)
        widen_pipe(out_r)  # room for a fast writer while we send, read in bigger pieces
        widen_pipe(err_r)
        return cls(proc, os.pidfd_open(proc.pid), ours, out_r, err_r, cwd)

    # --- the control channel -------------------------------------------------------------

    async def send_prompt(self, prompt: str, turn: int) -> int:
        """Send one prompt; its sequence number. Cancelled half-way, the shell is unusable."""
        self.seq += 1
        self.status.clear()  # an answer to a prompt given up on is nobody's
        lines = prompt.encode(errors="surrogateescape").split(b"\n")
        data = memoryview(
            f"{self.seq} {turn} {len(lines)}\n".encode() + b"".join(ln + b"\n" for ln in lines)
        )
        while data:
            await trio.lowlevel.wait_writable(self.control)
            try:
                data = data[self.control.send(data) :]
            except BlockingIOError:
                continue
            self.torn = bool(data)
        return self.seq

    def alive(self) -> bool:
        """Not exited yet (checked now, without waiting)."""
        if not self.exited and select.select([self.pidfd], [], [], 0)[0]:
            self.exited = True
        return not self.exited

    def _read_control(self) -> None:
        try:
            data = self.control.recv(4096)
        except BlockingIOError:
            return
        except OSError:  # ECONNRESET: the shell died
            data = b""
        if not data:
            self.control_eof = True
            return
        self._answers += data
        while True:
            tag = self._answers[:1]
            need = 1 if tag == b"R" else 3 if tag == b"S" else 0
            if need == 0:
                raise _ProtocolError(f"unexpected {bytes(self._answers[:32])!r}")
            fields = self._answers.split(b"\0", need)
            if len(fields) <= need:
                if len(self._answers) > _CONTROL_MAX:
                    raise _ProtocolError("an answer longer than any path")
                return
            self._answers = bytearray(fields[need])
            try:
                seq = int(fields[0][1:])
                if tag == b"R":
                    self.acked = seq
                else:
                    self.status[seq] = int(fields[1])
                    self.cwd = bytes(fields[2])
            except ValueError:
                raise _ProtocolError(f"a malformed answer {bytes(fields[0])!r}") from None
            if not self._answers:
                return

    # --- waiting for anything ------------------------------------------------------------

    async def next_event(self, pipes: bool = False) -> tuple[str, bytes | Waiting]:
        """Wait until something happens; ``("out" | "err", data)`` for output, else
        ``("control", b"")`` (an answer came, or the channel closed) or ``("exit", b"")``.
        With ``pipes``, output waiting in a pipe comes as a :class:`Waiting` for the host to
        read (end of output still as ``b""``).

        Cancellation: loses nothing (a read only happens once its fd is ready).

        Raises:
            _ProtocolError: the shell sent something that is not an answer.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        # output already waiting is read at once (a stream is many reads in a row); waiting
        # on every descriptor is for when nothing is there
        for name, fd, is_open in (("out", self.out_fd, self.out_open),
                                  ("err", self.err_fd, self.err_open)):
            if not is_open:
                continue
            if pipes:
                if (count := available(fd)) > 0:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return name, Waiting(fd, count, stderr=name == "err")
            elif data := _read_some(fd):
                await trio.lowlevel.cancel_shielded_checkpoint()
                return name, data
        fds: list[int] = []
        if self.out_open:
            fds.append(self.out_fd)
        if self.err_open:
            fds.append(self.err_fd)
        if not self.control_eof:
            fds.append(self.control.fileno())
        if not self.exited:
            fds.append(self.pidfd)
        ready = await first_readable(fds)
        if ready == self.pidfd:
            self.exited = True
            while not self.control_eof:  # an answer it wrote before it went
                before = len(self._answers)
                self._read_control()
                if len(self._answers) == before and not self.control_eof:
                    break
            return ("exit", b"")
        if ready == self.control.fileno():
            self._read_control()
            return ("control", b"")
        name = "out" if ready == self.out_fd else "err"
        if pipes and (count := available(ready)) > 0:
            return name, Waiting(ready, count, stderr=name == "err")
        data = _read_some(ready)
        if data is None:
            return ("control", b"")  # spurious wake-up: nothing happened
        if not data:
            if ready == self.out_fd:
                self.out_open = False
            else:
                self.err_open = False
        return ("out" if ready == self.out_fd else "err", data)

    def pending_output(self) -> Iterator[tuple[str, bytes]]:
        """What the pipes hold right now, no more: a background writer cannot keep this
        going."""
        counts = [(name, fd, available(fd)) for name, fd, is_open in (
            ("out", self.out_fd, self.out_open), ("err", self.err_fd, self.err_open)) if is_open]
        for name, fd, count in counts:
            while count > 0:
                data = _read_some(fd, min(count, _READ_SIZE))
                if not data:
                    break
                count -= len(data)
                yield name, data

    # --- signals and the end ---------------------------------------------------------------

    def members(self, started_after: int) -> list[int]:
        """Processes of the shell's group (not the shell) that this turn started."""
        return _turn_members(self.proc.pid, started_after)

    def signal(self, sig: int, pids: list[int], *, shell: bool) -> None:
        if shell and not self.exited:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, sig)
        _signal_pids(self.proc.pid, pids, sig)

    async def kill(self) -> None:
        """SIGKILL the whole group while the unreaped shell still holds its number; reap."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.reap()

    async def reap(self) -> None:
        """Hang up what is left of the group (as a closed terminal does), then reap the shell
        and close everything."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGHUP)
            with trio.move_on_after(_ANSWER_BOUND, shield=True):
                self.returncode = await self.proc.wait()
        self.close_fds()

    def close_fds(self) -> None:
        for fd in (self.out_fd, self.err_fd, self.pidfd):
            if fd >= 0:
                trio.lowlevel.notify_closing(fd)
                os.close(fd)
        self.out_fd = self.err_fd = self.pidfd = -1
        if self.control.fileno() >= 0:
            trio.lowlevel.notify_closing(self.control)
            self.control.close()


def _close_all(sock: socket.socket, *fds: int) -> None:
    sock.close()
    for fd in fds:
        os.close(fd)


def _read_some(fd: int, size: int = _READ_SIZE) -> bytes | None:
    """Up to ``size`` bytes, ``b""`` at EOF, ``None`` if nothing is there yet."""
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None




def _ticks_now() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat's start time uses."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


async def _a_tick_after(tick: int) -> int:
    """Now, in clock ticks, once that is later than ``tick`` (a wait of at most one tick)."""
    if _ticks_now() <= tick:
        # trio's sleep runs on CLOCK_MONOTONIC, which CLOCK_BOOTTIME never falls behind; the
        # extra millisecond covers the float rounding of both
        until = (tick + 1) / os.sysconf("SC_CLK_TCK") + 0.001
        await trio.sleep(max(0.0, until - time.clock_gettime(time.CLOCK_BOOTTIME)))
    return _ticks_now()


def _turn_members(pgid: int, started_after: int) -> list[int]:
    """Live members of group ``pgid`` other than its leader that started no earlier than the
    turn's start (in clock ticks; no earlier turn's process started in that tick). One /proc
    scan: only a cancelled turn pays for it."""
    found: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == pgid:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
            fields = data[data.rfind(b")") + 2 :].split()
            if int(fields[2]) != pgid or fields[0] in (b"Z", b"X"):
                continue
            start = int(fields[19])
        except (OSError, IndexError, ValueError):
            continue
        if start >= started_after:
            found.append(int(name))
    return found


def _signal_pids(pgid: int, pids: list[int], sig: int) -> None:
    """Signal each pid still in group ``pgid``, pinned by a pidfd so a reused pid is missed."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if os.getpgid(pid) == pgid:
                signal.pidfd_send_signal(fd, sig)
        except OSError:
            pass
        finally:
            os.close(fd)


async def _wait_gone(pids: list[int], seconds: float) -> None:
    """Until every one of ``pids`` has exited, at most ``seconds``."""
    fds: list[int] = []
    try:
        for pid in pids:
            with contextlib.suppress(OSError):
                fds.append(os.pidfd_open(pid))
        with trio.move_on_after(seconds):
            for fd in fds:
                await trio.lowlevel.wait_readable(fd)
    finally:
        for fd in fds:
            trio.lowlevel.notify_closing(fd)
            os.close(fd)


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "was lost"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _restart_plan(cwd: Path, last: bytes | None, lost: str | None) -> tuple[bytes, str | None]:
    """Where a new shell starts, and the notice for its first answer (``None``: the session's
    first shell). ``last`` is the kept cwd of the session's previous shell, ``lost`` why this
    worker's previous shell is gone."""
    start = os.fsencode(cwd)
    if last is None and lost is None:
        return start, None
    where = os.fsdecode(start)
    if last and os.path.isdir(last):
        start = last
        where = os.fsdecode(last)
    elif last:
        where = f"{where} ({os.fsdecode(last)} is gone)"
    return start, (f"[a new shell started in {where}: the session's previous shell"
                   f" {lost or 'ended with its worker'}; its variables, functions and jobs are"
                   " gone]\n")


class ShellAgent:
    """One ``/bin/sh`` per session (per worker); each prompt is a command line typed into it.

    Not replayable: a command that ran once (``rm``, ``git push``) must not run again by
    itself after a worker restart. See the module docstring for the design.
    """

    replayable = False

    def __init__(self, *, kill_grace: float = KILL_GRACE, shell: str = SHELL) -> None:
        self.kill_grace = kill_grace
        self.shell = shell  # any POSIX shell: dash and bash are tested
        self._shell: _Shell | None = None
        self._lost: str | None = None  # why this agent's last shell is gone, if it is
        self._kept_cwd: bytes | None = None  # what ``shell.cwd`` says now
        self._busy = False

    def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[Chunk]:
        """Run ``prompt`` in the session's shell; yield stdout as ``bytes``, stderr as
        :class:`Stderr` and, last, :class:`ExitStatus` with the shell's ``$?``.

        The first shell starts in ``ctx.cwd`` (or, after a restart, the session's last known
        cwd); every command's stdin is ``/dev/null``; the environment is the worker's plus
        ``TRIO_AGENTD_SESSION`` and ``TRIO_AGENTD_TURN`` (this prompt's turn). A new shell in a
        session that had one first yields a one-line :class:`Stderr` notice saying so.

        Raises:
            AgentdError: ``bad_request`` (on first iteration) if no shell can be started in the
                session's directory.

        Cancellation: stops the command, not the shell (module docstring); bounded by
        ``kill_grace`` plus a few seconds, shielded, before the cancellation propagates.
        """
        return self._turn(prompt, ctx)

    async def aclose(self) -> None:
        """End the shell: EOF on its control socket (it exits and hangs up its group), or,
        after a bound, SIGKILL of its group. Reaped before this returns."""
        shell, self._shell = self._shell, None
        if shell is None:
            return
        with trio.CancelScope(shield=True):
            shell.control.shutdown(socket.SHUT_WR)
            with trio.move_on_after(_CLOSE_BOUND):
                await trio.lowlevel.wait_readable(shell.pidfd)
                shell.exited = True
            if shell.exited:
                await shell.reap()
            else:
                await shell.kill()


    async def _ready_shell(self, ctx: TurnContext) -> tuple[_Shell, str | None]:
        """The running shell, or a new one, with the notice its first answer starts with."""
        shell = self._shell
        if shell is not None and shell.alive():
            self._drop_stale_output(shell)
            return shell, None
        if shell is not None:  # it died between prompts (killed from outside)
            await shell.reap()
            self._lost = _describe_exit(shell.returncode)
            self._shell = None
        cwd_file = ctx.session_dir / CWD_FILE
        try:
            last = read_bytes(cwd_file)
        except (OSError, ValueError) as exc:
            log.warning("%s: cannot read the shell's last cwd (%s); starting in %s",
                        cwd_file, exc, ctx.cwd)
            last = None
        start, notice = _restart_plan(ctx.cwd, last, self._lost)
        self._shell = shell = await _Shell.start(self.shell, ctx, start)
        self._lost = None
        self._keep_cwd(ctx, shell.cwd, force=True)
        return shell, notice

    def _drop_stale_output(self, shell: _Shell) -> None:
        """What background jobs wrote between prompts belongs to no prompt: drop it."""
        dropped = sum(len(data) for _, data in shell.pending_output())
        if dropped:
            log.info("dropped %d bytes that background jobs of the shell wrote between"
                     " prompts", dropped)

    def _keep_cwd(self, ctx: TurnContext, cwd: bytes, *, force: bool = False) -> None:
        path = ctx.session_dir / CWD_FILE
        if not force and cwd == self._kept_cwd:
            return
        try:
            atomic_write(path, cwd)
            self._kept_cwd = cwd
        except OSError as exc:  # the shell goes on; only a restart would miss it
            log.warning("cannot keep the shell's cwd in %s: %s", path, exc)

    async def _turn(self, prompt: str, ctx: TurnContext) -> AsyncGenerator[Chunk, None]:
        # one generator, not two nested: closing it (a cancel) runs its cleanup at once, never
        # in a finalizer later
        if self._busy:
            raise AgentdError(ErrorCode.INTERNAL, "the shell runs one prompt at a time")
        self._busy = True
        try:
            shell, notice = await self._ready_shell(ctx)
            if ctx.on_group is not None:
                ctx.on_group(shell.group)  # raising refuses the turn; the idle shell stays
        except BaseException:
            self._busy = False
            raise
        try:
            # a later tick than the shell's last answer: what the turn starts is told apart
            # from what earlier turns started by its start tick alone
            started_at = await _a_tick_after(shell.answered_at)
            seq = 0
            finished = False
            try:
                try:
                    seq = await shell.send_prompt(prompt, ctx.turn)
                except OSError as exc:  # it died just now, between prompts
                    finished = True
                    with trio.CancelScope(shield=True):  # bounded: it is gone, or is killed
                        await self._give_up(shell, f"could not be sent the prompt ({exc})")
                    raise AgentdError(
                        ErrorCode.INTERNAL,
                        f"the session's shell {self._lost} before it got the prompt — send it"
                        " again: a new shell will run it",
                    ) from None
                if notice is not None:
                    yield Stderr(notice)
                while seq not in shell.status and not shell.exited:
                    kind, data = await shell.next_event(ctx.pipes)
                    if isinstance(data, Waiting) or (kind == "out" and data):
                        yield data
                    elif kind == "err" and data:
                        yield Stderr(data)
                finished = True
            except _ProtocolError as exc:
                finished = True
                with trio.CancelScope(shield=True):
                    await self._give_up(shell, f"broke its protocol ({exc}) and was killed")
                raise AgentdError(
                    ErrorCode.INTERNAL,
                    f"the session's shell {self._lost} — the next prompt starts a new one",
                ) from None
            finally:
                if not finished:
                    with trio.move_on_after(self.kill_grace + 3 * _ANSWER_BOUND, shield=True):
                        await self._interrupt(shell, seq, started_at, ctx)
                    if self._shell is shell and ((seq != 0 and seq not in shell.status)
                                                 or (seq == 0 and shell.torn)):
                        # the bound ran out, or it cannot be trusted
                        with trio.CancelScope(shield=True):
                            await self._give_up(shell, "did not stop after a cancel and was killed")
                    shell.status.pop(seq, None)
            for name, data in shell.pending_output():
                yield data if name == "out" else Stderr(data)
            if seq in shell.status:
                code = shell.status.pop(seq)
                self._keep_cwd(ctx, shell.cwd)
            else:  # it exited (``exit``, ``exec``, a signal) instead of answering
                await self._give_up(shell, "")
                code = shell.returncode if shell.returncode is not None else 255
            yield ExitStatus(code)
        finally:
            shell.answered_at = _ticks_now()
            self._busy = False

    async def _interrupt(self, shell: _Shell, seq: int, started_at: int, ctx: TurnContext
                         ) -> None:
        """Stop the command of a cancelled turn and get the shell back, or give up on it.

        Called shielded and bounded; ``seq`` 0: the prompt was not (fully) sent.
        """
        try:
            if seq == 0:
                if shell.torn:
                    await self._give_up(shell, "was cut off while it read a prompt")
                return
            with trio.move_on_after(self.kill_grace):
                while shell.acked != seq and not shell.exited and not shell.control_eof:
                    await shell.next_event()  # let it read the whole prompt first
            if shell.acked != seq:
                await self._give_up(shell, "did not read its prompt and was killed")
                return
            steps = [
                (signal.SIGINT, True, self.kill_grace),
                (signal.SIGTERM, True, _TERM_GRACE),
                (signal.SIGKILL, False, _ANSWER_BOUND),
            ]
            for sig, to_shell, wait in steps:
                if seq in shell.status or shell.exited:
                    break
                shell.signal(sig, shell.members(started_at), shell=to_shell)
                with trio.move_on_after(wait):
                    while seq not in shell.status and not shell.exited:
                        await shell.next_event()  # output of a cancelled turn goes nowhere
            if seq not in shell.status:
                await self._give_up(shell, "did not stop after a cancel and was killed")
                return
            self._keep_cwd(ctx, shell.cwd)
            # the shell is back; what the turn started and left running goes too
            left = shell.members(started_at)
            if left:
                shell.signal(signal.SIGTERM, left, shell=False)
                await _wait_gone(left, _TERM_GRACE)
                left = shell.members(started_at)
                shell.signal(signal.SIGKILL, left, shell=False)
                await _wait_gone(left, _ANSWER_BOUND)  # the answer comes once they are gone
            for _ in shell.pending_output():
                pass  # a cancelled turn's last output goes nowhere either
        except _ProtocolError as exc:
            await self._give_up(shell, f"broke its protocol ({exc}) and was killed")

    async def _give_up(self, shell: _Shell, why: str) -> None:
        """Be done with ``shell``: reaped if it exited (``why`` is then how it ended), else
        killed with its group; the next prompt starts a new one and says why."""
        if shell.exited:
            await shell.reap()
            why = _describe_exit(shell.returncode)
        else:
            log.warning("the session's shell (pid %d) %s", shell.proc.pid, why)
            await shell.kill()
        if self._shell is shell:
            self._shell = None
            self._lost = why
