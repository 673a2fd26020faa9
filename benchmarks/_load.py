"""One load-generating client process for the throughput figures.

``python -m benchmarks._load agentd SESSION`` prompts ``SESSION`` of the daemon named by the
``TRIO_AGENTD_*`` environment (the in-process Trio client, ``stream: False``) in a loop;
``python -m benchmarks._load floor PATH`` sends request lines to a relay-chain floor server
(:mod:`benchmarks._floor`) in a loop, one outstanding request at a time, as the prompts are.

Both warm up, print ``ready``, then for each line ``go SECONDS`` on stdin run for that long and
print ``{"done": N, "errors": E}``, until stdin ends: the parent starts every process, waits for
every ``ready`` and then lets them all go at once, so the windows overlap (and may let them go
again).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Awaitable, Callable

import trio

_MSG = (b'{"type":"request","id":123,"op":"prompt","client_id":"0123456789abcdef",'
        b'"args":{"text":"x","stream":false,"raw":true}}\n')


async def _windows(one: Callable[[], Awaitable[bool]]) -> None:
    """``ready``; then a window per ``go SECONDS`` line, each printing its counts (``one``
    makes one request: whether it succeeded)."""
    print("ready", flush=True)
    while line := await trio.to_thread.run_sync(sys.stdin.readline):
        seconds = float(line.split()[1])
        done = errors = 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if await one():
                done += 1
            else:
                errors += 1
        print(json.dumps({"done": done, "errors": errors}), flush=True)


async def _agentd(session: str) -> None:
    import trio_agentd

    async with trio_agentd.open_client(
        os.environ["TRIO_AGENTD_SOCKET"], home=os.environ["TRIO_AGENTD_HOME"],
        registry=os.environ["TRIO_AGENTD_REGISTRY_DIR"],
    ) as client:
        async def one() -> bool:
            try:
                await client.request("prompt", {"session": session, "text": "x",
                                                "stream": False})
            except trio_agentd.AgentdError:
                return False
            return True

        for _ in range(20):
            await client.request("prompt", {"session": session, "text": "warm", "stream": False})
        await _windows(one)


async def _floor(path: str) -> None:
    stream = await trio.open_unix_socket(path)
    async with stream:
        async def one() -> bool:
            await stream.send_all(_MSG)
            got = b""
            while not got.endswith(b"\n"):
                data = await stream.receive_some(65536)
                if not data:
                    raise RuntimeError("the floor server closed the connection")
                got += data
            return True

        for _ in range(20):
            await one()
        await _windows(one)


def main() -> None:
    mode, target = sys.argv[1], sys.argv[2]
    trio.run(_agentd if mode == "agentd" else _floor, target)


if __name__ == "__main__":
    main()
