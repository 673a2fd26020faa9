"""The built-in agents and their specs.

The ``shell`` and ``exec`` tests start real processes, so they run on the real clock under an
outer ``trio.fail_after``. Nothing here waits by sleeping: a script that must pause until the
test has looked at something blocks on a FIFO the test holds open, and the death of a process is
awaited on its pidfd.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd.agents import (
    Agent,
    AgentLoadError,
    Chunk,
    EchoAgent,
    ExecAgent,
    ExitStatus,
    ShellAgent,
    Stderr,
    TurnContext,
    Waiting,
    load_agent,
    validate_agent_spec,
)

DEADLINE = 10.0  # outer bound of every test that runs processes
GONE_DEADLINE = 5.0  # the processes these tests start would live 30 s if not killed
SESSION = "s1"


def make_ctx(cwd: Path, *, turn: int = 1) -> TurnContext:
    return TurnContext(session_id=SESSION, turn=turn, cwd=cwd, session_dir=cwd)


@contextlib.asynccontextmanager
async def turn_bytes(
    agent: Agent, prompt: str, ctx: TurnContext
) -> AsyncIterator[AsyncGenerator[Chunk, None]]:
    """The turn's chunks as the agent yields them, closed on the way out even if the test
    fails half-way through."""
    chunks = agent.turn(prompt, ctx)
    assert isinstance(chunks, AsyncGenerator)
    async with contextlib.aclosing(chunks):
        yield chunks


@contextlib.asynccontextmanager
async def turn(
    agent: Agent, prompt: str, ctx: TurnContext
) -> AsyncIterator[AsyncGenerator[str, None]]:
    """The turn's chunks as text (bytes decoded as UTF-8; no chunk here splits a character)."""

    async def text(chunks: AsyncGenerator[Chunk, None]) -> AsyncGenerator[str, None]:
        async for chunk in chunks:
            if isinstance(chunk, (Stderr, ExitStatus)):
                continue  # the reply only; see outcome()
            assert not isinstance(chunk, Waiting), "Waiting without ctx.pipes"
            yield chunk.decode() if isinstance(chunk, bytes) else chunk

    async with turn_bytes(agent, prompt, ctx) as chunks:
        decoded = text(chunks)
        async with contextlib.aclosing(decoded):
            yield decoded


async def reply_chunks(agent: Agent, prompt: str, ctx: TurnContext) -> list[str]:
    with trio.fail_after(DEADLINE):
        async with turn(agent, prompt, ctx) as chunks:
            return [chunk async for chunk in chunks]


async def reply(agent: Agent, prompt: str, ctx: TurnContext) -> str:
    return "".join(await reply_chunks(agent, prompt, ctx))


async def outcome(agent: Agent, prompt: str, ctx: TurnContext) -> tuple[bytes, bytes, list[int]]:
    """The turn's stdout and stderr bytes, and the exit statuses it yielded (each must be last)."""
    out, err, statuses = bytearray(), bytearray(), list[int]()
    with trio.fail_after(DEADLINE):
        async with turn_bytes(agent, prompt, ctx) as chunks:
            async for chunk in chunks:
                assert not statuses, f"{chunk!r} after the exit status"
                if isinstance(chunk, ExitStatus):
                    statuses.append(chunk.code)
                elif isinstance(chunk, Stderr):
                    err += chunk.data.encode() if isinstance(chunk.data, str) else chunk.data
                elif isinstance(chunk, Waiting):
                    raise AssertionError("Waiting without ctx.pipes")
                else:
                    out += chunk.encode() if isinstance(chunk, str) else chunk
    return bytes(out), bytes(err), statuses


def script_agent(kind: str, script: str, **kwargs: float) -> tuple[Agent, str]:
    """The script as ``exec:sh -c SCRIPT`` (prompt unused), one process per turn."""
    assert kind == "exec"
    return ExecAgent(["/bin/sh", "-c", script], **kwargs), ""


KINDS = ["exec"]  # the shell agent keeps one shell per session: tests/unit/test_shell_agent.py


@contextlib.contextmanager
def gate(path: Path) -> Iterator[int]:
    """A FIFO a script blocks on (``read x < gate``) until the test writes a line to it.

    The test holds it open read-write, so the script's open never blocks and only its read
    waits; nothing is left blocked if the test fails before opening the gate.
    """
    os.mkfifo(path)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        yield fd
    finally:
        os.close(fd)


