"""Output chunks with their bytes raw after the frame (no base64), on both readers."""

from __future__ import annotations

import socket
import threading

import pytest
import trio
import trio.testing

from trio_agentd._errors import AgentdError
from trio_agentd._protocol import MAX_FRAME, Event, FrameTooLarge, Request, encode
from trio_agentd._stream import MessageStream
from trio_agentd._syncconn import _Conn, _Malformed

PAYLOAD = bytes(range(256)) * 1200 + b"\n\n{not json}\n"  # newlines inside the payload


async def test_a_raw_event_round_trips_byte_exact_however_the_bytes_arrive() -> None:
    a, b = trio.testing.memory_stream_pair()
    sender, receiver = MessageStream(a), MessageStream(b)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send_event_raw, 7, {"kind": "chunk", "at": 0}, PAYLOAD)
        msg = await receiver.receive()
        # the line after the payload is read as a frame of its own, not as payload
        nursery.start_soon(sender.send, Request(id=8, op="ping"))
        after = await receiver.receive()
    assert isinstance(msg, Event)
    assert msg.event == {"kind": "chunk", "at": 0, "data": PAYLOAD}
    assert msg.raw == 0  # consumed
    assert isinstance(after, Request)
    assert after.id == 8


async def test_a_raw_event_split_byte_by_byte_is_still_one_event() -> None:
    header = encode(Event(id=1, event={"kind": "chunk", "at": 5}, raw=3))
    stream = trio.testing.MemoryReceiveStream()
    for byte in header + b"abc" + encode(Request(id=2, op="ping")):
        stream.put_data(bytes([byte]))
    stream.put_eof()
    ms = MessageStream(trio.StapledStream(trio.testing.MemorySendStream(), stream))
    first, second, end = await ms.receive(), await ms.receive(), await ms.receive()
    assert isinstance(first, Event)
    assert first.event["data"] == b"abc"
    assert isinstance(second, Request)
    assert end is None


async def test_a_payload_cut_short_by_the_end_of_stream_is_dropped_not_half_delivered() -> None:
    stream = trio.testing.MemoryReceiveStream()
    stream.put_data(encode(Event(id=1, event={"kind": "chunk"}, raw=10)) + b"abc")
    stream.put_eof()
    ms = MessageStream(trio.StapledStream(trio.testing.MemorySendStream(), stream))
    assert await ms.receive() is None


@pytest.mark.parametrize("raw", [MAX_FRAME + 1, -1])
async def test_a_payload_length_out_of_bounds_is_refused_before_reading_it(raw: int) -> None:
    stream = trio.testing.MemoryReceiveStream()
    stream.put_data(encode(Event(id=1, event={"kind": "chunk"}, raw=raw)))
    ms = MessageStream(trio.StapledStream(trio.testing.MemorySendStream(), stream))
    with pytest.raises(FrameTooLarge):
        await ms.receive()


def test_the_blocking_client_reads_raw_events_and_the_frame_after_them() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        header = encode(Event(id=3, event={"kind": "chunk", "at": 0}, raw=len(PAYLOAD)))
        wire = header + PAYLOAD + b'{"type":"response","id":3,"ok":true}\n'
        # more than a socket buffer: written by a thread, in two pieces, as the reader reads
        def write() -> None:
            theirs.sendall(wire[:100])
            theirs.sendall(wire[100:])

        writer = threading.Thread(target=write)
        writer.start()
        try:
            conn = _Conn(ours)
            event = conn.read_message(5)
            assert event is not None
            assert event["event"]["data"] == PAYLOAD
            assert conn.read_message(5) == {"type": "response", "id": 3, "ok": True}
        finally:
            writer.join(5)


def test_the_blocking_client_refuses_a_raw_length_out_of_bounds() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b'{"type":"event","id":1,"event":{},"raw":%d}\n' % (MAX_FRAME + 1))
        with pytest.raises(_Malformed):
            _Conn(ours).read_message(5)


async def test_a_receive_cancelled_while_a_payload_is_on_its_way_leaves_the_frame_whole(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The async client's requests read for each other, and a caller may give up while it
    reads: the frame it was in the middle of is the next receive's, header and all."""
    a, b = trio.testing.memory_stream_pair()
    receiver = MessageStream(b)
    header = encode(Event(id=1, event={"kind": "chunk", "at": 0}, raw=len(PAYLOAD)))
    await a.send_all(header + PAYLOAD[:1000])
    with trio.move_on_after(1) as scope:
        await receiver.receive()
    assert scope.cancelled_caught
    await a.send_all(PAYLOAD[1000:] + encode(Request(id=2, op="ping")))
    msg = await receiver.receive()
    assert isinstance(msg, Event)
    assert (msg.id, msg.event) == (1, {"kind": "chunk", "at": 0, "data": PAYLOAD})
    after = await receiver.receive()
    assert isinstance(after, Request)
    assert after.id == 2


async def test_a_line_that_does_not_decode_is_consumed_so_the_next_receive_reads_on() -> None:
    a, b = trio.testing.memory_stream_pair()
    receiver = MessageStream(b)
    await a.send_all(b"{not json}\n" + encode(Request(id=2, op="ping")))
    with pytest.raises(AgentdError) as info:
        await receiver.receive()
    assert info.value.code == "bad_request"
    after = await receiver.receive()
    assert isinstance(after, Request)
    assert after.id == 2
