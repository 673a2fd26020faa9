"""The async client's I/O on anyio, so it runs on asyncio and on Trio alike.

- :func:`backend`: the event loop the caller runs on, or one clear line why the client cannot
  run there (no event loop at all, or one anyio does not drive).
- :class:`MessageStream`: the frames of :class:`trio_agentd._framing.Framing` over an anyio
  byte stream (the supervisor and workers use :class:`trio_agentd._stream.MessageStream`, on
  Trio).
- :class:`Inbox`: one request's messages from its connection's reader, bounded (the reader
  waits for room: backpressure); it costs no trip through the event loop when a message is
  there already, and an event only when a side must wait.
- :func:`native`: the running backend's own event type and clock, found once: anyio's
  ``Event()`` and ``current_time()`` look the backend up again on every call, which on a
  per-prompt path costs more than the event itself.
- :class:`Silence` and :func:`watch`: is the peer still alive? The client's side of
  :mod:`trio_agentd._liveness` (one pace: a request is outstanding whenever a connection is
  watched) — after ``interval`` of silence the peer is pinged; nothing at all within
  ``ping_timeout`` of the ping ends the watch. Silence counts only while the reader waits on the
  peer: a reader blocked handing a message to a slow consumer (backpressure) is not waiting.

This module imports neither asyncio nor Trio up front: anyio loads the backend the caller runs
on, and :func:`native` and :class:`MessageStream` take from the one that is running.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.abc

from ._defaults import CLOSE_TIMEOUT
from ._errors import AgentdError, ErrorCode
from ._framing import RECEIVE_SIZE, Framing
from ._identity import peer_shut
from ._protocol import MAX_FRAME, Message, encode

BACKENDS = ("asyncio", "trio")

T = TypeVar("T")


class NativeEvent(Protocol):
    """What the client needs of an event: ``trio.Event`` and ``asyncio.Event`` both are one."""

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> Any: ...


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


def native() -> tuple[Callable[[], NativeEvent], Callable[[], float]]:
    """The running backend's event type and clock (the clock ``anyio.current_time`` reads, so
    Trio's ``MockClock`` too), for a client that makes an event or reads the clock per
    request. Either event is woken by anyio's cancellation on its own backend."""
    if backend() == "trio":
        import trio

        return trio.Event, trio.current_time
    import asyncio

    return asyncio.Event, asyncio.get_running_loop().time


class Inbox(Generic[T]):
    """One request's messages, from its connection's reader to the request's task: at most
    ``size`` held. The reader :meth:`offer`s a message and, when that finds it full,
    :meth:`put`s it: it waits for room, so a consumer that does not keep up stops the reader
    (backpressure, never a dropped message or an unbounded buffer).

    :meth:`end` (the reader's: nothing more comes) lets the consumer drain what is held, then
    :meth:`get` returns ``None``; :meth:`abandon` (the consumer's: it stopped reading) drops
    what is held and what comes, and frees a reader waiting for room.

    A memory object stream does the same, but costs an allocation of four objects, a trip
    through the event loop on every receive (even one that has its message) and an event
    made through anyio's backend lookup on every wait: here a ready :meth:`get` is a
    ``popleft`` and a wait costs one native event.

    Cancellation: a cancelled :meth:`get` or :meth:`put` loses nothing (the message stays
    held, or stays the reader's).
    """

    __slots__ = ("_abandoned", "_ended", "_event", "_items", "_room", "_size", "_waiter")

    def __init__(self, size: int, event: Callable[[], NativeEvent]) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._size = size
        self._event = event
        self._ended = False
        self._abandoned = False
        self._waiter: NativeEvent | None = None  # the consumer waits for a message
        self._room: NativeEvent | None = None  # the reader waits for room

    def offer(self, item: T) -> bool:
        """Hold ``item`` if there is room (``True``; also when the consumer is gone: the item
        is dropped), else ``False``: the caller :meth:`put`s it."""
        if self._abandoned:
            return True
        if len(self._items) >= self._size:
            return False
        self._items.append(item)
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None
        return True

    async def put(self, item: T) -> None:
        """Hold ``item`` once there is room (or drop it once the consumer is gone)."""
        while not self.offer(item):
            self._room = room = self._event()
            await room.wait()

    def force(self, item: T) -> None:
        """Hold ``item`` now, past the bound: a reader cancelled while it waited for room
        leaves its message here rather than lose it (at most one over, per cancelled put)."""
        if not self._abandoned:
            self._items.append(item)

    async def get(self) -> T | None:
        """The next message, or ``None`` once the reader ended and everything held was got."""
        while not self._items:
            if self._ended or self._abandoned:
                return None
            await self.wait()
        return self.take()

    def take(self) -> T | None:
        """The next message held, or ``None`` if none is (without waiting)."""
        if not self._items:
            return None
        item = self._items.popleft()
        if self._room is not None:
            self._room.set()
            self._room = None
        return item

    @property
    def over(self) -> bool:
        """Nothing held, and nothing more will come (ended, or abandoned)."""
        return not self._items and (self._ended or self._abandoned)

    @property
    def holding(self) -> bool:
        """A message is held, or the end is: :meth:`get` would not wait."""
        return bool(self._items) or self._ended or self._abandoned

    async def wait(self) -> None:
        """Wait until a message or the end comes, or :meth:`nudge` is called."""
        if self.holding:
            return
        self._waiter = waiter = self._event()
        await waiter.wait()

    def unwait(self) -> None:
        """The consumer stopped waiting (cancelled): a nudge finds nobody here."""
        self._waiter = None

    @property
    def ended(self) -> bool:
        """The connection ended (:meth:`end`)."""
        return self._ended

    def nudge(self) -> bool:
        """Wake the consumer waiting in :meth:`wait` (whether it waits)."""
        if self._waiter is None:
            return False
        self._waiter.set()
        self._waiter = None
        return True

    def end(self) -> None:
        """Nothing more will come (the connection ended)."""
        self._ended = True
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def abandon(self) -> None:
        """The consumer stopped reading: drop what is held and free a waiting reader."""
        self._abandoned = True
        self._items.clear()
        if self._room is not None:
            self._room.set()
            self._room = None