def open_gate(fd: int) -> None:
    os.write(fd, b"go\n")


@contextlib.contextmanager
def watched(pids: list[int]) -> Iterator[list[int]]:
    """pidfds of ``pids`` (alive now); on exit, SIGKILL whatever a failed test left running."""
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


async def wait_all_exited(fds: list[int]) -> None:
    """Until every process has exited (a pidfd turns readable), or fail."""
    with trio.fail_after(GONE_DEADLINE):
        for fd in fds:
            await trio.lowlevel.wait_readable(fd)


def assert_reaped(pid: int) -> None:
    """``pid`` was our child and has been waited for: no zombie was left behind."""
    with pytest.raises(ChildProcessError):
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)


# --- streaming ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_output_streams_before_the_process_ends(tmp_path: Path, kind: str) -> None:
    agent, prompt = script_agent(
        kind, "echo first; read go < gate; echo second; touch finished"
    )
    chunks: list[str] = []
    with gate(tmp_path / "gate") as gate_fd, trio.fail_after(DEADLINE):
        async with turn(agent, prompt, make_ctx(tmp_path)) as output:
            async for chunk in output:
                chunks.append(chunk)
                if len(chunks) == 1:
                    # the script cannot go on until the gate opens: this chunk was streamed
                    assert chunk == "first\n"
                    assert not (tmp_path / "finished").exists()
                    open_gate(gate_fd)
    assert len(chunks) >= 2
    assert "".join(chunks) == "first\nsecond\n"
    assert (tmp_path / "finished").exists()


async def test_bytes_pass_as_they_come_even_half_a_character(tmp_path: Path) -> None:
    # é is \303\251 in UTF-8; the script stops between the two bytes: output is bytes, and
    # the first half is passed on at once (the client decodes, not the agent)
    agent, prompt = script_agent("exec", r"printf 'x\303'; read go < gate; printf '\251\n'")
    chunks: list[Chunk] = []
    with gate(tmp_path / "gate") as gate_fd, trio.fail_after(DEADLINE):
        async with turn_bytes(agent, prompt, make_ctx(tmp_path)) as output:
            async for chunk in output:
                chunks.append(chunk)
                if len(chunks) == 1:
                    assert chunk == b"x\303"
                    open_gate(gate_fd)
    assert chunks == [b"x\303", b"\251\n", ExitStatus(0)]


