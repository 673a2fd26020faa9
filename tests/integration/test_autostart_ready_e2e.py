"""Autostart wakes on the supervisor's readiness pipe, not on its probe ticks (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time

from .harness import DaemonEnv

TICK = 60.0  # a probe tick far longer than any start: only the pipe can end the wait early

# a client that autostarts the supervisor with that tick (in a process of its own: the
# supervisor it spawns is never a child this test leaves behind)
_CLIENT = """
import dataclasses, sys
from trio_agentd._autostart import _ready_pipes, autostart_and_wait
from trio_agentd._paths import Layout
from trio_agentd.timing import DEFAULT_TIMING
tick = float(sys.argv[4])
layout = Layout.resolve(socket=sys.argv[1], home=sys.argv[2], registry=sys.argv[3])
autostart_and_wait(layout, dataclasses.replace(DEFAULT_TIMING, probe_interval=tick,
                                               startup_timeout=2 * tick))
assert _ready_pipes == {}, _ready_pipes  # its end of the pipe is closed
"""


def test_the_client_probes_as_soon_as_its_supervisor_serves_hellos(denv: DaemonEnv) -> None:
    start = time.monotonic()
    cp = subprocess.run(
        [sys.executable, "-c", _CLIENT, denv.socket, str(denv.home), str(denv.registry),
         str(TICK)],
        env=denv.env, capture_output=True, text=True, timeout=2 * TICK,
    )
    took = time.monotonic() - start
    assert cp.returncode == 0, cp.stderr
    # its first probe (at once) finds nobody; the next comes when the supervisor says ready
    assert took < TICK / 2
    assert denv.hello() is not None
    assert len(denv.owner_records()) == 1
