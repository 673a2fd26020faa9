"""docs/testing.md's examples run verbatim in a fresh project, as a user would run them.

Each ```python block of docs/testing.md is written, unchanged, into an empty directory as a
test file of its own, next to a bare ``pytest.ini`` (once as it is, once with
``trio_mode = true``), and ``python -m pytest`` runs there in a subprocess with the installed
package: this repository's configuration, conftests and fixtures are out of reach, so the
examples pass only if their imports are complete and the ``trio_agentd`` pytest plugin is found
through its entry point.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
TEST = re.compile(r"^(?:async )?def (test_\w+)\(", re.MULTILINE)

pytestmark = pytest.mark.timeout(300)


def doc_blocks() -> list[str]:
    return BLOCK.findall(DOC.read_text())


def test_the_docs_have_the_examples_a_user_needs() -> None:
    blocks = doc_blocks()
    assert len(blocks) >= 4
    for block in blocks:
        assert TEST.search(block), f"a python block of {DOC.name} has no test:\n{block}"
        assert re.search(r"^from trio_agentd\.testing import ", block, re.MULTILINE), block
    text = "\n".join(blocks)
    # a crashed worker respawned on MockClock at an exact virtual time
    assert "autojump_clock" in text
    assert ".die()" in text
    assert "trio.current_time() ==" in text
    # the supervisor on MockClock, and a real daemon end to end
    assert "agentd_fake_supervisor" in text
    assert "agentd_daemon" in text
    # both clients of the real daemon: the CLI (sync) and open_client (async)
    assert "agentd_daemon.prompt(" in text
    assert "agentd_daemon.open_client()" in text


@pytest.fixture
def project() -> Iterator[Path]:
    """An empty project dir, short enough that the daemons' sockets fit under its basetemp."""
    path = Path(tempfile.mkdtemp(prefix="ta-doc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _leftovers(basetemp: Path) -> list[int]:
    """Processes whose ``TA_TEST_RUN`` marker names a dir under ``basetemp``, by pid."""
    prefix = f"TA_TEST_RUN={basetemp}/".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(prefix) for e in entries):
            found.append(int(name))
    return found


@pytest.mark.parametrize("ini", ["[pytest]\n", "[pytest]\ntrio_mode = true\n"],
                         ids=["no-trio-mode", "trio-mode"])
def test_every_python_block_of_the_testing_doc_passes_verbatim_in_a_fresh_project(
    project: Path, ini: str
) -> None:
    blocks = doc_blocks()
    expected = []
    for i, block in enumerate(blocks, 1):
        (project / f"test_doc_example_{i}.py").write_text(block)
        expected += TEST.findall(block)
    # warnings are errors, as in a strict project: the fixtures must raise none
    (project / "pytest.ini").write_text(ini + "filterwarnings = error\n")
    basetemp = project / "bt"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "TRIO_AGENTD_", "TA_TEST_RUN", "PYTHONPATH"))}
    try:
        cp = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
             f"--basetemp={basetemp}"],
            cwd=project, env=env, capture_output=True, text=True, timeout=240,
            stdin=subprocess.DEVNULL,
        )
        report = cp.stdout + cp.stderr
        assert cp.returncode == 0, report
        passed = re.findall(r"^PASSED \S+::(test_\w+)", report, re.MULTILINE)
        assert sorted(passed) == sorted(expected), report
        assert f"{len(expected)} passed" in report, report
        # it ran in the fresh project (not this repository), the plugin found by its entry point
        assert f"rootdir: {project}\nconfigfile: pytest.ini\n" in report, report
        assert re.search(r"^plugins: .*trio-agentd", report, re.MULTILINE), report
        # the real-daemon fixture's teardown killed everything it started
        assert _leftovers(basetemp) == [], report
    finally:
        for pid in _leftovers(basetemp):  # only if the run failed: what it left, by pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
