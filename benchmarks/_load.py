"""One load-generating client process for the throughput figures.

``python -m benchmarks._load agentd SESSION`` prompts ``SESSION`` of the daemon named by the
``TRIO_AGENTD_*`` environment (the in-process Trio client, ``stream: False``) in a loop;
``python -m benchmarks._load floor PATH`` sends request lines to a relay-chain floor server
(:mod:`benchmarks._floor`) in a loop, one outstanding request at a time, as the prompts are.

Both warm up, print ``ready``, wait for a line ``go SECONDS`` on stdin, run for that long and
print ``{"done": N, "errors": E}``: the parent starts every process, waits for every ``ready``
and then starts them all at once, so the windows overlap.
"""

from __future__ import annotations

import json
import os
import sys
import time

import trio

_MSG = (b'{"type":"request","id":123,"op":"prompt","client_id":"0123456789abcdef",'
        b'"args":{"text":"x","stream":false,"raw":true}}\n')


async def _go() -> float:
    print("ready", flush=True)
    line = await trio.to_thread.run_sync(sys.stdin.readline)
    return float(line.split()[1])


async def _agentd(session: str) -> dict[str, int]:
    import trio_agentd

    done = errors = 0
    async with trio_agentd.open_client(
        os.environ["TRIO_AGENTD_SOCKET"], home=os.environ["TRIO_AGENTD_HOME"],
        registry=os.environ["TRIO_AGENTD_REGISTRY_DIR"],
    ) as client:
        for _ in range(20):
            await client.request("prompt", {"session": session, "text": "warm", "stream": False})
        seconds = await _go()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            try:
                await client.request("prompt", {"session": session, "text": "x",
                                                "stream": False})
                done += 1
            except trio_agentd.AgentdError:
                errors += 1
    return {"done": done, "errors": errors}


async def _floor(path: str) -> dict[str, int]:
    done = 0
    stream = await trio.open_unix_socket(path)
    async with stream:
        async def one() -> None:
            await stream.send_all(_MSG)
            got = b""
            while not got.endswith(b"\n"):
                data = await stream.receive_some(65536)
                if not data:
                    raise RuntimeError("the floor server closed the connection")
                got += data

        for _ in range(20):
            await one()
        seconds = await _go()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            await one()
            done += 1
    return {"done": done, "errors": 0}


def main() -> None:
    mode, target = sys.argv[1], sys.argv[2]
    result = trio.run(_agentd if mode == "agentd" else _floor, target)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
