"""Cancel with real processes: Ctrl-C on ``trio-agentd -p``, and ``trio-agentd cancel``."""

from __future__ import annotations

import json
import os
import signal
from typing import BinaryIO, TextIO, cast

from trio_agentd._journal import written

from .harness import DaemonEnv, wait_for

# a turn that leaves a child behind and waits: its pid is the first line of output
LONG = "sleep 1000 & echo $!; wait"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1][1:2]
    except OSError:
        return True
    return state in (b"Z", b"X")


def _journal(denv: DaemonEnv, session: str) -> list[dict[str, object]]:
    path = next((denv.home / "daemons").glob(f"*/journal/{session}.jsonl"))
    data = written(path.read_bytes())
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def test_ctrl_c_cancels_the_turn_exits_130_and_the_session_serves_on(denv: DaemonEnv) -> None:
    p = denv.popen("-p", "-s", "c2", "--agent", "shell", "--", LONG)
    assert p.stdout is not None
    child = int(p.stdout.readline())
    assert not _gone(child)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "cancelled" in err
    assert "Traceback" not in err
    # the worker confirmed only after the turn's processes were stopped
    assert _gone(child)
    ended = [r for r in _journal(denv, "c2") if r.get("kind") in ("interrupted", "completed")]
    assert len(ended) == 1
    assert ended[0]["kind"] == "interrupted"
    assert ended[0]["cancelled"] is True
    # the session takes the next prompt at once
    cp = denv.run("-p", "-s", "c2", "--", "echo next")
    assert (cp.returncode, cp.stdout) == (0, "next\n"), cp.stderr


def test_trio_agentd_cancel_ends_another_clients_turn(denv: DaemonEnv) -> None:
    p = denv.popen("-p", "-s", "k", "--agent", "shell", "--", LONG)
    assert p.stdout is not None
    child = int(p.stdout.readline())
    cp = denv.run("cancel", "k")
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == "cancelled the running turn of session k\n"
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert _gone(child)
    # nothing runs now: a second cancel says so
    again = denv.run("cancel", "k")
    assert again.stdout == "session k runs no turn\n"


def test_a_lost_connection_is_not_a_cancel(denv: DaemonEnv) -> None:
    p = denv.popen("-p", "-s", "l", "--agent", "shell", "--",
                   "echo started; read x < /dev/null; sleep 0.5; echo finished")
    assert p.stdout is not None
    assert p.stdout.readline() == "started\n"
    p.kill()  # the client dies: the turn goes on
    p.communicate(timeout=10)
    wait_for(lambda: any(r.get("kind") == "completed" for r in _journal(denv, "l")),
             timeout=20, what="the turn to complete without its client")
    transcript = (denv.home / "sessions" / "l" / "transcript.jsonl").read_text()
    assert "finished" in transcript
    assert os.path.exists(denv.socket)


async def test_trio_client_cancel_fails_the_prompt_with_command_cancelled(
    denv: DaemonEnv,
) -> None:
    import pytest
    import trio

    import trio_agentd

    with trio.fail_after(30):
        async with trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry)
        ) as client:
            seen: list[str] = []
            cancelled: list[bool] = []

            async def read_and_cancel() -> None:
                async for chunk in client.stream_prompt(
                    "t", "echo started; sleep 1000", agent="shell"
                ):
                    seen.append(chunk)
                    cancelled.append(await client.cancel("t"))  # once the turn ended

            with pytest.raises(trio_agentd.AgentdError) as info:
                await read_and_cancel()
            assert info.value.code == "command_cancelled"
            assert cancelled == [True]
            assert seen == ["started\n"]
            assert await client.cancel("t") is False
            assert await client.prompt("t", "echo next") == "next\n"


def test_ctrl_c_in_the_middle_of_streaming_output_cancels_cleanly(denv: DaemonEnv) -> None:
    """Ctrl-C lands while output streams at full speed, most likely inside a chunk's bytes:
    the answer is the same clean cancel (the interrupted connection is not read again)."""
    import threading

    for attempt in range(3):
        session = f"flood{attempt}"
        p = denv.popen("-p", "-s", session, "--agent", "shell", "--", "cat /dev/zero")
        assert p.stdout is not None
        out = cast(TextIO, p.stdout).buffer  # the bytes under the text wrapper
        first = out.read(1 << 20)  # streaming for real
        assert first == b"\0" * (1 << 20)
        seen = [len(first)]

        def drain(out: BinaryIO = out, seen: list[int] = seen) -> None:
            while chunk := out.read(1 << 16):
                seen.append(len(chunk))

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)
        reader.join(timeout=30)
        err = p.stderr.read() if p.stderr is not None else ""
        assert p.returncode == 130, err
        assert "cancelled" in err
        assert "Traceback" not in err
        ended = [r for r in _journal(denv, session)
                 if r.get("kind") in ("interrupted", "completed")]
        assert [(r["kind"], r.get("cancelled")) for r in ended] == [("interrupted", True)]
        cp = denv.run("-p", "-s", session, "--", "echo next")
        assert (cp.returncode, cp.stdout) == (0, "next\n"), cp.stderr
