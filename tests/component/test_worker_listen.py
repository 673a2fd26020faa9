"""The worker's socket is bound on its event loop (trio_agentd._worker.listen_unix): no thread,
mode 0600, a stale file at the path replaced, and it accepts."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_agentd._worker import listen_unix


async def test_the_worker_binds_its_socket_without_a_thread(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a worker's first thread is a good part of its start: the bind takes none
    async def no_thread(*args: Any, **kwargs: Any) -> Any:
        await trio.lowlevel.checkpoint()
        raise AssertionError("the worker's bind ran in a thread")

    monkeypatch.setattr(trio.to_thread, "run_sync", no_thread)
    path = run_dir / "w.sock"
    path.write_bytes(b"stale")  # what a killed worker left: replaced
    listener = listen_unix(str(path))
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        client = await trio.open_unix_socket(str(path))
        server = await listener.accept()
        await client.send_all(b"x")
        assert await server.receive_some(1) == b"x"
        await client.aclose()
        await server.aclose()
    finally:
        await listener.aclose()
