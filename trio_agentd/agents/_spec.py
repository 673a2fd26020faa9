"""Agent specs: which forms there are, and the syntax check the supervisor runs. Pure.

Spec forms: ``echo``, ``shell``, ``exec:COMMAND`` and ``module:attribute``. The supervisor
checks a spec with :func:`validate_agent_spec` before it spawns a worker, so a typo is a
``bad_request`` to the client rather than a worker that fails to start; the worker then builds
the agent with ``_load.load_agent``, which checks the same syntax first.
"""

from __future__ import annotations

import shlex

from .._errors import AgentdError, ErrorCode

EXEC_PREFIX = "exec:"


def parse_exec_command(command: str) -> list[str]:
    """Split the ``COMMAND`` of ``exec:COMMAND`` as a POSIX shell would, without running one.

    Raises:
        AgentdError: ``bad_request`` if the command is empty or cannot be split.
    """
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise AgentdError(
            ErrorCode.BAD_REQUEST,
            f"cannot split the command of agent exec:{command}: {exc} — quote it as you would"
            " in a POSIX shell",
        ) from None
    if not argv or not argv[0]:
        raise AgentdError(
            ErrorCode.BAD_REQUEST,
            f"agent exec:{command} names no command — give the program to run, e.g. exec:cat",
        )
    return argv


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
        parse_exec_command(spec.removeprefix(EXEC_PREFIX))
        return
    if _split_factory(spec) is None:
        raise _unknown(spec)
