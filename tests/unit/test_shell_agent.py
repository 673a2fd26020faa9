"""The ``shell`` agent: one shell per session, driven turn by turn by iterating ``turn()``.

Real processes on the real clock, under an outer ``trio.fail_after``. Nothing waits by
sleeping: a command that must pause until the test has looked at something blocks on a FIFO
the test holds open, and the death of a process is awaited on its pidfd.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._identity import GroupIdentity
from trio_agentd.agents import Chunk, ExitStatus, ShellAgent, Stderr, TurnContext, _shell
from trio_agentd.agents._shell import CWD_FILE

DEADLINE = 15.0  # outer bound of every test
GONE_DEADLINE = 5.0  # the processes these tests start would live 30 s if not killed
SESSION = "s1"


@dataclass
class Answer:
    out: bytes = b""
    err: bytes = b""
    status: int | None = None
    chunks: list[Chunk] = field(default_factory=list)


def _add(answer: Answer, chunk: Chunk) -> None:
    assert answer.status is None, "nothing may follow the exit status"
    answer.chunks.append(chunk)
    if isinstance(chunk, ExitStatus):
        answer.status = chunk.code
    elif isinstance(chunk, Stderr):
        assert isinstance(chunk.data, bytes | str)
        answer.err += chunk.data if isinstance(chunk.data, bytes) else chunk.data.encode()
    else:
        assert isinstance(chunk, bytes), "stdout comes as bytes"
        answer.out += chunk


@dataclass
class Session:
    """One agent over one session directory, as a worker holds it."""

    agent: ShellAgent
    cwd: Path
    session_dir: Path
    turns: int = 0
    groups: list[GroupIdentity] = field(default_factory=list)

    def ctx(self) -> TurnContext:
        self.turns += 1
        return TurnContext(session_id=SESSION, turn=self.turns, cwd=self.cwd,
                           session_dir=self.session_dir, on_group=self.groups.append)

    async def ask(self, prompt: str) -> Answer:
        answer = Answer()
        with trio.fail_after(DEADLINE):
            chunks = self.agent.turn(prompt, self.ctx())
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    _add(answer, chunk)
        return answer

    async def ok(self, prompt: str) -> str:
        answer = await self.ask(prompt)
        assert (answer.status, answer.err) == (0, b""), answer
        return answer.out.decode()


SHELLS = sorted({os.path.realpath(sh) for sh in ("/bin/sh", "/bin/dash", "/bin/bash")
                 if os.access(sh, os.X_OK)})


@pytest.fixture(params=SHELLS)
def program(request: pytest.FixtureRequest) -> str:
    """Every test runs with each POSIX shell there is (``/bin/sh`` is dash or bash)."""
    return str(request.param)


@contextlib.asynccontextmanager
async def session_in(tmp_path: Path, program: str, *, kill_grace: float = 0.3,
                     session_dir: Path | None = None) -> AsyncIterator[Session]:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    sdir = session_dir or tmp_path / "session"
    sdir.mkdir(exist_ok=True)
    s = Session(ShellAgent(kill_grace=kill_grace, shell=program), work, sdir)
    try:
        yield s
    finally:
        await s.agent.aclose()


@contextlib.contextmanager
def gate(path: Path) -> Iterator[int]:
    """A FIFO a command blocks on (``read x < gate``) until the test writes a line to it."""
    os.mkfifo(path)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def watched(pids: list[int]) -> Iterator[list[int]]:
    """pidfds of ``pids``; on exit, SIGKILL whatever a failed test left running."""
    fds: list[int] = []
    try:
        for pid in pids:
            fds.append(os.pidfd_open(pid))
        yield fds
    finally:
        for fd in fds:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)


async def wait_exited(fds: list[int]) -> None:
    with trio.fail_after(GONE_DEADLINE):
        for fd in fds:
            await trio.lowlevel.wait_readable(fd)


def gone(pid: int) -> bool:
    """Exited (or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2 :][:1] in (b"Z", b"X")


def running(fd: int) -> bool:
    import select

    return not select.select([fd], [], [], 0)[0]


