"""The trio_agentd pytest plugin in a fresh project: the real-daemon fixture's isolation and
teardown, and no effect on tests that use none of its fixtures.

Each test writes a small project into an empty dir under /tmp and runs ``python -m pytest``
there in a subprocess with the installed package (the plugin found by its entry point).
"""

from __future__ import annotations

import contextlib
import json
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

pytestmark = pytest.mark.timeout(300)

DAEMON_TESTS = '''
import json
import os
from pathlib import Path

from trio_agentd.testing import DaemonEnv


def test_a_private_daemon(agentd_daemon: DaemonEnv, tmp_path: Path) -> None:
    assert os.environ["TRIO_AGENTD_SOCKET"] == agentd_daemon.socket
    assert os.environ["TRIO_AGENTD_HOME"] == str(agentd_daemon.home)
    assert agentd_daemon.prompt("hi") == "[echo turn 1] hi"
    hello = agentd_daemon.hello()
    assert hello is not None
    started = agentd_daemon.our_pids()
    assert hello["pid"] in started
    out = Path(os.environ["REPORT_DIR"]) / "daemon.json"
    out.write_text(json.dumps({"root": str(agentd_daemon.root), "pids": started,
                               "tmp_path": str(tmp_path), "socket": agentd_daemon.socket}))


def test_the_environment_is_restored_after_the_fixture() -> None:
    assert not [k for k in os.environ if k.startswith("TRIO_AGENTD_") or k == "TA_TEST_RUN"]
'''

PLAIN_TESTS = '''
import os

import pytest
import trio


def test_sync() -> None:
    assert not [k for k in os.environ if k.startswith("TRIO_AGENTD_") or k == "TA_TEST_RUN"]


@pytest.mark.trio
async def test_async() -> None:
    await trio.sleep(0)


async def test_unmarked_async_is_left_to_pytest() -> None:
    pass
'''


@pytest.fixture
def project() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ta-plug-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _marked(value: str) -> list[int]:
    """Processes whose environment has ``TA_TEST_RUN=value``, by pid."""
    entry = f"TA_TEST_RUN={value}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if entry in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                continue
    return found


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "TRIO_AGENTD_", "TA_TEST_RUN", "PYTHONPATH"))}
    env["REPORT_DIR"] = str(project)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=240,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("long_basetemp", [False, True], ids=["in-tmp-path", "long-tmp-path"])
def test_the_daemon_fixture_is_private_and_its_teardown_stops_exactly_what_it_started(
    project: Path, long_basetemp: bool
) -> None:
    (project / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    (project / "test_daemon.py").write_text(DAEMON_TESTS)
    # too long a tmp_path for a socket: the fixture takes a short dir in /tmp instead
    basetemp = project / ("b" * 60 if long_basetemp else "b")
    cp = _pytest(project, f"--basetemp={basetemp}")
    report = cp.stdout + cp.stderr
    seen = json.loads((project / "daemon.json").read_text())
    try:
        assert cp.returncode == 0, report
        assert "2 passed" in report, report
        root = Path(seen["root"])
        if long_basetemp:
            assert not root.is_relative_to(seen["tmp_path"])
            assert not root.exists()  # the short dir is removed after the test
        else:
            assert root == Path(seen["tmp_path"]) / "agentd"
            # shut down, not just killed: the supervisor stopped its workers and said so
            logs = "".join(p.read_text() for p in root.glob("home/daemons/*/daemon.log"))
            assert re.search(r"generation \S+ stopped \(workers stopped\)", logs), logs
            assert not Path(seen["socket"]).exists()
        assert len(seen["pids"]) >= 2  # the supervisor and the worker it started
        assert _marked(seen["root"]) == []  # every process it started is gone
    finally:
        for pid in _marked(seen["root"]):  # only if it failed: what it left, by pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def test_a_project_that_uses_no_fixture_runs_the_same_with_and_without_the_plugin(
    project: Path,
) -> None:
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "test_plain.py").write_text(PLAIN_TESTS)
    with_plugin = _pytest(project)
    without = _pytest(project, "-p", "no:trio_agentd")
    assert re.search(r"^plugins: .*trio-agentd", with_plugin.stdout, re.MULTILINE)

    def outcomes(cp: subprocess.CompletedProcess[str]) -> tuple[int, list[str]]:
        lines = re.findall(r"^(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) .*$", cp.stdout,
                           re.MULTILINE)
        return cp.returncode, sorted(lines)

    assert outcomes(with_plugin) == outcomes(without), with_plugin.stdout + without.stdout
    assert "PASSED test_plain.py::test_sync" in with_plugin.stdout
    assert "PASSED test_plain.py::test_async" in with_plugin.stdout
