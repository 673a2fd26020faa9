"""The examples of docs/embedding.md, run as they are against a real isolated daemon, so the
documentation cannot rot: a plain asyncio program, and a Starlette app on either event loop."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

from .harness import DaemonEnv

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def example(name: str) -> str:
    """The code block that follows ``<!-- example: name -->`` in docs/embedding.md."""
    found = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)\n```\n", DOC.read_text(),
                      re.DOTALL)
    assert found is not None, f"no example {name!r} in {DOC}"
    return found.group(1)


def test_the_asyncio_example_runs_as_a_plain_asyncio_program(denv: DaemonEnv) -> None:
    code = example("asyncio")
    assert "asyncio.run(main())" in code
    assert "import trio\n" not in code
    cp = subprocess.run([sys.executable, "-c", code], env=denv.env, capture_output=True,
                        text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == (
        "[echo turn 1] hello\n"
        "[echo turn 2] more\n"
        "3 None [echo turn 3] once more\n"
    )
    assert cp.stderr == ""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_starlette_example_streams_a_sessions_output(
    denv: DaemonEnv, monkeypatch: pytest.MonkeyPatch, backend: Literal["asyncio", "trio"]
) -> None:
    from starlette.testclient import TestClient

    for name, value in denv.env.items():
        if name.startswith("TRIO_AGENTD_"):
            monkeypatch.setenv(name, value)  # open_client() finds the isolated daemon
    ns: dict[str, Any] = {"__name__": "embedding_example"}
    exec(compile(example("starlette"), str(DOC), "exec"), ns)
    with TestClient(ns["app"], backend=backend) as http:  # runs the app's lifespan
        with http.stream("POST", "/sessions/web/prompt", content=b"hi") as response:
            assert response.status_code == 200
            body = b"".join(response.iter_bytes())
        assert body == b"[echo turn 1] hi\n"
        again = http.post("/sessions/web/prompt", content="\u00e9t\u00e9".encode())
        assert again.content == "[echo turn 2] \u00e9t\u00e9\n".encode()