async def cancel_once(s: Session, prompt: str, when: bytes) -> Answer:
    """Run ``prompt`` and cancel it once its output contains ``when``."""
    answer = Answer()
    with trio.fail_after(DEADLINE), trio.CancelScope() as scope:
        chunks = s.agent.turn(prompt, s.ctx())
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                _add(answer, chunk)
                if when in answer.out:
                    scope.cancel()
    assert scope.cancelled_caught
    assert answer.status is None
    return answer


# --- state carries over -----------------------------------------------------------------------


async def test_cd_variables_and_functions_carry_over(tmp_path: Path, program: str) -> None:
    (tmp_path / "work" / "sub").mkdir(parents=True)
    async with session_in(tmp_path, program) as s:
        assert await s.ok("cd sub; x=forty-two; greet() { echo \"hi $1\"; }; echo $$") != ""
        first_pid = int(s.groups[0].pid)
        assert await s.ok("pwd -P") == f"{(s.cwd / 'sub').resolve()}\n"
        assert await s.ok("echo $x; greet you; echo $$") == f"forty-two\nhi you\n{first_pid}\n"
        assert [g.pid for g in s.groups] == [first_pid] * 3  # one shell, reported every turn


async def test_each_prompt_gets_its_turn_number_and_the_session(
    tmp_path: Path, program: str
) -> None:
    async with session_in(tmp_path, program) as s:
        await s.ok("true")
        await s.ok("true")
        assert await s.ok('echo "$TRIO_AGENTD_SESSION $TRIO_AGENTD_TURN"; env | grep ^TRIO_'
                          ' | sort') == f"{SESSION} 3\nTRIO_AGENTD_SESSION={SESSION}\n" \
                                        "TRIO_AGENTD_TURN=3\n"


# --- stdout, stderr, exit status --------------------------------------------------------------


