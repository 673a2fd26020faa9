"""Agents for end-to-end tests, loaded by real workers as ``tests.fixture_agents:NAME``.

Each appends to the file named by ``TA_FIXTURE_FILE``: ``start <prompt>`` when a turn begins and
``done <prompt>`` when it completes, ~``TA_FIXTURE_DELAY`` seconds later, so a test can count
exactly how often a command started and finished across kills.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import AsyncIterator

import trio

from trio_agentd.agents import TurnContext


def _append(line: str) -> None:
    path = os.environ["TA_FIXTURE_FILE"]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class _Slow:
    replayable = False

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        _append(f"start {prompt}")
        await trio.sleep(float(os.environ.get("TA_FIXTURE_DELAY", "1.0")))
        _append(f"done {prompt}")
        yield f"[slow turn {ctx.turn}] {prompt}\n"


class SlowReplayable(_Slow):
    replayable = True


class SlowOnce(_Slow):
    replayable = False


def slow_replayable() -> SlowReplayable:
    return SlowReplayable()


def slow_once() -> SlowOnce:
    return SlowOnce()


class _Echo:
    replayable = True

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        yield f"[echo turn {ctx.turn}] {prompt}\n"


def at_exit() -> _Echo:
    """An echo agent whose process, when it ends, appends ``atexit <pid>`` (an agent's
    ``atexit`` handler runs however its worker leaves)."""
    atexit.register(_append, f"atexit {os.getpid()}")
    return _Echo()


def _leave_when_let(pid: int) -> None:
    """Append ``leaving <pid>``, wait until someone opens the FIFO ``TA_FIXTURE_FIFO`` for
    writing and closes it, then append ``atexit <pid>``."""
    _append(f"leaving {pid}")
    with open(os.environ["TA_FIXTURE_FIFO"], "rb") as fifo:
        fifo.read()
    _append(f"atexit {pid}")


def at_exit_waits() -> _Echo:
    """An echo agent whose ``atexit`` handler holds its worker, leaving, until the test lets
    it go (a window for signals that must not end it midway)."""
    atexit.register(_leave_when_let, os.getpid())
    return _Echo()
