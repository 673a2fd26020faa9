"""Helpers for the async client's tests, which run on asyncio and on Trio (``anyio_backend``)."""

from __future__ import annotations

import socket

import anyio
import anyio.abc
import sniffio
import trio


def assert_on(backend: str) -> None:
    """The calling test really runs on ``backend`` (not Trio whatever it asked for)."""
    assert sniffio.current_async_library() == backend


async def socket_stream_pair() -> tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]:
    """Two connected anyio streams over a Unix socketpair, on whichever backend runs."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return (await anyio.abc.UNIXSocketStream.from_socket(a),
            await anyio.abc.UNIXSocketStream.from_socket(b))


class TrioByteStream(anyio.abc.ByteStream):
    """A Trio stream (an in-memory pair's end) seen as an anyio byte stream, for the client's
    side of a connection whose other side is Trio code (a worker core), on Trio."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def receive(self, max_bytes: int = 65536) -> bytes:
        try:
            data = await self.stream.receive_some(max_bytes)
        except trio.BrokenResourceError:
            raise anyio.BrokenResourceError from None
        except trio.ClosedResourceError:
            raise anyio.ClosedResourceError from None
        if not data:
            raise anyio.EndOfStream
        return bytes(data)

    async def send(self, item: bytes) -> None:
        try:
            await self.stream.send_all(item)
        except trio.BrokenResourceError:
            raise anyio.BrokenResourceError from None
        except trio.ClosedResourceError:
            raise anyio.ClosedResourceError from None

    async def send_eof(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        await self.stream.aclose()