class MessageStream(Framing):
    """Frames in, frames out over an anyio byte stream. Sends are serialised by a lock so
    concurrent tasks may send.

    On Trio, a frame the socket takes whole goes out with one ``send(2)`` and no trip through
    the event loop (anyio's and Trio's sends each yield once even when the kernel took it all):
    a request then waits for its answer, which is the trip it needs anyway. A caller that is
    cancelled already sends nothing, as before. Reads go to the socket too, as Trio's ``recv``
    does them (a read that finds bytes yields once; one that finds none waits for the socket
    to be readable) without the two layers of wrappers around it. On asyncio the stream's
    transport owns the socket, so every frame goes through it.

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
        self._closed = False
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        # on Trio: the socket, sent on and read from directly
        self._direct = _TrioSocket(sock) if sock is not None and backend() == "trio" else None

    async def send(self, msg: Message) -> None:
        data = encode(msg)
        direct = self._direct
        if direct is not None:
            await direct.if_cancelled()  # (no yield unless cancelled)
            if not self._send_lock.locked():
                # nobody sends (or waits to): what the socket takes at once needs no lock, as
                # nothing can start another frame before this returns or takes the lock below
                # (no checkpoint in between)
                sent = self._send_now(data)
                if sent == len(data):
                    return
                data = data[sent:]  # the rest as the stream sends it: waiting for room
        # a free lock is taken without a trip through the event loop
        try:
            self._send_lock.acquire_nowait()
        except anyio.WouldBlock:
            await self._send_lock.acquire()
        try:
            await self.stream.send(data)
        finally:
            self._send_lock.release()

    def _send_now(self, data: bytes) -> int:
        """What of ``data`` the socket takes at once (non-blocking, Trio's socket)."""
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            assert self._direct is not None
            return int(self._direct.sock.send(data))
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise anyio.BrokenResourceError from exc

    async def _fill(self, want: int = RECEIVE_SIZE) -> bool:
        if self._eof:
            return False
        if self._direct is not None:
            data = await self._receive_now(self._direct, max(want, RECEIVE_SIZE))
        else:
            try:
                data = await self.stream.receive(max(want, RECEIVE_SIZE))
            except anyio.EndOfStream:
                data = b""
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def _receive_now(self, direct: _TrioSocket, size: int) -> bytes:
        """Up to ``size`` bytes from Trio's socket (``b""`` at its end), as Trio's ``recv``
        reads them, errors as anyio's stream raises them."""
        await direct.if_cancelled()
        try:
            try:
                data: bytes = direct.sock.recv(size)
            except BlockingIOError:
                while True:
                    await direct.wait_readable(direct.sock)
                    try:
                        return bytes(direct.sock.recv(size))
                    except BlockingIOError:
                        pass
        except direct.closed_error:  # closed while waiting (Trio's socket was told)
            raise anyio.ClosedResourceError from None
        except OSError as exc:
            if self._closed:
                raise anyio.ClosedResourceError from None
            raise anyio.BrokenResourceError from exc
        await direct.yield_()  # bytes were there: one trip through the loop, as Trio's recv
        return data

    @property
    def can_tell_closed(self) -> bool:
        """Whether :meth:`peer_closed` can tell (Trio's socket, read directly)."""
        return self._direct is not None

    def peer_closed(self) -> bool:
        """Whether the peer closed the connection (or broke it), found without reading a
        message or waiting: a connection that nobody reads while it is idle learns it here.
        ``False`` where it cannot tell (see :attr:`can_tell_closed`)."""
        if self._eof or self._closed:
            return True
        return self._direct is not None and peer_shut(self._direct.sock)

    async def aclose(self) -> None:
        self._closed = True
        with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
            await self.stream.aclose()


class _TrioSocket:
    """The socket under anyio's Trio stream, and the Trio calls that read and write it as
    Trio's own socket methods do (found once: the stream is made on a running Trio loop)."""

    __slots__ = ("closed_error", "if_cancelled", "sock", "wait_readable", "yield_")

    def __init__(self, sock: Any) -> None:
        import trio

        self.sock = sock
        self.if_cancelled: Callable[[], Awaitable[None]] = trio.lowlevel.checkpoint_if_cancelled
        self.yield_: Callable[[], Awaitable[None]] = trio.lowlevel.cancel_shielded_checkpoint
        self.wait_readable: Callable[[Any], Awaitable[None]] = trio.lowlevel.wait_readable
        self.closed_error: type[Exception] = trio.ClosedResourceError


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

    def __init__(self, clock: Callable[[], float] = anyio.current_time) -> None:
        self.waiting_since: float | None = None  # the reader waits on the peer since then
        self.received = 0  # messages that arrived
        self._changed: anyio.Event | None = None  # made by a watcher, set on any change
        self._clock = clock  # the event loop's (``native``'s: read once per message)

    def waiting(self, since: float | None = None) -> None:
        """The reader waits on the peer from now, or from ``since`` (a reader that gave up
        handed the waiting to this one: the peer has been silent since then)."""
        self.waiting_since = self._clock() if since is None else since
        self._poke()

    def idle(self) -> None:
        """The reader stopped waiting without a message (its wait was cancelled)."""
        self.waiting_since = None
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
        self, seconds: float, *, since: float = -math.inf, baseline: int | None = None,
        idle_ends: Callable[[], bool] | None = None,
    ) -> bool:
        """Wait until the reader has waited ``seconds`` on the peer with nothing arriving,
        counted from ``since`` at the earliest: ``True``. If ``baseline`` is given, return
        ``False`` as soon as more than ``baseline`` messages have arrived.

        Without ``baseline`` nothing needs to wake at each message: this sleeps to the
        deadline the reader's state gives and looks again, so a busy connection costs its
        reader two attribute writes per message, not a wakeup. A reader that is not waiting
        is waited for (the first :meth:`waiting` wakes this: a reader handed an earlier start
        may be due sooner than ``seconds`` from now). ``idle_ends``: looked at each time
        nobody started waiting for ``seconds``; ``True`` ends the wait (``False`` returned):
        a connection its requests read is not read while idle.
        """
        while baseline is None:
            start = self.waiting_since
            if start is None:
                if self._changed is None:
                    self._changed = anyio.Event()
                changed = self._changed
                with anyio.move_on_after(seconds) as idle:
                    await changed.wait()
                if idle.cancelled_caught and idle_ends is not None and idle_ends():
                    return False
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
            deadline = max(start, since) + seconds
            if anyio.current_time() >= deadline:
                return True
            # (woken by the deadline, it looks again: a message that came in the deadline's
            # own pass, or a reader that stopped, counts)
            with anyio.CancelScope(deadline=deadline):
                await changed.wait()


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
        await silence.wait_silent(interval, idle_ends=lambda: not active())
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
