"""A JSON-lines message stream over any ``trio.abc.Stream`` (sockets or in-memory pairs)."""

from __future__ import annotations

from collections import deque

import trio

from ._protocol import MAX_FRAME, LineBuffer, Message, decode, encode


class MessageStream:
    """Frames in, frames out. Sends are serialised by a lock so concurrent tasks may send.

    Cancellation: a cancelled ``send`` may leave a partial frame on the wire; callers close the
    stream after cancelling a send (trio streams are broken by a cancelled send anyway).
    """

    def __init__(self, stream: trio.abc.Stream, *, limit: int = MAX_FRAME) -> None:
        self.stream = stream
        self._buffer = LineBuffer(limit)
        self._lines: deque[bytes] = deque()
        self._send_lock = trio.Lock()
        self._eof = False

    async def send(self, msg: Message) -> None:
        await self.send_raw(encode(msg))

    async def send_raw(self, data: bytes) -> None:
        async with self._send_lock:
            await self.stream.send_all(data)

    async def receive_line(self) -> bytes | None:
        """The next line (without newline), or ``None`` at end of stream.

        Raises:
            FrameTooLarge: a line exceeded the limit.
        """
        while not self._lines:
            if self._eof:
                return None
            data = await self.stream.receive_some(65536)
            if not data:
                self._eof = True
                if self._buffer.pending:
                    # a half line at EOF is dropped: the peer never finished it
                    return None
                return None
            self._lines.extend(self._buffer.feed(bytes(data)))
        return self._lines.popleft()

    async def receive(self) -> Message | None:
        """The next decoded message, or ``None`` at end of stream (decode errors raise)."""
        line = await self.receive_line()
        return None if line is None else decode(line)

    async def aclose(self) -> None:
        with trio.move_on_after(1, shield=True):
            await self.stream.aclose()
