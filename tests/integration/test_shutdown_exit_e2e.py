"""A clean ``shutdown`` ends the supervisor without the interpreter's teardown (its atexit
handlers and its log flushed first), and its workers with their state durable: the next
supervisor brings every session back with its history."""

from __future__ import annotations

import subprocess
import sys

from trio_agentd.testing._daemon import wait_for
from trio_agentd.timing import TEST_CLI_TIMEOUT, TEST_SHUTDOWN_TIMEOUT

from .harness import DaemonEnv

# the CLI's own daemon command, with an atexit hook and an object only the interpreter's
# teardown would finalize (real process)
_DAEMON = """
import atexit, os, sys
from trio_agentd import cli

MARKS = sys.argv.pop(1)

def mark(what):
    fd = os.open(MARKS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, what.encode() + b"\\n")
    os.close(fd)

class TornDown:
    def __del__(self):
        mark("teardown")

torn_down = TornDown()
atexit.register(mark, "atexit")
cli.main(sys.argv[1:])
"""


def test_a_clean_shutdown_ends_the_supervisor_without_teardown(denv: DaemonEnv) -> None:
    marks = denv.root / "marks"
    daemon = subprocess.Popen(
        [sys.executable, "-c", _DAEMON, str(marks), "daemon"], env=denv.env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: denv.hello() is not None, timeout=TEST_CLI_TIMEOUT,
                 what="the supervisor answers")
        assert denv.prompt("one", session="s1") == "[echo turn 1] one"
        denv.run("shutdown", timeout=TEST_SHUTDOWN_TIMEOUT)
        assert daemon.wait(timeout=TEST_SHUTDOWN_TIMEOUT) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    # its atexit handlers ran, its last log line is out; nothing of the teardown ran
    assert marks.read_text().splitlines() == ["atexit"]
    assert "stopped (workers stopped)" in denv.log_text()
    assert denv.our_pids() == []
    # the next supervisor brings the session back, its history whole
    assert denv.prompt("two", session="s1") == "[echo turn 2] two"
