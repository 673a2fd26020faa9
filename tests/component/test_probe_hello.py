"""A probe (``ps``, ``doctor``): it connects, shuts its side at once and takes the hello. The
supervisor answers it and ends the connection there, with no request reader behind it (the
cheap case of the hello, 20 supervisors at a time). A client that sends requests and then
shuts its side is still read and answered. Real Unix sockets (the probe's shut side is found
with a peek), the real supervisor's connection handler, ops faked."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing
from trio_util import AsyncValue

from trio_agentd._protocol import Request, encode, ok
from trio_agentd._stream import MessageStream
from trio_agentd._supervisor import Supervisor, SupervisorConfig
from trio_agentd._supervisorops import Dispatcher


class _Counting(Dispatcher):
    """The supervisor's connection handler; its ops answer ``pong``; counts its readers."""

    readers = 0

    async def read_requests(
        self, ms: MessageStream, requests: trio.Nursery, inflight: AsyncValue[int]
    ) -> None:
        self.readers += 1
        await super().read_requests(ms, requests, inflight)

    async def _dispatch(self, ms: MessageStream, req: Request, inflight: AsyncValue[int]) -> None:
        await ms.send(ok(req.id, {"pong": True}))
        inflight.value -= 1


def _ops(tmp: Path) -> _Counting:
    config = SupervisorConfig(socket=str(tmp / "s.sock"), home=str(tmp / "home"),
                              registry=str(tmp / "reg"))
    return _Counting(Supervisor(config), max_clients=4)


async def _all_of(stream: trio.SocketStream) -> bytes:
    out = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some():
            out += chunk
    return out


async def test_a_probe_gets_the_hello_and_no_request_reader(tmp_path: Path) -> None:
    ops = _ops(tmp_path)
    a, b = trio.socket.socketpair()
    async with trio.SocketStream(a) as client:
        await client.send_eof()
        with trio.fail_after(5):
            await ops.serve_client(trio.SocketStream(b))
        got = await _all_of(client)
    assert got.count(b"\n") == 1
    assert b'"type":"hello"' in got
    assert ops.readers == 0


async def test_a_client_that_sends_then_shuts_its_side_is_answered(tmp_path: Path) -> None:
    ops = _ops(tmp_path)
    a, b = trio.socket.socketpair()
    async with trio.SocketStream(a) as client:
        await client.send_all(encode(Request(id=7, op="ping")))
        await client.send_eof()
        with trio.fail_after(5):
            await ops.serve_client(trio.SocketStream(b))
        lines = (await _all_of(client)).splitlines()
    assert len(lines) == 2
    assert b'"type":"hello"' in lines[0]
    assert b'"id":7' in lines[1]
    assert b'"pong":true' in lines[1]
    assert ops.readers == 1


async def test_a_client_that_waits_for_the_hello_first_is_read(tmp_path: Path) -> None:
    ops = _ops(tmp_path)
    a, b = trio.socket.socketpair()
    async with trio.SocketStream(a) as client, trio.open_nursery() as nursery:
        nursery.start_soon(ops.serve_client, trio.SocketStream(b))
        with trio.fail_after(5):
            hello = await client.receive_some()
        assert b'"type":"hello"' in hello
        await client.send_all(encode(Request(id=8, op="ping")))
        await client.send_eof()
        rest = await _all_of(client)
    assert b'"id":8' in rest
    assert ops.readers == 1
