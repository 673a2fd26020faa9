"""docs/agents.md: its example agent is this test's agent, and its console session is what the
CLI prints, through a real daemon (the doc cannot drift from the code)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import trio

from trio_agentd.agents import Agent, ExitStatus, Stderr, TurnContext

from .harness import DaemonEnv

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
CLI = str(Path(sys.executable).parent / "trio-agentd")


def example_source() -> str:
    text = DOC.read_text()
    block = re.search(r"<!-- example-agent:begin -->\n```python\n(.*?)```\n"
                      r"<!-- example-agent:end -->", text, re.S)
    assert block is not None, "docs/agents.md lost its example agent"
    return block.group(1)


def example_console() -> list[tuple[str, str]]:
    """``(command, expected output)`` of the console block that follows the example."""
    text = DOC.read_text().split("<!-- example-agent:end -->", 1)[1]
    block = re.search(r"```console\n(.*?)```\n", text, re.S)
    assert block is not None
    steps: list[tuple[str, str]] = []
    for line in block.group(1).splitlines(keepends=True):
        if line.startswith("$ "):
            steps.append((line[2:].strip(), ""))
        else:
            steps[-1] = (steps[-1][0], steps[-1][1] + line)
    return steps


def test_the_example_agent_runs_as_the_doc_shows(denv: DaemonEnv) -> None:
    proj = denv.root / "proj"
    proj.mkdir()
    (proj / "myagent.py").write_text(example_source())
    steps = example_console()
    assert len(steps) == 2
    for command, expected in steps:
        argv = shlex.split(command)
        assert argv[0] == "trio-agentd"
        cp = subprocess.run([CLI, *argv[1:]], env=denv.env, cwd=proj, capture_output=True,
                            timeout=60, stdin=subprocess.DEVNULL)
        assert (cp.returncode, cp.stdout.decode(), cp.stderr) == (0, expected, b""), command
    assert (denv.home / "sessions" / "wc" / "wordcount.json").read_text() == '{"total": 4}'


async def test_the_example_agent_reports_an_empty_prompt_on_stderr_with_status_2(
        tmp_path: Path) -> None:
    module = ModuleType("myagent")
    exec(compile(example_source(), "myagent.py", "exec"), module.__dict__)
    agent = module.make()
    assert isinstance(agent, Agent)
    assert agent.replayable is False
    ctx = TurnContext(session_id="wc", turn=1, cwd=tmp_path, session_dir=tmp_path)
    with trio.fail_after(5):
        chunks = [chunk async for chunk in agent.turn("   ", ctx)]
    assert chunks == [Stderr("wordcount: the prompt has no words\n"), ExitStatus(2)]
    assert not (tmp_path / "wordcount.json").exists()
