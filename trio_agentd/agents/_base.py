"""The agent interface: an async object that takes a prompt and yields output chunks."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from .._errors import AgentdError, ErrorCode


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnContext:
    session_id: str
    turn: int  # 1-based number of this turn in the session
    cwd: Path
    session_dir: Path


@runtime_checkable
class Agent(Protocol):
    """One session's agent.

    ``replayable`` declares whether a command accepted before a crash may be run again after
    the worker restarts (SPEC §6); a non-replayable agent's interrupted command is reported to
    its client as ``command_interrupted`` instead.
    """

    replayable: bool

    def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        """Run one prompt, yielding output chunks as they come.

        Cancellation: the turn is abandoned; the worker records it interrupted.
        """
        ...


def load_agent(spec: str) -> Agent:
    """Build the agent a spec names: ``echo``, or ``module:attribute`` (a factory)."""
    if spec == "echo":
        from ._echo import EchoAgent

        return EchoAgent()
    if ":" in spec and not spec.startswith(("exec:", "shell")):
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise AgentdError(
                ErrorCode.BAD_REQUEST, f"cannot load agent {spec!r}: {exc}"
            ) from None
        agent = factory()
        if not isinstance(agent, Agent):
            raise AgentdError(
                ErrorCode.BAD_REQUEST,
                f"agent factory {spec!r} returned {type(agent).__name__}, which has no"
                " turn()/replayable",
            )
        return agent
    raise AgentdError(
        ErrorCode.BAD_REQUEST, f"unknown agent {spec!r} — use echo or module:attribute"
    )


def validate_agent_spec(spec: str) -> None:
    """Cheap syntactic check the supervisor runs before spawning a worker for ``spec``."""
    if spec == "echo":
        return
    if ":" in spec and not spec.startswith(("exec:", "shell")):
        module_name, _, attr = spec.partition(":")
        if module_name and attr:
            return
    raise AgentdError(
        ErrorCode.BAD_REQUEST, f"unknown agent {spec!r} — use echo or module:attribute"
    )
