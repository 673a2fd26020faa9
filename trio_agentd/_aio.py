"""The async client's I/O on anyio, so it runs on asyncio and on Trio alike.

- :func:`backend`: the event loop the caller runs on, or one clear line why the client cannot
  run there (no event loop at all, or one anyio does not drive).
- :class:`MessageStream`: the frames of :class:`trio_agentd._framing.Framing` over an anyio
  byte stream (the supervisor and workers use :class:`trio_agentd._stream.MessageStream`, on
  Trio).
- :class:`Silence` and :func:`watch`: is the peer still alive? The client's side of
  :mod:`trio_agentd._liveness` (one pace: a request is outstanding whenever a connection is
  watched) — after ``interval`` of silence the peer is pinged; nothing at all within
  ``ping_timeout`` of the ping ends the watch. Silence counts only while the reader waits on the
  peer: a reader blocked handing a message to a slow consumer (backpressure) is not waiting.

This module imports neither asyncio nor Trio: anyio loads the backend the caller runs on.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc

from ._defaults import CLOSE_TIMEOUT
from ._errors import AgentdError, ErrorCode
from ._framing import RECEIVE_SIZE, Framing
from ._protocol import MAX_FRAME, Message, encode

BACKENDS = ("asyncio", "trio")


def backend() -> str:
    """The async library the calling task runs on (``asyncio`` or ``trio``).

    Raises:
        AgentdError: ``config``, one line naming what is wrong and the fix: called outside any
            event loop, or on an event loop the client does not run on.
    """
    import sniffio

    try:
        name = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        raise AgentdError(
            ErrorCode.CONFIG,
            "trio_agentd's async client needs a running event loop — call it from a coroutine"
            " run by asyncio.run(), trio.run() or anyio.run() (or use the blocking CLI)",
        ) from None
    if name not in BACKENDS:
        raise AgentdError(
            ErrorCode.CONFIG,
            f"trio_agentd's async client runs on asyncio or Trio, not on {name} — run it under"
            " asyncio.run(), trio.run() or anyio.run()",
        )
    return name


class MessageStream(Framing):
    """Frames in, frames out over an anyio byte stream. Sends are serialised by a lock so
    concurrent tasks may send.

    Raises (from its methods): ``anyio.BrokenResourceError`` (the peer went away),
    ``anyio.ClosedResourceError`` (closed here), ``AgentdError`` for a bad frame.

    Cancellation: a cancelled ``send`` may leave a partial frame on the wire; callers close the
    stream after cancelling a send. A cancelled ``receive`` loses nothing: what was read stays
    buffered.
    """

    def __init__(self, stream: anyio.abc.ByteStream, *, limit: int = MAX_FRAME) -> None:
        super().__init__(limit=limit)
        self.stream = stream
        self._send_lock = anyio.Lock()

    async def send(self, msg: Message) -> None:
        data = encode(msg)
        # a free lock is taken without a trip through the event loop (the send is a
        # checkpoint anyway): a frame costs one yield, not two
        try:
            self._send_lock.acquire_nowait()
        except anyio.WouldBlock:
            await self._send_lock.acquire()
        try:
            await self.stream.send(data)
        finally:
            self._send_lock.release()

    async def _fill(self, want: int = RECEIVE_SIZE) -> bool:
        if self._eof:
            return False
        try:
            data = await self.stream.receive(max(want, RECEIVE_SIZE))
        except anyio.EndOfStream:
            data = b""
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def aclose(self) -> None:
        with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
            await self.stream.aclose()


async def connect_unix(path: str) -> anyio.abc.SocketStream:
    """A connected Unix-socket stream (raises ``OSError`` as ``connect(2)`` does).

    A listener whose backlog is full makes a non-blocking unix connect fail with EAGAIN,
    which the event loop takes for "in progress" and then for success: the stream it returns
    is connected to nobody (its peer's credentials read as uid -1). That is raised here as the
    ``BlockingIOError`` ``connect(2)`` gave.
    """
    import errno
    import os

    stream = await anyio.connect_unix(path)
    try:
        raw_socket(stream).getpeername()
    except OSError as exc:
        await stream.aclose()
        if exc.errno != errno.ENOTCONN:
            raise
        raise BlockingIOError(errno.EAGAIN, f"{os.strerror(errno.EAGAIN)}: {path}") from None
    return stream


def raw_socket(stream: anyio.abc.SocketStream) -> Any:
    """The stream's socket, for ``getsockopt`` (the peer's credentials)."""
    return stream.extra(anyio.abc.SocketAttribute.raw_socket)


class Silence:
    """The reader's side: call :meth:`waiting` before each receive, :meth:`arrived` after."""

    def __init__(self) -> None:
        self.waiting_since: float | None = None  # the reader waits on the peer since then
        self.received = 0  # messages that arrived
        self._changed: anyio.Event | None = None  # made by a watcher, set on any change

    def waiting(self) -> None:
        self.waiting_since = anyio.current_time()
        self._poke()

    def arrived(self) -> None:
        self.waiting_since = None
        self.received += 1
        self._poke()

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_silent(
        self, seconds: float, *, since: float = -math.inf, baseline: int | None = None
    ) -> bool:
        """Wait until the reader has waited ``seconds`` on the peer with nothing arriving,
        counted from ``since`` at the earliest: ``True``. If ``baseline`` is given, return
        ``False`` as soon as more than ``baseline`` messages have arrived.

        Without ``baseline`` nothing needs to wake at each message: this sleeps to the
        deadline the reader's state gives and looks again (a reader that is not waiting is
        looked at again ``seconds`` later, which is no later than its wait could end), so a
        busy connection costs its reader two attribute writes per message, not a wakeup.
        """
        while baseline is None:
            start = self.waiting_since
            if start is None:
                await anyio.sleep(seconds)
                continue
            deadline = max(start, since) + seconds
            if anyio.current_time() >= deadline:
                return True
            await anyio.sleep_until(deadline)
        while True:
            if self.received > baseline:
                return False
            if self._changed is None:
                self._changed = anyio.Event()
            changed = self._changed
            start = self.waiting_since
            if start is None:
                await changed.wait()
                continue
            with anyio.CancelScope(deadline=max(start, since) + seconds) as scope:
                await changed.wait()
            if scope.cancelled_caught:
                return True


async def watch(
    silence: Silence,
    send_ping: Callable[[], Awaitable[None]],
    *,
    interval: float,
    ping_timeout: float,
    active: Callable[[], bool] = lambda: True,
) -> float | None:
    """Ping whenever the peer has been silent for ``interval``; return (the time the unanswered
    ping was sent) once nothing at all arrived within ``ping_timeout`` of a ping, or the ping
    could not even be sent within ``ping_timeout`` (the peer reads nothing). Return ``None``
    when, woken to ping or to judge a ping, ``active()`` says nobody waits on the peer any more.

    Anything that arrives after the ping answers it. ``send_ping`` may raise to end the watch.

    Cancellation: a ping cancelled half-way may leave a partial frame; the caller closes the
    connection when this returns or is cancelled by a timeout.
    """
    while True:
        await silence.wait_silent(interval)
        if not active():
            return None
        at = anyio.current_time()
        seen = silence.received
        with anyio.CancelScope(deadline=at + ping_timeout) as sending:
            await send_ping()
        if sending.cancelled_caught:
            return at
        if not await silence.wait_silent(ping_timeout, since=at, baseline=seen):
            continue
        return at if active() else None
