"""Is the peer of a connection still alive? Silence, measured by the reader, and a ping.

A worker that is SIGSTOPped (or whose event loop is blocked) keeps its sockets open: its links
never drop, so a prompt waiting on it would wait for ever. Silence alone does not tell a hung
worker from a turn that produces no output for minutes, so after ``interval`` of silence the
watching side *pings*: a worker whose loop runs answers at once, whatever its turn is doing.

Silence counts only while the connection's reader waits on the peer. A reader that is blocked
handing a message to a slow consumer (backpressure) is not waiting on the peer, and the peer's
answers may be queued behind what it is handing over: that time never counts as silence.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import trio


class Silence:
    """The reader's side: call :meth:`waiting` before each receive, :meth:`arrived` after."""

    def __init__(self) -> None:
        self.waiting_since: float | None = None  # the reader waits on the peer since then
        self.received = 0  # messages that arrived
        self._changed = trio.Event()

    def waiting(self) -> None:
        self.waiting_since = trio.current_time()
        self._poke()

    def arrived(self) -> None:
        self.waiting_since = None
        self.received += 1
        self._poke()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_silent(
        self, seconds: float, *, since: float = -math.inf, baseline: int | None = None
    ) -> bool:
        """Wait until the reader has waited ``seconds`` on the peer with nothing arriving,
        counted from ``since`` at the earliest: ``True``. If ``baseline`` is given, return
        ``False`` as soon as more than ``baseline`` messages have arrived."""
        while True:
            if baseline is not None and self.received > baseline:
                return False
            changed = self._changed
            start = self.waiting_since
            if start is None:
                await changed.wait()
                continue
            with trio.move_on_at(max(start, since) + seconds) as scope:
                await changed.wait()
            if scope.cancelled_caught:
                return True


async def watch(
    silence: Silence,
    send_ping: Callable[[], Awaitable[None]],
    *,
    interval: float,
    ping_timeout: float,
) -> float:
    """Ping whenever the peer has been silent for ``interval``; return (the time the unanswered
    ping was sent) once nothing at all arrived within ``ping_timeout`` of a ping, or the ping
    could not even be sent within ``ping_timeout`` (the peer reads nothing).

    Anything that arrives after the ping answers it: the pong, or any other message (every
    message proves the peer's loop runs). ``send_ping`` may raise to end the watch (the link
    closed).

    Cancellation: a ping cancelled half-way may leave a partial frame; the caller closes the
    connection when this returns or is cancelled by a timeout.
    """
    while True:
        await silence.wait_silent(interval)
        at = trio.current_time()
        seen = silence.received
        with trio.move_on_at(at + ping_timeout) as sending:
            await send_ping()
        if sending.cancelled_caught:
            return at
        if not await silence.wait_silent(ping_timeout, since=at, baseline=seen):
            continue
        return at
