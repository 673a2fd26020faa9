"""A command-line agent that behaves like an LLM CLI, for end-to-end tests.

Run as a program (``exec:python fake_llm.py``) it reads the prompt on stdin and answers on
stdout a few tokens at a time, with small delays; it writes progress to stderr, runs a child
"tool" process and includes the tool's output, and exits with a chosen status. The prompt
steers it with ``key=value`` words; every other word is echoed back as a token:

- ``exit=N``: exit with status N (default 0).
- ``tool=NAME``: run ``sh -c 'echo tool NAME ran; sleep $TOOL_SLEEP'`` as a child process and
  include its output; ``tool_sleep=S`` makes the tool run S seconds (for cancel tests). The
  tool's pid is appended to ``$FAKE_LLM_PIDS`` when that names a file.
- ``tokens=N``: answer with N extra numbered tokens (big answers).
- ``delay=S``: seconds between tokens (default 0.005).
- ``cwd=1``: also answer with the directory it runs in (``cwd: PATH`` on a line of its own).

It never reads its environment for anything but ``FAKE_LLM_PIDS``, and uses only the standard
library, so it runs with any Python.

Imported as a Python agent (``fake_llm:agent``, from a session whose directory holds this file),
:class:`FakeLLM` answers the same way inside the worker: tokens streamed with small delays,
progress as ``Stderr`` pieces, the chosen exit status last.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator


def _stream(text: str, delay: float) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
    if delay:
        time.sleep(delay)


def main() -> int:
    prompt = sys.stdin.read()
    settings: dict[str, str] = {}
    words: list[str] = []
    for word in prompt.split():
        key, eq, value = word.partition("=")
        if eq and key.isidentifier():
            settings[key] = value
        else:
            words.append(word)
    delay = float(settings.get("delay", "0.005"))
    print(f"thinking about {len(words)} words", file=sys.stderr, flush=True)
    _stream("answer:", delay)
    for word in words:
        _stream(f" {word}", delay)
    for i in range(int(settings.get("tokens", "0"))):
        _stream(f" t{i}", 0)
    _stream("\n", 0)
    if settings.get("cwd") == "1":
        _stream(f"cwd: {os.getcwd()}\n", 0)
    if "tool" in settings:
        print(f"calling tool {settings['tool']}", file=sys.stderr, flush=True)
        script = f"echo tool {settings['tool']} ran; sleep {settings.get('tool_sleep', '0')}"
        tool = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE)
        if pids := os.environ.get("FAKE_LLM_PIDS"):
            with open(pids, "a") as f:
                f.write(f"{tool.pid}\n")
        out, _ = tool.communicate()
        _stream(out.decode(), 0)
    print("done", file=sys.stderr, flush=True)
    return int(settings.get("exit", "0"))


class FakeLLM:
    """The same behaviour as a Python agent (no tool process: a Python agent runs in the
    worker)."""

    replayable = False

    async def turn(self, prompt: str, ctx: object) -> AsyncIterator[object]:
        import trio

        from trio_agentd.agents import ExitStatus, Stderr

        settings = dict(w.partition("=")[::2] for w in prompt.split() if "=" in w)
        words = [w for w in prompt.split() if "=" not in w]
        delay = float(settings.get("delay", "0.005"))
        yield Stderr(f"thinking about {len(words)} words\n")
        yield "answer:"
        for word in words:
            await trio.sleep(delay)
            yield f" {word}"
        yield "\n"
        yield Stderr("done\n")
        yield ExitStatus(int(settings.get("exit", "0")))


def agent() -> FakeLLM:
    return FakeLLM()


if __name__ == "__main__":
    sys.exit(main())
