"""A JSON-lines message stream over any ``trio.abc.Stream`` (sockets or in-memory pairs).

A frame is one line of JSON. An event may carry its bytes raw after its line (``raw`` > 0 in
the frame: see :class:`~trio_agentd._protocol.Event`), so output is not base64-encoded on the
way; lines are therefore split one at a time, never ahead of a payload.
"""

from __future__ import annotations

from typing import Any

import trio

from ._protocol import (
    MAX_FRAME,
    Event,
    FrameTooLarge,
    Message,
    RequestId,
    decode,
    encode,
    encode_raw_event,
)

_RECEIVE_SIZE = 65536  # per read for frames; a raw payload is read in one go where it can


class MessageStream:
    """Frames in, frames out. Sends are serialised by a lock so concurrent tasks may send.

    Cancellation: a cancelled ``send`` may leave a partial frame on the wire; callers close the
    stream after cancelling a send (trio streams are broken by a cancelled send anyway). A
    cancelled ``receive`` loses nothing: what was read stays buffered.
    """

    def __init__(self, stream: trio.abc.Stream, *, limit: int = MAX_FRAME) -> None:
        self.stream = stream
        self._limit = limit
        self._buf = bytearray()
        self._scanned = 0  # bytes at the start of _buf known to hold no newline
        self._send_lock = trio.Lock()
        self._eof = False

    async def send(self, msg: Message) -> None:
        await self.send_raw(encode(msg))

    async def send_raw(self, data: bytes) -> None:
        async with self._send_lock:
            await self.stream.send_all(data)

    async def send_event_raw(self, request_id: RequestId, event: dict[str, Any],
                             data: bytes) -> None:
        """An event whose ``data`` goes raw after its frame (only to a peer that asked)."""
        header = encode_raw_event(request_id, event, data)
        async with self._send_lock:
            if len(data) <= 65536:
                await self.stream.send_all(header + data)  # one write for a small chunk
            else:
                await self.stream.send_all(header)
                await self.stream.send_all(data)

    async def _fill(self, want: int = _RECEIVE_SIZE) -> bool:
        """Read more into the buffer; ``False`` at end of stream."""
        if self._eof:
            return False
        data = await self.stream.receive_some(max(want, _RECEIVE_SIZE))
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def receive_line(self) -> bytes | None:
        """The next line (without newline), or ``None`` at end of stream (a half line at the
        end is dropped: the peer never finished it).

        Raises:
            FrameTooLarge: a line exceeded the limit.
        """
        while (nl := self._buf.find(b"\n", self._scanned)) < 0:
            self._scanned = len(self._buf)
            if self._scanned > self._limit:
                raise FrameTooLarge(self._limit)
            if not await self._fill():
                return None
        if nl > self._limit:
            raise FrameTooLarge(self._limit)
        line = bytes(self._buf[:nl])
        del self._buf[: nl + 1]
        self._scanned = 0
        return line

    async def _receive_exact(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            if not await self._fill(n - len(self._buf)):
                return None
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    async def receive(self) -> Message | None:
        """The next decoded message, or ``None`` at end of stream (decode errors raise)."""
        line = await self.receive_line()
        if line is None:
            return None
        msg = decode(line)
        if isinstance(msg, Event) and msg.raw:
            if not 0 < msg.raw <= self._limit:
                raise FrameTooLarge(self._limit)
            data = await self._receive_exact(msg.raw)
            if data is None:
                return None  # the peer never finished the payload
            msg.event["data"] = data
            msg.raw = 0
        return msg

    async def aclose(self) -> None:
        with trio.move_on_after(1, shield=True):
            await self.stream.aclose()