async def test_stdout_stderr_and_the_exit_status_come_apart(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        answer = await s.ask("echo out; echo err >&2; echo more; (exit 3)")
        assert (answer.out, answer.err, answer.status) == (b"out\nmore\n", b"err\n", 3)
        assert answer.chunks[-1] == ExitStatus(3)
        assert (await s.ask("false")).status == 1
        assert (await s.ask("sh -c 'kill -TERM $$'")).status == 128 + signal.SIGTERM


async def test_binary_output_is_passed_on_exactly(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        answer = await s.ask(r"printf 'a\377\000b\200'; printf 'e\000\377' >&2")
        assert (answer.out, answer.err) == (b"a\377\000b\200", b"e\000\377")


async def test_output_written_just_before_the_status_is_all_there(
    tmp_path: Path, program: str
) -> None:
    # far beyond a pipe's buffer, on both streams, the last bytes written as the command ends
    async with session_in(tmp_path, program) as s:
        for _ in range(3):
            answer = await s.ask("seq 1 200000; seq 1 100000 >&2")
            assert answer.out == b"".join(b"%d\n" % i for i in range(1, 200001))
            assert answer.err == b"".join(b"%d\n" % i for i in range(1, 100001))
            assert answer.status == 0


async def test_output_streams_before_the_command_ends(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        with gate(tmp_path / "gate") as gate_fd, trio.fail_after(DEADLINE):
            chunks = s.agent.turn("echo first; read go < ../gate; echo second", s.ctx())
            seen = Answer()
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    _add(seen, chunk)
                    if seen.out == b"first\n":
                        os.write(gate_fd, b"go\n")
        assert (seen.out, seen.status) == (b"first\nsecond\n", 0)


async def test_the_prompt_arrives_exactly(tmp_path: Path, program: str) -> None:
    prompt = (
        "printf '%s|' 'a\\b' \"c  d\" '' '  lead' 'tab\there' 'é'\n"
        "cat <<'EOF'\n  x\\\n$y 'q' \"z\"\n\nEOF\n"
        "printf 'S1\\0000\\000/\\000'  # looks like an answer; is output\n"
    )
    async with session_in(tmp_path, program) as s:
        answer = await s.ask(prompt)
        assert answer.out == (b"a\\b|c  d||  lead|tab\there|\xc3\xa9|"
                              b"  x\\\n$y 'q' \"z\"\n\nS1\x000\x00/\x00")
        assert answer.status == 0
        # a prompt without a trailing newline, and an empty one
        assert await s.ok("printf x") == "x"
        assert await s.ok("") == ""


async def test_a_syntax_error_runs_nothing_and_the_shell_stays(
    tmp_path: Path, program: str
) -> None:
    async with session_in(tmp_path, program) as s:
        await s.ok("x=kept")
        answer = await s.ask("touch ran; if true")
        assert answer.status == 2
        assert b"Syntax error" in answer.err or b"syntax error" in answer.err
        assert not (s.cwd / "ran").exists()
        assert await s.ok("echo $x") == "kept\n"


async def test_stdin_is_dev_null(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        assert await s.ok("readlink /proc/self/fd/0; cat; echo done") == "/dev/null\ndone\n"


async def test_commands_never_get_the_control_channel(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        # no program the shell starts has any descriptor beyond 0-2 (ls opens only its own)
        fds = await s.ok("ls /proc/self/fd")
        assert sorted(int(fd) for fd in fds.split()) == [0, 1, 2, 3]
        # and the shell itself cannot reach it from a command either
        answer = await s.ask("echo S1 >&8")
        assert answer.status != 0
        assert await s.ok("echo still here") == "still here\n"


# --- one turn's output never leaks into the next -----------------------------------------------


async def test_background_output_between_prompts_is_dropped(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s, contextlib.AsyncExitStack():
        with gate(tmp_path / "gate") as gate_fd:
            out = await s.ok("{ read go < ../gate; echo late; echo late-err >&2; } & echo $!")
            with watched([int(out)]) as fds:
                os.write(gate_fd, b"go\n")
                await wait_exited(fds)  # it wrote both lines and is gone
            answer = await s.ask("echo next")
            assert (answer.out, answer.err, answer.status) == (b"next\n", b"", 0)


# --- exit, restarts and the kept cwd -------------------------------------------------------


async def test_exit_ends_the_shell_and_the_next_prompt_says_a_new_one_started(
    tmp_path: Path, program: str,
) -> None:
    (tmp_path / "work" / "sub").mkdir(parents=True)
    async with session_in(tmp_path, program) as s:
        await s.ok("cd sub; x=1")
        old = s.groups[-1].pid
        answer = await s.ask("echo bye; exit 3")
        assert (answer.out, answer.status) == (b"bye\n", 3)
        answer = await s.ask("pwd -P; echo \"x=$x\"")
        assert answer.out == f"{(s.cwd / 'sub').resolve()}\nx=\n".encode()
        assert answer.status == 0
        notice = answer.err.decode()
        assert notice.count("\n") == 1
        assert "a new shell started in" in notice
        assert "previous shell exited with status 3" in notice
        assert isinstance(answer.chunks[0], Stderr)  # it comes first
        assert s.groups[-1].pid != old
        # only the first answer of the new shell says so
        assert (await s.ask("true")).err == b""


async def test_a_shell_killed_by_a_signal_reports_it(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        answer = await s.ask("kill -KILL $$")
        assert answer.status == -signal.SIGKILL
        answer = await s.ask("true")
        assert b"previous shell was killed by SIGKILL" in answer.err


async def test_a_new_worker_starts_its_shell_in_the_last_cwd_and_says_so(
    tmp_path: Path, program: str,
) -> None:
    (tmp_path / "work" / "sub").mkdir(parents=True)
    async with session_in(tmp_path, program) as s:
        assert await s.ok("echo first") == "first\n"  # a session's first shell says nothing
        await s.ok("cd sub")
    assert (tmp_path / "session" / CWD_FILE).read_bytes() == os.fsencode(s.cwd / "sub")
    async with session_in(tmp_path, program) as s2:  # the same session, a new worker's agent
        answer = await s2.ask("pwd")
        assert answer.out == f"{s.cwd / 'sub'}\n".encode()
        assert "a new shell started in" in answer.err.decode()
        assert "ended with its worker" in answer.err.decode()


async def test_a_last_cwd_that_is_gone_starts_in_the_sessions_directory(
    tmp_path: Path, program: str
) -> None:
    (tmp_path / "work" / "sub").mkdir(parents=True)
    async with session_in(tmp_path, program) as s:
        await s.ok("cd sub")
    (tmp_path / "work" / "sub").rmdir()
    async with session_in(tmp_path, program) as s2:
        answer = await s2.ask("pwd")
        assert answer.out == f"{s.cwd}\n".encode()
        assert f"({s.cwd / 'sub'} is gone)" in answer.err.decode()


async def test_a_missing_directory_is_a_bad_request(tmp_path: Path, program: str) -> None:
    agent = ShellAgent(shell=program)
    ctx = TurnContext(session_id=SESSION, turn=1, cwd=tmp_path / "gone", session_dir=tmp_path)
    with pytest.raises(AgentdError) as info, trio.fail_after(DEADLINE):
        async for _ in agent.turn("echo never", ctx):
            pass
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert str(tmp_path / "gone") in info.value.message
    assert "create the directory" in info.value.message
    await agent.aclose()


async def test_closing_the_agent_ends_the_shell_and_hangs_up_its_jobs(
    tmp_path: Path, program: str
) -> None:
    async with session_in(tmp_path, program) as s:
        job = int(await s.ok("sleep 30 >/dev/null 2>&1 & echo $!"))
        shell = s.groups[-1].pid
        with watched([shell, job]) as fds:
            await s.agent.aclose()  # what a worker's exit does: EOF on the control socket
            await wait_exited(fds)
        with pytest.raises(ChildProcessError):  # reaped
            os.waitid(os.P_PID, shell, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 (WNOHANG)


def _ignored(pid: int) -> int:
    """The signals ``pid`` ignores (``SigIgn`` of its status), as a mask."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))


async def test_a_serving_workers_shell_hears_hang_ups_its_daemon_ignored(
    tmp_path: Path, program: str
) -> None:
    """A daemon started under ``nohup`` (or as a script's background job) passes the ignored
    signals on to its workers; the shell a serving worker starts still gets them back at their
    defaults (the worker catches its stop signals, and a caught signal is default again after
    ``exec``), so its jobs end at its hang-up as at a closed terminal's."""
    from trio_agentd._worker import _stop_signals_received

    stops = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)
    before = {sig: signal.getsignal(sig) for sig in stops}
    try:
        for sig in stops:
            signal.signal(sig, signal.SIG_IGN)  # the daemon's, inherited
        with _stop_signals_received():
            async with session_in(tmp_path, program) as s:
                job = int(await s.ok("sleep 30 >/dev/null 2>&1 & echo $!"))
                shell = s.groups[-1].pid
                hup = 1 << (signal.SIGHUP - 1)
                assert not _ignored(shell) & hup
                assert not _ignored(job) & hup
                with watched([shell, job]) as fds:
                    await s.agent.aclose()
                    await wait_exited(fds)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


async def test_background_jobs_outlive_their_prompt(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        job = int(await s.ok("sleep 30 >/dev/null 2>&1 & echo $!"))
        with watched([job]) as fds:
            await s.ok("true")
            assert running(fds[0])
            # (SIGKILL: a job still between its fork and its exec would lose a TERM to the
            # shell's own handler, which it still has until it execs)
            answer = await s.ask("kill -KILL $!; wait $! 2>/dev/null; echo $?")
            assert (answer.out, answer.status) == (b"137\n", 0)


# --- the group is reported before anything runs ------------------------------------------------


async def test_the_group_is_reported_every_turn_before_the_prompt_runs(
    tmp_path: Path, program: str
) -> None:
    marker = tmp_path / "work" / "ran"
    seen: list[tuple[GroupIdentity, bool]] = []
    async with session_in(tmp_path, program) as s:
        ctx = s.ctx()
        ctx = TurnContext(session_id=SESSION, turn=ctx.turn, cwd=ctx.cwd,
                          session_dir=ctx.session_dir,
                          on_group=lambda g: seen.append((g, marker.exists())))
        async for _ in s.agent.turn("touch ran", ctx):
            pass
        [(group, ran_before)] = seen
        assert not ran_before
        assert marker.exists()
        assert group.pgid == group.pid
        assert group.start_id is not None


async def test_a_hook_that_raises_refuses_the_turn_and_the_shell_stays(
    tmp_path: Path, program: str
) -> None:
    async with session_in(tmp_path, program) as s:
        await s.ok("x=1")

        def refuse(g: GroupIdentity) -> None:
            raise AgentdError(ErrorCode.STORAGE_ERROR, "cannot journal it")

        ctx = TurnContext(session_id=SESSION, turn=2, cwd=s.cwd, session_dir=s.session_dir,
                          on_group=refuse)
        with pytest.raises(AgentdError) as info:
            async for _ in s.agent.turn("touch ran", ctx):
                pass
        assert info.value.code == ErrorCode.STORAGE_ERROR
        assert not (s.cwd / "ran").exists()
        assert await s.ok("echo $x") == "1\n"


# --- cancel interrupts the command, not the shell -----------------------------------------------


async def test_cancel_interrupts_the_command_and_the_rest_of_its_line(
    tmp_path: Path, program: str
) -> None:
    async with session_in(tmp_path, program) as s:
        await s.ok("x=1")
        shell = s.groups[-1].pid
        answer = await cancel_once(s, "echo started; sleep 30; touch never; x=2", b"started")
        assert answer.out == b"started\n"
        assert not (s.cwd / "never").exists()
        answer = await s.ask("echo $x $$")
        assert (answer.out, answer.err, answer.status) == (f"1 {shell}\n".encode(), b"", 0)


async def test_cancel_breaks_a_loop_of_builtins(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        await cancel_once(s, "echo go; while :; do :; done", b"go")
        assert await s.ok("echo back") == "back\n"
        assert (await s.ask("true")).err == b""  # the same shell


async def test_cancel_stops_what_the_turn_started_but_not_earlier_jobs(
    tmp_path: Path, program: str
) -> None:
    async with session_in(tmp_path, program) as s:
        old = int(await s.ok("sleep 30 >/dev/null 2>&1 & echo $!"))
        with watched([old]) as old_fd:
            # the background sleep of this turn ignores SIGINT (as every background job of a
            # script does); it still goes once the shell is back
            answer = await cancel_once(s, "sleep 30 & echo $!; wait", b"\n")
            assert gone(int(answer.out))  # the cancel returns once it is
            assert running(old_fd[0])
            # (bash may report the killed job on stderr, as it would at a terminal)
            answer = await s.ask("echo back")
            assert (answer.out, answer.status) == (b"back\n", 0)


async def test_a_turn_starts_in_a_later_clock_tick_than_the_last_answer(
    tmp_path: Path, program: str
) -> None:
    """What a turn started is told apart from earlier turns' processes by its start tick
    alone (``/proc/PID/stat``): back to back, each turn's process starts in a later tick than
    the last turn's did."""
    async with session_in(tmp_path, program) as s:
        ticks = [int((await s.ok("cut -d' ' -f22 /proc/self/stat")).split()[-1])
                 for _ in range(20)]
        assert all(a < b for a, b in itertools.pairwise(ticks)), ticks


async def test_cancel_stops_a_subshell_of_the_turn_that_never_execs(
    tmp_path: Path, program: str
) -> None:
    """A background subshell running builtins only keeps the shell's environment from its
    start (never the turn's exported ``TRIO_AGENTD_TURN``); the cancel stops it all the same,
    turn after turn, however soon after the last answer the turn starts."""
    os.mkfifo(tmp_path / "never")
    async with session_in(tmp_path, program) as s:
        await s.ok("true")
        for _ in range(5):
            answer = await cancel_once(
                s, f"( read -r x <> {tmp_path / 'never'} ) & echo $!; wait", b"\n")
            pid = int(answer.out)
            left = not gone(pid)
            if left:
                with watched([pid]):
                    pass  # killed on the way out
            assert not left, "the cancel answered with the turn's subshell still running"


async def test_a_command_that_ignores_sigint_gets_sigterm_after_the_grace(
    tmp_path: Path, program: str
) -> None:
    async with session_in(tmp_path, program, kill_grace=0.2) as s:
        await s.ok("x=1")
        before = trio.current_time()
        answer = await cancel_once(
            s, "sh -c 'trap \"\" INT; echo $$; exec sleep 30'", b"\n")
        assert trio.current_time() - before >= 0.2
        assert gone(int(answer.out))
        assert await s.ok("echo $x") == "1\n"


async def test_a_shell_that_cannot_be_interrupted_is_replaced(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program, kill_grace=0.2) as s:
        await s.ok("cd /")
        shell = s.groups[-1].pid
        with watched([shell]) as fds:
            await cancel_once(s, "trap '' INT TERM; echo go; while :; do :; done", b"go")
            await wait_exited(fds)
        answer = await s.ask("pwd")
        assert answer.out == b"/\n"
        assert b"did not stop after a cancel and was killed" in answer.err
        assert s.groups[-1].pid != shell


async def test_a_cancel_leaves_no_output_for_the_next_turn(tmp_path: Path, program: str) -> None:
    async with session_in(tmp_path, program) as s:
        await cancel_once(
            s, "echo started; trap 'seq 1 50000; seq 1 50000 >&2' INT; sleep 30", b"started")
        answer = await s.ask("echo next")
        assert (answer.out, answer.err, answer.status) == (b"next\n", b"", 0)


async def test_the_escalation_of_a_cancel_runs_at_exact_times(
    mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    # the shell itself ignores INT and TERM (the prompt's own traps) and waits in a builtin:
    # every step waits its whole bound, then the shell is given up on and killed. The clock
    # moves only when the test moves it (the shell's answers are real I/O).
    sent: list[tuple[float, str]] = []
    real_signal, real_kill = _shell._Shell.signal, _shell._Shell.kill

    def signal_(self: _shell._Shell, sig: int, pids: list[int], *, shell: bool) -> None:
        sent.append((trio.current_time(), signal.Signals(sig).name + (" shell" if shell else "")))
        real_signal(self, sig, pids, shell=shell)

    async def kill(self: _shell._Shell) -> None:
        sent.append((trio.current_time(), "SIGKILL group"))
        await real_kill(self)

    monkeypatch.setattr(_shell._Shell, "signal", signal_)
    monkeypatch.setattr(_shell._Shell, "kill", kill)
    grace = 5.0
    with gate(tmp_path / "gate") as _gate_fd:
        async with session_in(tmp_path, SHELLS[0], kill_grace=grace) as s:
            chunks = s.agent.turn("trap '' INT TERM; echo ready; read x < ../gate", s.ctx())
            assert isinstance(chunks, AsyncGenerator)
            seen = Answer()
            while b"ready" not in seen.out:
                _add(seen, await anext(chunks))
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(chunks.aclose)  # as the worker closes a cancelled turn
                await trio.testing.wait_all_tasks_blocked()
                assert sent == [(t0, "SIGINT shell")]
                mock_clock.jump(grace - 0.001)
                await trio.testing.wait_all_tasks_blocked()
                assert sent == [(t0, "SIGINT shell")]  # not a moment early
                mock_clock.jump(0.001)
                await trio.testing.wait_all_tasks_blocked()
                assert sent[1:] == [(t0 + grace, "SIGTERM shell")]
                mock_clock.jump(_shell._TERM_GRACE)
                await trio.testing.wait_all_tasks_blocked()
                assert sent[2:] == [(t0 + grace + _shell._TERM_GRACE, "SIGKILL")]
                mock_clock.jump(_shell._ANSWER_BOUND)
            assert sent[3:] == [
                (t0 + grace + _shell._TERM_GRACE + _shell._ANSWER_BOUND, "SIGKILL group")]
            answer = await s.ask("echo new")
            assert answer.out == b"new\n"
            assert b"did not stop after a cancel and was killed" in answer.err
