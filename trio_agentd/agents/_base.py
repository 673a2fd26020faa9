"""The agent interface: an async object that takes a prompt and yields output chunks.

The types every agent and its host share, and nothing that knows a particular agent: the
spec syntax is in ``_spec`` and building an agent from its spec in ``_load``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from .._errors import AgentdError, ErrorCode
from .._procstate import GroupIdentity
from ._spec import validate_agent_spec as validate_agent_spec  # the supervisor's import


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
    pipes: bool = False
    """The host takes :class:`Waiting` chunks: an agent that reads a pipe may yield one instead
    of reading the bytes itself (the worker does; other hosts leave this False)."""


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


@dataclass(frozen=True, slots=True)
class Waiting:
    """Output waiting in one of the agent's pipes: ``size`` bytes readable on ``fd`` right now.

    Yielded only when :attr:`TurnContext.pipes` is set. The host reads up to ``size`` bytes
    from ``fd`` itself before the turn goes on (on Linux it moves them from the pipe into the
    turn's output file without copying them through Python); whatever it leaves stays in the
    pipe for the agent to offer again. ``stderr`` marks the agent's diagnostics pipe.
    """

    fd: int
    size: int
    stderr: bool = False


Chunk = str | bytes | Stderr | ExitStatus | Waiting
"""What a turn yields: reply text (sent as UTF-8) or bytes (sent exactly), diagnostics, and at
the end, optionally, its exit status; :class:`Waiting` only for a host that asked for it."""


@runtime_checkable
class Agent(Protocol):
    """One session's agent.

    ``replayable`` declares whether a command accepted before a crash may be run again after
    the worker restarts; a non-replayable agent's interrupted command is reported to
    its client as ``command_interrupted`` instead.

    An agent may also declare ``immediate = True`` (optional; absent means ``False``): its
    turns never wait on anything (no I/O, no sleep, nothing awaited but the worker's sends of
    their chunks). The worker then runs such a turn in the task that read its prompt, without
    a task of its own; a turn that did wait would hold up that connection's other requests
    (its pings too) until it ends.
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
