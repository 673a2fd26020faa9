"""``trio-agentd daemon`` meets an error raised inside the supervisor's nurseries (trio wraps
it in an ``ExceptionGroup``): its one error line, the failure status, never a traceback."""

from __future__ import annotations

import subprocess
import sys

from trio_agentd._cli_exit import EXIT_FAIL
from trio_agentd.timing import TEST_CLI_TIMEOUT

from .harness import DaemonEnv

# the supervisor fails inside its service nursery, as a task of it would (real process: the
# CLI's own daemon command, with Supervisor.serve replaced before it runs)
_FAILING_DAEMON = """
import sys
from trio_agentd import _supervisor, cli
from trio_agentd._errors import AgentdError, ErrorCode

async def serve(self, *, task_status=None):
    raise ExceptionGroup("from a nursery", [AgentdError(
        ErrorCode.STORAGE_ERROR, "injected: no room for the state dir — free space")])

_supervisor.Supervisor.serve = serve
cli.main(sys.argv[1:])
"""


def test_an_error_inside_the_supervisor_nursery_is_one_line(denv: DaemonEnv) -> None:
    cp = subprocess.run(
        [sys.executable, "-c", _FAILING_DAEMON, "daemon"], env=denv.env, capture_output=True,
        text=True, timeout=TEST_CLI_TIMEOUT, stdin=subprocess.DEVNULL,
    )
    assert cp.returncode == EXIT_FAIL, cp.stderr
    assert "Traceback" not in cp.stderr
    assert "ExceptionGroup" not in cp.stderr
    # (a daemon in the foreground also logs to stderr: those lines carry its log prefix)
    said = [line for line in cp.stderr.splitlines() if line.startswith("trio-agentd:")]
    assert said == ["trio-agentd: error: injected: no room for the state dir — free space"]
