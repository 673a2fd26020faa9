"""The fork template's preparation before its first fork: the warm-up loop and the filled pools.

Each runs in a fresh interpreter (as the template does: imports with the collector off), never
in the test process, whose heap and event loop are pytest's.
"""

from __future__ import annotations

import json
import subprocess
import sys

PREAMBLE = """
import gc, json, os, signal, sys, threading
gc.disable()
from trio_agentd import _forktemplate
_forktemplate._preload()
"""


def _run(body: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PREAMBLE + body], capture_output=True,
                         text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def test_the_warm_up_leaves_no_loop_no_thread_and_no_descriptor() -> None:
    got = _run("""
fds = sorted(os.listdir("/proc/self/fd"))
_forktemplate._warm_up()
import trio
try:
    trio.lowlevel.current_trio_token()
    loop = True
except RuntimeError:
    loop = False
after = sorted(os.listdir("/proc/self/fd"))
print(json.dumps({"threads": threading.active_count(), "loop": loop,
                  "wakeup_fd": signal.set_wakeup_fd(-1), "new_fds": len(after) - len(fds),
                  "runs": _forktemplate.WARM_UP_RUNS}))
""")
    assert got == {"threads": 1, "loop": False, "wakeup_fd": -1, "new_fds": 0, "runs": 10}


def test_filling_leaves_at_most_one_partly_used_pool_per_block_size() -> None:
    got = _run("""
gc.collect()
before = _forktemplate._free_blocks()
_forktemplate._fill_free_blocks()
after = _forktemplate._free_blocks()
print(json.dumps({"before": before, "after": after}))
""")
    before = {int(k): v for k, v in dict(got["before"]).items()}  # type: ignore[call-overload]
    after = {int(k): v for k, v in dict(got["after"]).items()}  # type: ignore[call-overload]
    sizes = [16 * i for i in range(1, 33)]
    assert sorted(before) == sizes  # every block size parsed
    assert sorted(after) == sizes
    pool = 16 * 1024
    # before: more free blocks of a size than one pool holds (scattered over the pools in
    # use); after: at most the untouched rest of the one pool the fill itself opened last
    assert any(before[size] >= pool // size for size in sizes), before
    assert all(after[size] <= pool // size for size in sizes), after


def test_the_rehearsal_specialises_the_workers_code_and_leaves_nothing_behind(
    tmp_path: object,
) -> None:
    """One session served start to end in the template: what a worker runs per prompt, per
    connection and at its start is specialised after it (Python 3.11+'s adaptive bytecode:
    a forked worker then runs it without writing to the code it shares), and no thread,
    event loop, descriptor, scratch file or log handler is left."""
    got = _run(f"""
import dis, logging
os.environ["TMPDIR"] = {str(tmp_path)!r}
from trio_agentd import _journal, _rehearsal, _workercore, _workerturns
from trio_agentd.agents import _echo

def specialised(f):
    return sum(a.opname != b.opname for a, b in zip(dis.get_instructions(f, adaptive=True),
                                                    dis.get_instructions(f)))

funcs = [_journal._line, _workerturns.TurnRunner._run_turn,
         _workercore.WorkerCore.serve_connection, _workercore.WorkerCore.__init__,
         _echo.EchoAgent.turn]
root = logging.getLogger()
before = {{"specialised": [specialised(f) for f in funcs], "handlers": len(root.handlers),
          "level": root.level, "fds": sorted(os.listdir("/proc/self/fd"))}}
_rehearsal.rehearse()
import trio
try:
    trio.lowlevel.current_trio_token()
    loop = True
except RuntimeError:
    loop = False
print(json.dumps({{"before": before, "specialised": [specialised(f) for f in funcs],
                  "handlers": len(root.handlers), "level": root.level,
                  "fds": sorted(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
                  "loop": loop, "left": os.listdir({str(tmp_path)!r})}}))
""")
    before = got.pop("before")
    assert isinstance(before, dict)
    assert before.pop("specialised") == [0, 0, 0, 0, 0]  # nothing ran yet
    specialised = got.pop("specialised")
    assert isinstance(specialised, list)
    assert all(n > 0 for n in specialised), specialised
    assert got == {**before, "threads": 1, "loop": False, "left": []}
