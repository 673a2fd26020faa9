"""Real processes in private temp dirs, and cleanup that kills exactly what a test started.

The harness itself is public, in :mod:`trio_agentd.testing` (``DaemonEnv``, ``daemon_env``,
``wait_for``; the ``agentd_daemon`` pytest fixture is built on it): every process a test starts
(the CLI, autostarted supervisors, their workers) inherits a unique ``TA_TEST_RUN`` marker;
:meth:`DaemonEnv.our_pids` finds them by that marker in ``/proc/<pid>/environ`` — by pid, never
by name — and teardown SIGKILLs them.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path
from typing import Any

from trio_agentd.testing._daemon import DaemonEnv as DaemonEnv
from trio_agentd.testing._daemon import daemon_env as daemon_env
from trio_agentd.testing._daemon import wait_for as wait_for


def failure_status(cp: subprocess.CompletedProcess[Any]) -> int:
    """The exit status the CLI gives when trio-agentd itself fails: 125 for a prompt (never
    confused with an agent's own status), 1 for every other command."""
    from trio_agentd._cli_exit import EXIT_FAIL, EXIT_OWN

    return EXIT_OWN if "-p" in cp.args or "prompt" in cp.args else EXIT_FAIL


def wipe(path: Path) -> None:
    """Delete a tree as a cleaner does, under a live daemon that may make part of it again
    meanwhile: a directory filled again between ``rmtree``'s listing and its ``rmdir``
    (``ENOTEMPTY``), or a file replaced while it was listed, is wiped again, so the deletion
    never fails on the race."""
    for _ in range(100):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:  # a file renamed over or removed while rmtree listed it
            if not path.exists():
                return
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
    raise AssertionError(f"{path} was made again faster than it could be deleted, 100 times")
