"""The floors of a prompt: tiny Trio servers on a Unix socket, each in its own process.

``python -m benchmarks._floor PATH`` listens on ``PATH`` and sends back every byte it receives,
on every connection, until killed: the round-trip figure times one request/response hop to it
from another process, the least any prompt over a Unix socket can cost on this machine.

``python -m benchmarks._floor PATH JOURNAL`` is the *relay-chain floor*: the hops a prompt
makes now, and nothing else. A prompt goes from the client straight to its session's worker
(the direct route; the supervisor is not on the path), which makes one record durable and
answers. So this server, per request line it receives, appends one small record to ``JOURNAL``
(``O_APPEND``), ``os.fdatasync``-s it inline and writes one response line back: one hop each
way, one append, one flush. It does no JSON, no framing beyond the newline, no journal state:
what a worker spends above it is the cost of being a worker.
"""

from __future__ import annotations

import os
import socket as _socket
import sys

import trio

RESPONSE = b'{"type":"response","id":1,"ok":true,"result":{"reply":"ok"}}\n'
RECORD = b'{"kind":"accepted","client_id":"0123456789abcdef","id":1,"op":"prompt"}\n'


async def _serve(path: str, journal: str | None) -> None:
    sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(128)
    listener = trio.SocketListener(sock)
    fd = None
    if journal is not None:
        fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    print("ready", flush=True)

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some(65536):
                await stream.send_all(data)

    async def relay(stream: trio.SocketStream) -> None:
        assert fd is not None
        buf = b""
        async with stream:
            while data := await stream.receive_some(65536):
                buf += data
                lines = buf.count(b"\n")
                if not lines:
                    continue
                buf = buf[buf.rfind(b"\n") + 1:]
                for _ in range(lines):
                    os.write(fd, RECORD)
                    os.fdatasync(fd)
                    await stream.send_all(RESPONSE)

    await trio.serve_listeners(echo if fd is None else relay, [listener])


if __name__ == "__main__":
    trio.run(_serve, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
