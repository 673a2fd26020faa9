"""Building an agent from its spec: the built-in ones, or a user's ``module:attribute``.

The only module of the package that knows every built-in agent; the agents themselves know
only the interface (``_base``), so nothing imports back into here.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Sequence

from ._base import Agent, AgentLoadError
from ._spec import EXEC_PREFIX, _split_factory, parse_exec_command, validate_agent_spec


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
        from ._exec import ExecAgent

        return ExecAgent(parse_exec_command(spec.removeprefix(EXEC_PREFIX)))
    parts = _split_factory(spec)
    assert parts is not None  # validated above
    module_name, attr = parts
    import traceback

    try:
        # a worker forked from the template inherits its import caches (directory listings,
        # refreshed only when a directory's mtime moves, which can miss a file written within
        # the same tick): the user's module may be newer than the template
        importlib.invalidate_caches()
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
