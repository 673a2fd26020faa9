"""A JSON-lines message stream over any ``trio.abc.Stream`` (sockets or in-memory pairs): the
supervisor's and the workers' side. The framing is :class:`trio_agentd._framing.Framing`'s."""

from __future__ import annotations

import errno
import os
from typing import Any

import trio

from . import _output
from ._defaults import CLOSE_TIMEOUT
from ._framing import RECEIVE_SIZE, Framing
from ._protocol import MAX_FRAME, Event, Message, RequestId, encode, encode_raw_event


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

    async def send(self, msg: Message) -> None:
        await self.send_raw(encode(msg))

    async def send_raw(self, data: bytes) -> None:
        await self._lock()
        try:
            await self.stream.send_all(data)
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
        header = encode(Event(id=request_id, event=event, raw=count))
        sock = self.stream.socket if isinstance(self.stream, trio.SocketStream) else None
        await self._lock()
        try:
            if sock is None or not _output.ZERO_COPY:
                await self.stream.send_all(header)
                end = offset + count
                while offset < end:
                    data = os.pread(fd, min(end - offset, _output.RAW_CHUNK_MAX), offset)
                    if not data:
                        raise OSError(errno.EIO, "the output file ended early")
                    await self.stream.send_all(data)
                    offset += len(data)
                return
            await self.stream.send_all(header)
            await _sendfile(sock, fd, offset, count)
        finally:
            self._send_lock.release()

    async def _fill(self, want: int = RECEIVE_SIZE) -> bool:
        """Read more into the buffer; ``False`` at end of stream."""
        if self._eof:
            return False
        data = await self.stream.receive_some(max(want, RECEIVE_SIZE))
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def aclose(self) -> None:
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            await self.stream.aclose()


async def _sendfile(sock: trio.socket.SocketType, fd: int, offset: int, count: int) -> None:
    """``count`` bytes of ``fd`` from ``offset`` into the (non-blocking) socket, waiting for
    room in it as needed: backpressure, and a checkpoint per chunk.

    Raises:
        trio.BrokenResourceError: the peer went away.
        trio.ClosedResourceError: the socket was closed under us.
        OSError: the file ended early, or failed.
    """
    end = offset + count
    await trio.lowlevel.checkpoint_if_cancelled()
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
    await trio.lowlevel.cancel_shielded_checkpoint()
