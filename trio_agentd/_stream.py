"""A JSON-lines message stream over any ``trio.abc.Stream`` (sockets or in-memory pairs): the
supervisor's and the workers' side. The framing is :class:`trio_agentd._framing.Framing`'s."""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Any

import trio

from . import _output
from ._defaults import CLOSE_TIMEOUT
from ._framing import RECEIVE_SIZE, Framing
from ._identity import peer_shut
from ._protocol import MAX_FRAME, Event, Message, RequestId, encode, encode_raw_event

log = logging.getLogger(__name__)

SEND_BUFFER = 1 << 20  # bytes of a stream in flight to its reader (see widen_send_buffer)


class MessageStream(Framing):
    """Frames in, frames out. Sends are serialised by a lock so concurrent tasks may send.

    Cancellation: a cancelled ``send`` may leave a partial frame on the wire; callers close the
    stream after cancelling a send (trio streams are broken by a cancelled send anyway). A
    cancelled ``receive`` loses nothing: what was read stays buffered.
    """

    def __init__(self, stream: trio.abc.Stream, *, limit: int = MAX_FRAME) -> None:
        super().__init__(limit=limit)
        self.stream = stream
        self._send_lock = trio.Lock()
        self._widened = False  # the socket's send buffer made room for a stream (once)
        self._sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        # the last read from the socket took less than it asked for: it was empty then
        self._drained = False

    def peer_closed(self) -> bool:
        """Whether the peer shut its side with nothing sent that is left to read, found
        without reading or waiting (one ``recv`` with ``MSG_PEEK``). ``False`` where it
        cannot tell: not a socket, bytes waiting, or nothing yet."""
        if self._eof:
            return not self._buf
        if self._sock is None or self._buf:
            return False
        fd = self._sock.fileno()
        if fd < 0:
            return True
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fd)  # (Trio's, unwrapped)
        try:
            return peer_shut(raw)
        finally:
            raw.detach()  # the descriptor stays the stream's

    async def send(self, msg: Message) -> None:
        await self.send_raw(encode(msg))

    async def send_raw(self, data: bytes) -> None:
        await self._lock()
        try:
            await self.stream.send_all(data)
        finally:
            self._send_lock.release()

    async def send_last(self, msg: Message) -> None:
        """:meth:`send` for a task's last act (a prompt's answer): on a socket with room for
        the whole frame it is written at once, without a trip through the scheduler (a task
        that ends next needs none); one without room is waited for, as by ``send``
        (backpressure). On other streams it is ``send``."""
        sock = self.stream.socket if isinstance(self.stream, trio.SocketStream) else None
        if sock is None:
            await self.send(msg)
            return
        data = encode(msg)
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._send_lock.locked():
            # nobody sends (or waits to): what the socket takes at once needs no lock, as
            # nothing can start another frame before this returns or takes the lock below
            # (no checkpoint in between)
            sent = _write_now(sock, data)
            if sent == len(data):
                return
            data = data[sent:]
        await self._lock()  # (free if part was sent above: taken without a checkpoint)
        try:
            await _write(sock, data)
        finally:
            self._send_lock.release()

    async def _lock(self) -> None:
        """Take the send lock; a free one without a trip through the scheduler (``send_all``
        is a checkpoint anyway), so a frame costs one yield, not two."""
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()

    async def send_event_raw(self, request_id: RequestId, event: dict[str, Any],
                             data: bytes) -> None:
        """An event whose ``data`` goes raw after its frame (only to a peer that asked)."""
        header = encode_raw_event(request_id, event, data)
        await self._lock()
        try:
            if len(data) <= 65536:
                await self.stream.send_all(header + data)  # one write for a small chunk
            else:
                await self.stream.send_all(header)
                await self.stream.send_all(data)
        finally:
            self._send_lock.release()

    async def send_event_file(self, request_id: RequestId, event: dict[str, Any], fd: int,
                              offset: int, count: int) -> None:
        """An event whose ``data`` is ``count`` bytes of file ``fd`` at ``offset``, raw after
        its frame: from the page cache to the socket (``sendfile``) where the stream is a
        socket and the system has it, else read and sent.

        Raises:
            OSError: the file could not be read (it ended early: it was cut under us).
        """
        await self.send_events_file(request_id, [(event, offset, count)], fd)

    async def send_events_file(self, request_id: RequestId,
                               events: list[tuple[dict[str, Any], int, int]], fd: int) -> None:
        """Events, each ``(event, offset, count)``, whose ``data`` is ``count`` bytes of file
        ``fd`` at ``offset``, raw after its frame; in a row, under one hold of the send lock.

        On a socket (where the system has ``sendfile``) each frame is written and its bytes
        sent from the page cache without a trip through the scheduler between them: the run
        waits only for room in the socket, and is one checkpoint as a whole (a 1 MiB take from
        a pipe is four chunk events, not four rounds of the event loop). Else each event is
        read and sent.

        Raises:
            OSError: the file could not be read (it ended early: it was cut under us).
        """
        sock = self.stream.socket if isinstance(self.stream, trio.SocketStream) else None
        await self._lock()
        try:
            if sock is None or not _output.ZERO_COPY:
                for event, offset, count in events:
                    await self.stream.send_all(encode(Event(id=request_id, event=event,
                                                            raw=count)))
                    end = offset + count
                    while offset < end:
                        data = os.pread(fd, min(end - offset, _output.RAW_CHUNK_MAX), offset)
                        if not data:
                            raise OSError(errno.EIO, "the output file ended early")
                        await self.stream.send_all(data)
                        offset += len(data)
                return
            if not self._widened:
                self._widened = True
                widen_send_buffer(sock)
            await trio.lowlevel.checkpoint_if_cancelled()
            for event, offset, count in events:
                await _write(sock, encode(Event(id=request_id, event=event, raw=count)))
                await _sendfile(sock, fd, offset, count)
            await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._send_lock.release()

    async def _fill(self, want: int = RECEIVE_SIZE) -> bool:
        """Read more into the buffer; ``False`` at end of stream."""
        if self._eof:
            return False
        size = max(want, RECEIVE_SIZE)
        sock = self._sock
        if sock is None:
            data = await self.stream.receive_some(size)
        else:
            if self._drained:
                # the socket was emptied by the last read: wait for more before reading,
                # rather than make a read that finds nothing first (a prompt's connection
                # then costs one read per prompt, not two)
                data = await _read(sock, size)
            else:
                data = await self.stream.receive_some(size)
            self._drained = len(data) < size
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def aclose(self) -> None:
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            await self.stream.aclose()


