"""The floor of a round trip: a tiny Trio echo server on a Unix socket, in its own process.

``python -m benchmarks._floor PATH`` listens on ``PATH`` and sends back every byte it receives,
on every connection, until killed. The round-trip figure times one request/response hop to it
from another process: the least any prompt over a Unix socket can cost on this machine.
"""

from __future__ import annotations

import socket as _socket
import sys

import trio


async def _serve(path: str) -> None:
    sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    print("ready", flush=True)

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some(65536):
                await stream.send_all(data)

    await trio.serve_listeners(echo, [listener])


if __name__ == "__main__":
    trio.run(_serve, sys.argv[1])