async def test_binary_output_is_passed_on_exactly(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        agent, prompt = script_agent("exec", r"printf 'a\377\000b\200\n'")
        async with turn_bytes(agent, prompt, make_ctx(tmp_path)) as output:
            data = b"".join([c async for c in output if isinstance(c, bytes)])
    assert data == b"a\377\000b\200\n"


# --- exit status, stderr, cwd, environment ---------------------------------------------------


@pytest.mark.parametrize(
    ("script", "stdout", "status"),
    [
        ("echo ok", b"ok\n", 0),
        ("echo out; exit 3", b"out\n", 3),
        ("printf out; exit 2", b"out", 2),
        ("exit 7", b"", 7),
        ("kill -KILL $$", b"", -signal.SIGKILL),
    ],
)
async def test_a_turn_ends_with_the_exit_status_and_nothing_is_added_to_the_reply(
    tmp_path: Path, script: str, stdout: bytes, status: int
) -> None:
    agent, prompt = script_agent("exec", script)
    assert await outcome(agent, prompt, make_ctx(tmp_path)) == (stdout, b"", [status])


@pytest.mark.parametrize(
    ("spec", "stdout", "status"),
    [
        ("exec:sh -c 'echo x; exit 4'", b"x\n", 4),
        ("exec:false", b"", 1),
        ("exec:true", b"", 0),
    ],
)
async def test_exec_ends_its_turn_with_the_exit_status(
    tmp_path: Path, spec: str, stdout: bytes, status: int
) -> None:
    assert await outcome(load_agent(spec), "", make_ctx(tmp_path)) == (stdout, b"", [status])


async def test_stderr_comes_apart_from_the_reply_byte_for_byte(tmp_path: Path) -> None:
    script = "echo out; printf 'err\\377\\n' >&2; echo more; exit 5"
    agent, prompt = script_agent("exec", script)
    assert await outcome(agent, prompt, make_ctx(tmp_path)) == (
        b"out\nmore\n", b"err\xff\n", [5]
    )


async def test_stderr_streams_as_it_comes_not_at_the_end(tmp_path: Path) -> None:
    # the first stderr piece arrives while the program still waits for its go-ahead file
    go = tmp_path / "go"
    script = f"echo first >&2; while [ ! -e {go} ]; do sleep 0.01; done; echo done"
    with trio.fail_after(DEADLINE):
        agent, prompt = script_agent("exec", script)
        async with turn_bytes(agent, prompt, make_ctx(tmp_path)) as chunks:
            first = await chunks.__anext__()
            assert first == Stderr(b"first\n")
            go.touch()
            rest = [c async for c in chunks]
    assert rest == [b"done\n", ExitStatus(0)]




@pytest.mark.parametrize("kind", KINDS)
async def test_runs_in_the_turns_directory(tmp_path: Path, kind: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    assert Path.cwd().resolve() != work.resolve()
    agent, prompt = script_agent(kind, "pwd -P")
    assert await reply(agent, prompt, make_ctx(work)) == f"{work.resolve()}\n"


@pytest.mark.parametrize("kind", KINDS)
async def test_environment_is_the_workers_plus_session_and_turn(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_AGENTD_TEST_INHERITED", "inherited")
    agent, prompt = script_agent(
        kind, 'echo "$TRIO_AGENTD_SESSION $TRIO_AGENTD_TURN $TRIO_AGENTD_TEST_INHERITED"'
    )
    assert await reply(agent, prompt, make_ctx(tmp_path, turn=4)) == f"{SESSION} 4 inherited\n"


@pytest.mark.parametrize("kind", KINDS)
async def test_a_missing_directory_is_a_bad_request(tmp_path: Path, kind: str) -> None:
    agent, prompt = script_agent(kind, "echo never")
    missing = tmp_path / "gone"
    with pytest.raises(AgentdError) as info:
        await reply(agent, prompt, make_ctx(missing))
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert str(missing) in info.value.message
    assert "create the directory" in info.value.message


# --- exec: the prompt on stdin ---------------------------------------------------------------


async def test_exec_cat_echoes_the_prompt(tmp_path: Path) -> None:
    prompt = "hello\nwörld, no trailing newline"
    assert await reply(load_agent("exec:cat"), prompt, make_ctx(tmp_path)) == prompt


@pytest.mark.parametrize(("prompt", "count"), [("héllo\n", 7), ("", 0)])
async def test_exec_wc_counts_the_prompt_bytes(tmp_path: Path, prompt: str, count: int) -> None:
    got = await reply(load_agent("exec:wc -c"), prompt, make_ctx(tmp_path))
    assert got.strip() == str(count)


async def test_exec_a_large_prompt_does_not_deadlock(tmp_path: Path) -> None:
    # far beyond both pipe buffers: cat blocks on stdout unless we read while still writing
    prompt = "0123456789abcdef\n" * (4 * 1024 * 1024 // 17)
    assert await reply(load_agent("exec:cat"), prompt, make_ctx(tmp_path)) == prompt


async def test_exec_a_child_that_ignores_its_stdin_is_fine(tmp_path: Path) -> None:
    prompt = "x" * (4 * 1024 * 1024)
    assert await reply(load_agent("exec:true"), prompt, make_ctx(tmp_path)) == ""


async def test_exec_a_child_that_closes_its_stdin_early_is_fine(tmp_path: Path) -> None:
    # the rest of the prompt cannot be written (EPIPE): that is the child's choice, not an error
    agent = load_agent("exec:sh -c 'exec <&-; echo closed; read go < gate; echo done'")
    prompt = "x" * (4 * 1024 * 1024)

    async def open_gate_once_writing_failed(gate_fd: int) -> None:
        # stdin is closed (we saw "closed") and the turn now waits for output with the writer
        # beside it: once every task is blocked, the writer has met the closed pipe
        await trio.testing.wait_all_tasks_blocked()
        open_gate(gate_fd)

    chunks: list[str] = []
    with gate(tmp_path / "gate") as gate_fd, trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery, turn(agent, prompt, make_ctx(tmp_path)) as out:
            async for chunk in out:
                chunks.append(chunk)
                if chunk == "closed\n":
                    nursery.start_soon(open_gate_once_writing_failed, gate_fd)
    assert "".join(chunks) == "closed\ndone\n"


async def test_exec_keeps_writing_stdin_after_stdout_closes(tmp_path: Path) -> None:
    prompt = "y" * (1024 * 1024)
    agent = load_agent("exec:sh -c 'exec >&-; cat > got'")
    assert await reply(agent, prompt, make_ctx(tmp_path)) == ""
    assert (tmp_path / "got").read_text() == prompt


async def test_exec_unknown_executable_names_it_and_the_fix(tmp_path: Path) -> None:
    agent = load_agent("exec:trio-agentd-no-such-program --flag")
    with pytest.raises(AgentdError) as info:
        await reply(agent, "hi", make_ctx(tmp_path))
    assert info.value.code == ErrorCode.BAD_REQUEST
    message = info.value.message
    assert "'trio-agentd-no-such-program'" in message
    assert "PATH" in message
    assert "install it" in message
    assert "full path" in message


async def test_exec_missing_relative_program_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(AgentdError) as info:
        await reply(load_agent("exec:./nope.sh"), "hi", make_ctx(tmp_path))
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "'./nope.sh'" in info.value.message
    assert str(tmp_path) in info.value.message


async def test_exec_a_file_that_is_not_executable_is_a_bad_request(tmp_path: Path) -> None:
    program = tmp_path / "agent.sh"
    program.write_text("#!/bin/sh\necho hi\n")
    program.chmod(0o644)
    with pytest.raises(AgentdError) as info:
        await reply(ExecAgent([str(program)]), "hi", make_ctx(tmp_path))
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "not executable" in info.value.message
    assert "chmod +x" in info.value.message


# --- cancellation: the whole process group goes, and is reaped -------------------------------

# Three processes in the turn's group, each pid written to ``pids`` (leader first) before
# ``ready`` is printed: the leader shell, a background sleep, and a foreground sleep (a child
# shell that records its pid, then execs sleep).
GROUP_SCRIPT = (
    "echo $$ > pids; sleep 30 & echo $! >> pids; "
    "sh -c 'echo $$ >> pids; echo ready; exec sleep 30'"
)


def read_group(tmp_path: Path) -> list[int]:
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3
    return pids


@pytest.mark.parametrize("kind", KINDS)
async def test_cancelling_a_turn_kills_and_reaps_its_process_group(
    tmp_path: Path, kind: str
) -> None:
    agent, prompt = script_agent(kind, GROUP_SCRIPT)
    with contextlib.ExitStack() as stack, trio.fail_after(DEADLINE):
        fds: list[int] = []
        seen = ""
        async with turn(agent, prompt, make_ctx(tmp_path)) as output:
            with trio.CancelScope() as scope:
                async for chunk in output:
                    seen += chunk
                    if "ready" in seen:
                        pids = read_group(tmp_path)
                        fds = stack.enter_context(watched(pids))
                        assert {os.getpgid(pid) for pid in pids} == {pids[0]}
                        # the generator is cancelled while it waits for more output
                        scope.cancel()
        assert scope.cancelled_caught
        assert fds
        await wait_all_exited(fds)
        assert_reaped(pids[0])


@pytest.mark.filterwarnings("ignore:Async generator .* was garbage collected:ResourceWarning")
async def test_a_turn_dropped_while_its_consumer_is_cancelled_still_kills_its_group(
    tmp_path: Path,
) -> None:
    # the worker's shape: cancelled while it handles a chunk (the generator is parked at its
    # yield), and it does not close the generator; trio's finalizer has to
    agent, prompt = script_agent("exec", GROUP_SCRIPT)
    with contextlib.ExitStack() as stack, trio.fail_after(DEADLINE):
        fds: list[int] = []
        seen = ""
        gen = agent.turn(prompt, make_ctx(tmp_path))
        with trio.CancelScope() as scope:
            async for chunk in gen:
                if isinstance(chunk, bytes):  # no other kind here: sh's stdout only
                    seen += chunk.decode()
                if "ready" in seen:
                    pids = read_group(tmp_path)
                    fds = stack.enter_context(watched(pids))
                    scope.cancel()
                    await trio.lowlevel.checkpoint()  # cancelled here, outside the generator
        assert scope.cancelled_caught
        del gen
        await wait_all_exited(fds)
        # the finalizer runs the same cleanup, reaping included, in a system task
        await trio.testing.wait_all_tasks_blocked()
        assert_reaped(pids[0])


async def test_closing_a_turn_early_kills_its_group(tmp_path: Path) -> None:
    agent, prompt = script_agent("exec", GROUP_SCRIPT)
    with contextlib.ExitStack() as stack, trio.fail_after(DEADLINE):
        async with turn(agent, prompt, make_ctx(tmp_path)) as output:
            seen = ""
            while "ready" not in seen:
                seen += await anext(output)
            pids = read_group(tmp_path)
            fds = stack.enter_context(watched(pids))
        # closed by ``aclosing`` while parked at a yield
        await wait_all_exited(fds)
        assert_reaped(pids[0])


async def test_a_group_that_ignores_sigterm_gets_sigkill_after_the_grace(tmp_path: Path) -> None:
    agent, prompt = script_agent("exec", "trap '' TERM; " + GROUP_SCRIPT, kill_grace=0.2)
    with contextlib.ExitStack() as stack, trio.fail_after(DEADLINE):
        fds: list[int] = []
        seen = ""
        async with turn(agent, prompt, make_ctx(tmp_path)) as output:
            with trio.CancelScope() as scope:
                async for chunk in output:
                    seen += chunk
                    if "ready" in seen:
                        pids = read_group(tmp_path)
                        fds = stack.enter_context(watched(pids))
                        scope.cancel()
        assert scope.cancelled_caught
        await wait_all_exited(fds)
        assert_reaped(pids[0])


async def test_background_processes_do_not_outlive_a_finished_turn(tmp_path: Path) -> None:
    # output redirected, so the turn ends when the shell exits; the sleep must not stay
    agent, prompt = script_agent(
        "exec", "sleep 30 >/dev/null 2>&1 & echo $!; read go < gate; echo bye")
    chunks: list[str] = []
    with (
        contextlib.ExitStack() as stack,
        gate(tmp_path / "gate") as gate_fd,
        trio.fail_after(DEADLINE),
    ):
        fds: list[int] = []
        async with turn(agent, prompt, make_ctx(tmp_path)) as output:
            async for chunk in output:
                chunks.append(chunk)
                if len(chunks) == 1:
                    fds = stack.enter_context(watched([int(chunk)]))
                    open_gate(gate_fd)
        assert chunks[-1] == "bye\n"
        await wait_all_exited(fds)


# --- specs ------------------------------------------------------------------------------------


def test_load_echo() -> None:
    agent = load_agent("echo")
    assert isinstance(agent, EchoAgent)
    assert agent.replayable


def test_load_shell() -> None:
    agent = load_agent("shell")
    assert isinstance(agent, ShellAgent)
    assert isinstance(agent, Agent)
    assert not agent.replayable


@pytest.mark.parametrize(
    ("spec", "argv"),
    [
        ("exec:cat", ("cat",)),
        ("exec:wc -c", ("wc", "-c")),
        ("exec:  my-agent --model 'big one' ", ("my-agent", "--model", "big one")),
        ("exec:sh -c 'echo a; echo b'", ("sh", "-c", "echo a; echo b")),
    ],
)
def test_load_exec_splits_like_a_shell(spec: str, argv: tuple[str, ...]) -> None:
    agent = load_agent(spec)
    assert isinstance(agent, ExecAgent)
    assert isinstance(agent, Agent)
    assert agent.argv == argv
    assert not agent.replayable


def test_load_module_attribute() -> None:
    agent = load_agent("trio_agentd.agents._echo:EchoAgent")
    assert isinstance(agent, EchoAgent)


@pytest.mark.parametrize(
    "spec",
    [
        "echo",
        "shell",
        "exec:cat",
        "exec:sh -c 'exit 1'",
        "trio_agentd.agents._echo:EchoAgent",
        "no_such_module:factory",  # syntax only: importing is the worker's business
        "shellmod:factory",  # a module whose name starts with "shell" is still a module
        "exec_tools:factory",
    ],
)
def test_validate_accepts_every_form(spec: str) -> None:
    validate_agent_spec(spec)


@pytest.mark.parametrize(
    "spec",
    ["", "bogus", "Shell", "shell ", " echo", "shellx", "exec", ":factory", "mod:",
     "mod:a:b", "my-mod:factory", "mod:a.b", "mod.:f", "mod:1f"],
)
def test_malformed_specs_are_bad_requests(spec: str) -> None:
    for check in (validate_agent_spec, load_agent):
        with pytest.raises(AgentdError) as info:
            check(spec)
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert "unknown agent" in info.value.message
        assert "exec:COMMAND" in info.value.message


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("exec:", "names no command"),
        ("exec:   ", "names no command"),
        ("exec:''", "names no command"),
        ("exec:cat 'unbalanced", "cannot split"),
    ],
)
def test_exec_without_a_usable_command_is_a_bad_request(spec: str, says: str) -> None:
    for check in (validate_agent_spec, load_agent):
        with pytest.raises(AgentdError) as info:
            check(spec)
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert says in info.value.message


def test_exec_agent_refuses_an_empty_argv() -> None:
    with pytest.raises(AgentdError) as info:
        ExecAgent([])
    assert info.value.code == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("trio_agentd_no_such_module:factory",
         "cannot be loaded: ModuleNotFoundError: No module named 'trio_agentd_no_such_module'"),
        ("shellmod:factory", "cannot be loaded: ModuleNotFoundError"),
        ("trio_agentd.agents._echo:NoSuchFactory", "cannot be loaded: AttributeError: module"
         " 'trio_agentd.agents._echo' has no attribute 'NoSuchFactory'"),
        ("builtins:object", "its factory returned object, which has no turn()/replayable"),
    ],
)
def test_well_formed_but_unloadable_module_specs(spec: str, says: str) -> None:
    validate_agent_spec(spec)
    with pytest.raises(AgentLoadError) as info:
        load_agent(spec)
    assert info.value.code == ErrorCode.AGENT_FAILED
    assert says in info.value.message
    assert repr(spec) in info.value.message
    assert "\n" not in info.value.message


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("def make(:\n", "SyntaxError: invalid syntax (brokenagent.py, line 1)"),
        ("raise RuntimeError('no API key\\nset KEY')\n", "RuntimeError: no API key set KEY"),
        ("def make():\n    raise ValueError('bad config')\n", "ValueError: bad config"),
        ("def make():\n    return None\n", "its factory returned NoneType, which has no"
         " turn()/replayable (the factory must return an agent: see docs/agents.md)"),
        ("def make():\n    import sys; sys.exit(3)\n", "SystemExit: 3"),
    ],
)
def test_a_broken_module_is_one_line_with_its_traceback_kept(
        tmp_path: Path, source: str, says: str, request: pytest.FixtureRequest) -> None:
    name = f"brokenagent{request.node.callspec.indices['source']}"  # fresh: not yet imported
    (tmp_path / f"{name}.py").write_text(source)
    with pytest.raises(AgentLoadError) as info:
        load_agent(f"{name}:make", [str(tmp_path)])
    assert info.value.code == ErrorCode.AGENT_FAILED
    assert info.value.message == (
        f"agent '{name}:make' cannot be loaded: {says.replace('brokenagent', name)}")
    if "returned" not in says:  # an exception: its whole traceback is kept for the log
        assert info.value.traceback.startswith("Traceback (most recent call last):")
        assert f"{name}.py" in info.value.traceback
    assert str(tmp_path) not in sys.path  # the session's path was for that import alone


