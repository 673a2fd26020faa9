"""Is the peer of a connection still alive? Silence, measured by the reader, and a ping.

A worker that is SIGSTOPped (or whose event loop is blocked) keeps its sockets open: its links
never drop, so a prompt waiting on it would wait for ever. Silence alone does not tell a hung
worker from a turn that produces no output for minutes, so after ``interval`` of silence the
watching side *pings*: a worker whose loop runs answers at once, whatever its turn is doing.

A link may be watched at two paces. While it is *busy* — a call waits on the peer
(:meth:`Silence.call_started` … :meth:`Silence.call_ended`), or the peer said it runs a turn
(:meth:`Silence.peer_busy`) — it is pinged after ``interval`` of silence, counted from the later
of the last arrival and the moment it became busy: a call meets a hung peer at most ``interval
+ ping_timeout`` after it was sent (or after the peer's last sign of life during it). While it
is idle, an ``idle_interval`` (much longer) applies instead: an idle hung peer is still found,
at most ``idle_interval + ping_timeout`` after its last sign of life, but a hundred idle links
cost a hundred pings per ``idle_interval``, not per ``interval``. Someone about to use the peer
by another path (a client given a direct route to it) calls :meth:`Silence.probe`: until the
peer next says anything, the link is paced as if busy since the probe, so the peer is pinged
only if it says nothing for ``interval`` after it (a client's prompt makes a worker speak).

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
        self.outstanding = 0  # calls waiting on the peer
        self.turn_running = False  # the peer said it runs a turn
        self.busy_since: float | None = None  # busy (a call, or a turn) since then
        self.probe_at: float | None = None  # a probe asked for then, nothing arrived since
        self._changed = trio.Event()

    def waiting(self) -> None:
        self.waiting_since = trio.current_time()
        self._poke()

    def arrived(self) -> None:
        self.waiting_since = None
        self.received += 1
        self.probe_at = None  # answered: the peer's loop runs
        self._poke()

    def call_started(self) -> None:
        """A call now waits on the peer: the busy pace applies, counted from now at the
        earliest."""
        self.outstanding += 1
        self._busy_changed()

    def call_ended(self) -> None:
        self.outstanding -= 1
        self._busy_changed()

    def peer_busy(self, running: bool) -> None:
        """The peer said it started (``True``) or finished (``False``) a turn."""
        self.turn_running = running
        self._busy_changed()

    def probe(self) -> None:
        """Someone is about to use the peer: until it next says anything, pace the link as if
        busy since now (see the module's docstring). Costs nothing if the peer says anything
        within ``interval``."""
        if self.probe_at is None:
            self.probe_at = trio.current_time()
            self._poke()

    def _busy_changed(self) -> None:
        busy = self.outstanding > 0 or self.turn_running
        if not busy:
            self.busy_since = None
        elif self.busy_since is None:
            self.busy_since = trio.current_time()
        self._poke()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_silent(
        self, seconds: float, *, since: float = -math.inf, baseline: int | None = None,
        idle_seconds: float | None = None,
    ) -> bool:
        """Wait until the reader has waited ``seconds`` on the peer with nothing arriving,
        counted from ``since`` at the earliest: ``True``. If ``baseline`` is given, return
        ``False`` as soon as more than ``baseline`` messages have arrived.

        With ``idle_seconds``, ``seconds`` applies only while the link is busy (and counts from
        when it became busy at the earliest); while it is idle, ``idle_seconds`` does, or as
        ``seconds`` counted from a pending probe, if that comes sooner."""
        while True:
            if baseline is not None and self.received > baseline:
                return False
            changed = self._changed
            start = self.waiting_since
            if start is None:
                await changed.wait()
                continue
            base = max(start, since)
            if idle_seconds is None:
                deadline = base + seconds
            elif self.busy_since is not None:
                deadline = max(base, self.busy_since) + seconds
            else:
                deadline = base + idle_seconds
                if self.probe_at is not None:
                    deadline = min(deadline, max(base, self.probe_at) + seconds)
            if trio.current_time() >= deadline:
                return True
            # (woken by the deadline, it looks again: a message that came in the deadline's
            # own pass, or a reader that stopped, counts)
            with trio.move_on_at(deadline):
                await changed.wait()


async def watch(
    silence: Silence,
    send_ping: Callable[[], Awaitable[None]],
    *,
    interval: float,
    ping_timeout: float,
    idle_interval: float | None = None,
) -> float:
    """Ping whenever the peer has been silent for ``interval``; return (the time the unanswered
    ping was sent) once nothing at all arrived within ``ping_timeout`` of a ping, or the ping
    could not even be sent within ``ping_timeout`` (the peer reads nothing).

    With ``idle_interval``, ``interval`` is the pace while the link is busy (counted from when
    it became busy at the earliest) and ``idle_interval`` the pace while it is idle (see the
    module's docstring); without it, ``interval`` applies all the time.

    Anything that arrives after the ping answers it: the pong, or any other message (every
    message proves the peer's loop runs). ``send_ping`` may raise to end the watch (the link
    closed).

    Cancellation: a ping cancelled half-way may leave a partial frame; the caller closes the
    connection when this returns or is cancelled by a timeout.
    """
    while True:
        await silence.wait_silent(interval, idle_seconds=idle_interval)
        at = trio.current_time()
        seen = silence.received
        with trio.move_on_at(at + ping_timeout) as sending:
            await send_ping()
        if sending.cancelled_caught:
            return at
        if not await silence.wait_silent(ping_timeout, since=at, baseline=seen):
            continue
        return at
