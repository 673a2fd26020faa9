from trio_agentd._protocol import LineBuffer


def test_linebuffer_splits() -> None:
    buf = LineBuffer(limit=10)
    assert buf.feed(b"ab\ncd") == [b"ab"]
    assert buf.feed(b"\n") == [b"cd"]


async def test_trio_mode_works() -> None:
    import trio

    await trio.sleep(0)
