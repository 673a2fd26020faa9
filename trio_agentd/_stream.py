"""A JSON-lines message stream over any ``trio.abc.Stream`` (sockets or in-memory pairs): the
supervisor's and the workers' side. The framing is :class:`trio_agentd._framing.Framing`'s."""

from __future__ import annotations

from typing import Any

import trio

from ._defaults import CLOSE_TIMEOUT
from ._framing import RECEIVE_SIZE, Framing
from ._protocol import MAX_FRAME, Message, RequestId, encode, encode_raw_event


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