def test_spawning_does_not_happen_at_load(tmp_path: Path) -> None:
    # an unknown program is reported where it would run (the first turn), not at load
    agent = load_agent(f"exec:{shlex.quote(str(tmp_path / 'not-yet-installed'))}")
    assert isinstance(agent, ExecAgent)


def test_a_module_written_after_its_directory_was_listed_loads(tmp_path: Path) -> None:
    """A worker forked from the template has the template's import caches: a directory's
    listing, refreshed only when its mtime moves. A module written within the same tick (here:
    the mtime set back) must still load."""
    import importlib.machinery

    (tmp_path / "seenagent.py").write_text("x = 1\n")
    before = os.stat(tmp_path)
    finder = importlib.machinery.FileFinder(
        str(tmp_path), (importlib.machinery.SourceFileLoader, [".py"]))
    sys.path_importer_cache[str(tmp_path)] = finder
    try:
        assert finder.find_spec("seenagent") is not None  # the directory is listed now
        (tmp_path / "newagent.py").write_text(
            "from trio_agentd.agents._echo import EchoAgent\n\ndef make():\n"
            "    return EchoAgent()\n")
        os.utime(tmp_path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert finder.find_spec("newagent") is None  # stale: what the import system would see
        agent = load_agent("newagent:make", [str(tmp_path)])
        assert type(agent).__name__ == "EchoAgent"
    finally:
        sys.path_importer_cache.pop(str(tmp_path), None)
        sys.modules.pop("newagent", None)
