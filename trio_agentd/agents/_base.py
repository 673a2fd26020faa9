"""The agent interface: an async object that takes a prompt and yields output chunks.

Spec forms: ``echo``, ``shell``, ``exec:COMMAND`` and ``module:attribute``. The
supervisor checks a spec with :func:`validate_agent_spec` before it spawns a worker, so a typo
is a ``bad_request`` to the client rather than a worker that fails to start; the worker then
builds the agent with :func:`load_agent`, which checks the same syntax first.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from .._errors import AgentdError, ErrorCode
from .._identity import GroupIdentity

EXEC_PREFIX = "exec:"


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnContext:
    session_id: str
    turn: int  # 1-based number of this turn in the session
    cwd: Path
    session_dir: Path
    on_group: Callable[[GroupIdentity], None] | None = None
    """Told of each process group the turn starts, once it exists and before it runs the
    agent's work (the worker journals it, to stop it after a crash). Raising refuses the
    turn: the group is killed unstarted and the exception propagates."""


@dataclass(frozen=True, slots=True)
class Stderr:
    """A piece of the agent's diagnostics (its stderr), yielded by a turn among its output.

    Kept and streamed apart from the reply: the CLI writes it to its own stderr, ``--json``
    and the transcript keep it in a field of its own.
    """

    data: bytes | str


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How the turn's command ended, yielded last by an agent that has one.

    ``code`` ≥ 0 is an exit status; a negative ``code`` is death by signal ``-code`` (the
    ``subprocess`` convention). A turn that yields none succeeded as far as anyone can tell
    (the CLI exits 0).
    """

    code: int


Chunk = str | bytes | Stderr | ExitStatus
"""What a turn yields: reply text (sent as UTF-8) or bytes (sent exactly), diagnostics, and at
the end, optionally, its exit status."""


@runtime_checkable
class Agent(Protocol):
    """One session's agent.

    ``replayable`` declares whether a command accepted before a crash may be run again after
    the worker restarts; a non-replayable agent's interrupted command is reported to
    its client as ``command_interrupted`` instead.
    """

    replayable: bool

    def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[Chunk]:
        """Run one prompt, yielding output chunks as they come: text (sent as UTF-8) or bytes
        (sent exactly as they are), :class:`Stderr` pieces, and last, optionally, an
        :class:`ExitStatus`. A turn has no size limit: chunks are streamed, never gathered in
        memory.

        Cancellation: the turn is abandoned; the worker records it interrupted.
        """
        ...


def _unknown(spec: str) -> AgentdError:
    return AgentdError(
        ErrorCode.BAD_REQUEST,
        f"unknown agent {spec!r} — use echo, shell, exec:COMMAND or module:attribute",
    )


def _split_factory(spec: str) -> tuple[str, str] | None:
    """``(module, attribute)`` if ``spec`` has that shape: a dotted module name and a name."""
    module_name, sep, attr = spec.partition(":")
    if (
        sep
        and attr.isidentifier()
        and all(part.isidentifier() for part in module_name.split("."))
    ):
        return module_name, attr
    return None


def validate_agent_spec(spec: str) -> None:
    """Cheap syntactic check the supervisor runs before spawning a worker for ``spec``.

    It looks at no files and imports nothing: whether an ``exec`` program exists is decided
    where it runs (the session's directory and environment), at its first turn.

    Raises:
        AgentdError: ``bad_request``, naming the accepted forms or what is wrong with this one.
    """
    if spec in ("echo", "shell"):
        return
    if spec.startswith(EXEC_PREFIX):
        from ._exec import parse_exec_command

        parse_exec_command(spec.removeprefix(EXEC_PREFIX))
        return
    if _split_factory(spec) is None:
        raise _unknown(spec)


@contextlib.contextmanager
def _import_path(path: Sequence[str]) -> Iterator[None]:
    added = [p for p in path if p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


class AgentLoadError(AgentdError):
    """A ``module:attribute`` agent could not be built: its import failed (ImportError,
    SyntaxError, an exception at import time), the attribute is missing, the factory raised, or
    it returned something that is not an :class:`Agent`.

    ``message`` is one line: the spec and the exception's last line. ``traceback`` is the full
    traceback, for the worker's log.
    """

    def __init__(self, spec: str, what: str, traceback: str = "") -> None:
        super().__init__(ErrorCode.AGENT_FAILED, f"agent {spec!r} cannot be loaded: {what}")
        self.traceback = traceback


class AgentStartError(AgentdError):
    """A turn could not start its agent's process (an ``exec:`` program that is missing or not
    executable, a shell that cannot start): the turn fails with this, and the session is shown
    ``failed`` with this cause until a turn succeeds or ``trio-agentd retry``."""


def _last_line(exc: BaseException) -> str:
    """The exception as the last line of its traceback: ``ModuleNotFoundError: No module named
    'x'``; a SyntaxError keeps its file and line."""
    text = " ".join(str(exc).split())  # one line, whatever the message holds
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_agent(spec: str, path: Sequence[str] = ()) -> Agent:
    """Build the agent a spec names.

    ``echo``, ``shell`` and ``exec:COMMAND`` are built in; ``module:attribute`` imports
    ``module`` and calls ``attribute()`` (a factory taking no arguments). The import looks in
    ``path`` first (the session's cwd and its ``PYTHONPATH``), for that import alone: the
    worker itself never imports from where it happens to be.

    Raises:
        AgentdError: ``bad_request`` for a malformed spec.
        AgentLoadError: ``agent_failed``: the module cannot be imported (any exception, a
            SyntaxError included), it has no such attribute, the factory raised, or it returned
            something without ``turn()``/``replayable``.
    """
    validate_agent_spec(spec)
    if spec == "echo":
        from ._echo import EchoAgent

        return EchoAgent()
    if spec == "shell":
        from ._shell import ShellAgent

        return ShellAgent()
    if spec.startswith(EXEC_PREFIX):
        from ._exec import ExecAgent, parse_exec_command

        return ExecAgent(parse_exec_command(spec.removeprefix(EXEC_PREFIX)))
    parts = _split_factory(spec)
    assert parts is not None  # validated above
    module_name, attr = parts
    import traceback

    try:
        with _import_path(path):
            module = importlib.import_module(module_name)
        factory = getattr(module, attr)
        agent = factory()
    except (Exception, SystemExit) as exc:  # the user's code: what it raises is the answer
        raise AgentLoadError(spec, _last_line(exc), traceback.format_exc()) from None
    if not isinstance(agent, Agent):
        raise AgentLoadError(
            spec,
            f"its factory returned {type(agent).__name__}, which has no turn()/replayable"
            " (the factory must return an agent: see docs/agents.md)",
        )
    return agent
