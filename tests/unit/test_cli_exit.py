"""How the CLI ends: a short command skips the interpreter's teardown once its output is out,
and anything that still needs the ordinary exit gets it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import trio_agentd

# a module global whose finaliser writes: it runs in the interpreter's teardown only
_PROGRAM = """
import os, sys
from trio_agentd._cli_exit import exit_now
class Teardown:
    def __del__(self):
        os.write(1, b" teardown")
marker = Teardown()
{setup}
print("answer", end="")  # still in stdout's buffer (a pipe): exit_now must flush it
exit_now(7)
"""


def _run(setup: str) -> tuple[int, str]:
    # -S: no site, whose modules (an editable install's hook) would change what is loaded
    out = subprocess.run(
        [sys.executable, "-S", "-c", _PROGRAM.format(setup=setup)], capture_output=True,
        text=True, env={"PYTHONPATH": str(Path(trio_agentd.__file__).parents[1])}, timeout=60,
    )
    assert out.stderr == ""
    return out.returncode, out.stdout


def test_a_short_command_leaves_without_the_teardown_but_with_its_output() -> None:
    assert _run("") == (7, "answer")


@pytest.mark.parametrize("setup", [
    "import atexit; atexit.register(lambda: os.write(1, b' hook'))",
    "import threading",
    "import logging",
])
def test_anything_that_needs_the_ordinary_exit_gets_it(setup: str) -> None:
    code, out = _run(setup)
    assert code == 7
    assert out.startswith("answer")
    assert out.endswith(" teardown")
    assert ("hook" in out) == ("atexit" in setup)
