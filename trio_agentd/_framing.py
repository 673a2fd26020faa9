"""Frames in from a byte stream, whatever its event loop: the state machine of a message stream.

A frame is one line of JSON. An event may carry its bytes raw after its line (``raw`` > 0 in
the frame: see :class:`~trio_agentd._protocol.Event`), so output is not base64-encoded on the
way; lines are therefore split one at a time, never ahead of a payload.

:class:`Framing` holds the buffer and splits it; a subclass supplies the reads (``_fill``) and
the writes: :class:`trio_agentd._stream.MessageStream` on Trio (the supervisor and workers),
:class:`trio_agentd._aio.MessageStream` on anyio (the async client, on asyncio or Trio). This
module imports no event loop.
"""

from __future__ import annotations

from ._protocol import MAX_FRAME, Event, FrameTooLarge, Message, decode

RECEIVE_SIZE = 65536  # per read for frames; a raw payload is read in one go where it can


class Framing:
    """The receiving half of a message stream: lines and raw payloads out of a buffer that
    ``_fill`` tops up. A cancelled receive loses nothing: what was read stays buffered."""

    def __init__(self, *, limit: int = MAX_FRAME) -> None:
        self._limit = limit
        self._buf = bytearray()
        self._scanned = 0  # bytes at the start of _buf known to hold no newline
        self._eof = False

    async def _fill(self, want: int = RECEIVE_SIZE) -> bool:
        """Read at least one more byte (up to ``max(want, RECEIVE_SIZE)``) into ``_buf``;
        ``False`` at end of stream (and set ``_eof``)."""
        raise NotImplementedError

    def line_waiting(self) -> bool:
        """Whether a whole line is buffered already (a pipelined request, read with this one)."""
        return self._buf.find(b"\n", self._scanned) >= 0

    async def _line_end(self) -> int | None:
        """Where the next line ends (its newline's index in the buffer; nothing is consumed),
        or ``None`` at end of stream.

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
        return nl

    async def receive_line(self) -> bytes | None:
        """The next line (without newline), or ``None`` at end of stream (a half line at the
        end is dropped: the peer never finished it).

        Raises:
            FrameTooLarge: a line exceeded the limit.
        """
        nl = await self._line_end()
        if nl is None:
            return None
        line = bytes(self._buf[:nl])
        del self._buf[: nl + 1]
        self._scanned = 0
        return line

    async def receive(self) -> Message | None:
        """The next decoded message, or ``None`` at end of stream (decode errors raise; the
        bad line is consumed, so the next receive reads on after it).

        An event with a raw payload is consumed only once the payload is buffered whole: a
        receive cancelled while the payload is on its way leaves the frame to the next one.
        """
        nl = await self._line_end()
        if nl is None:
            return None
        try:
            msg = decode(bytes(self._buf[:nl]))
            if isinstance(msg, Event) and msg.raw and not 0 < msg.raw <= self._limit:
                raise FrameTooLarge(self._limit)
        except BaseException:
            del self._buf[: nl + 1]
            self._scanned = 0
            raise
        end = nl + 1
        if isinstance(msg, Event) and msg.raw:
            end += msg.raw
            while len(self._buf) < end:
                if not await self._fill(end - len(self._buf)):
                    return None  # the peer never finished the payload
            msg.event["data"] = bytes(self._buf[nl + 1:end])
            msg.raw = 0
        del self._buf[:end]
        self._scanned = 0
        return msg