def widen_send_buffer(sock: trio.socket.SocketType) -> None:
    """Give a connection that carries a stream room for :data:`SEND_BUFFER` bytes in flight.

    With the default buffer (about 208 KiB) a 256 KiB chunk fills it: the worker waits for
    the reader after every chunk and the reader waits for the worker's next take from the
    pipe, never both busy at once. A bigger buffer lets the reader drain a take while the
    worker moves the next one. The kernel caps it at ``net.core.wmem_max``; failing to set it
    only costs speed, so the error is logged, not raised.
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    except OSError as exc:
        log.debug("the stream's send buffer stays as it was: %s", exc)


async def _read(sock: trio.socket.SocketType, size: int) -> bytes:
    """Up to ``size`` bytes from the (non-blocking) socket once it is readable (a checkpoint:
    it always waits for the socket, as ``receive_some`` does when there is nothing to read).

    Raises:
        trio.BrokenResourceError: the connection failed.
        trio.ClosedResourceError: the socket was closed under us.
    """
    while True:
        await trio.lowlevel.wait_readable(sock)
        fd = sock.fileno()
        if fd < 0:  # closed by another task (a dropped connection)
            raise trio.ClosedResourceError("the connection was closed")
        try:
            return os.read(fd, size)
        except BlockingIOError:
            continue
        except OSError as exc:
            if exc.errno == errno.EBADF:
                raise trio.ClosedResourceError("the connection was closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


def _write_now(sock: trio.socket.SocketType, data: bytes | memoryview) -> int:
    """What of ``data`` the (non-blocking) socket takes at once, without waiting.

    Raises:
        trio.BrokenResourceError: the peer went away.
        trio.ClosedResourceError: the socket was closed under us.
    """
    if sock.fileno() < 0:  # closed by another task (a dropped connection)
        raise trio.ClosedResourceError("the connection was closed")
    try:
        return os.write(sock.fileno(), data)
    except BlockingIOError:
        return 0
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise trio.BrokenResourceError(str(exc)) from exc


async def _write(sock: trio.socket.SocketType, data: bytes) -> None:
    """All of ``data`` into the (non-blocking) socket, waiting for room in it as needed; not a
    checkpoint by itself when there is room (the caller's run is one).

    Raises:
        trio.BrokenResourceError: the peer went away.
        trio.ClosedResourceError: the socket was closed under us.
    """
    with memoryview(data) as view:
        while view:
            sent = _write_now(sock, view)
            if not sent:
                await trio.lowlevel.wait_writable(sock)
                continue
            view = view[sent:]


async def _sendfile(sock: trio.socket.SocketType, fd: int, offset: int, count: int) -> None:
    """``count`` bytes of ``fd`` from ``offset`` into the (non-blocking) socket, waiting for
    room in it as needed (backpressure); not a checkpoint by itself when there is room.

    Raises:
        trio.BrokenResourceError: the peer went away.
        trio.ClosedResourceError: the socket was closed under us.
        OSError: the file ended early, or failed.
    """
    end = offset + count
    while offset < end:
        if sock.fileno() < 0:  # closed by another task (a dropped connection)
            raise trio.ClosedResourceError("the connection was closed")
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, end - offset)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise trio.BrokenResourceError(str(exc)) from exc
        if sent == 0:
            raise OSError(errno.EIO, "the output file ended early")
        offset += sent
