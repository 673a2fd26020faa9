"""The fork template's preparation before its first fork: the warm-up loop and the filled pools.

Each runs in a fresh interpreter (as the template does: imports with the collector off), never
in the test process, whose heap and event loop are pytest's.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

PREAMBLE = """
import gc, json, os, signal, sys, threading
gc.disable()
from trio_agentd import _forktemplate
_forktemplate._preload()
"""


def _run(body: str, preamble: str = PREAMBLE) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", preamble + body], capture_output=True,
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


def test_a_worker_takes_its_environment_changing_only_what_differs() -> None:
    """A forked worker's environment becomes exactly the one it was sent, in ``os.environ``
    and in the C environment its agents inherit; a variable that is the same keeps its
    objects (nothing of the template's freed and made again: no write to the pages it
    shares with its workers)."""
    got = _run("""
import subprocess
os.environ.update({"TA_KEEP": "same", "TA_CHANGE": "old", "TA_DROP": "gone",
                   "TA_EMPTY": ""})
want = {**os.environ, "TA_CHANGE": "new", "TA_ADD": "added", "TA_BYTES": "a\\udcffb",
        "TA_NEW_EMPTY": ""}
del want["TA_DROP"]
def objects():
    return {k: id(os.environ._data[os.environ.encodekey(k)]) for k in os.environ}
before = objects()
_forktemplate.take_environ(want)
after = objects()
seen = subprocess.run(["env", "-0"], capture_output=True, check=True).stdout
c_env = dict(item.split(b"=", 1) for item in seen.split(b"\\0") if item)
print(json.dumps({"exact": dict(os.environ) == want,
                  "c_exact": c_env == {os.fsencode(k): os.fsencode(v) for k, v in want.items()},
                  "kept": sorted(k for k in after if before.get(k) == after[k]),
                  "names": sorted(want)}))
""")
    names = got.pop("names")
    assert isinstance(names, list)
    assert got == {"exact": True, "c_exact": True,
                   "kept": sorted(set(names) - {"TA_CHANGE", "TA_ADD", "TA_BYTES",
                                                "TA_NEW_EMPTY"})}


_LOGGING = """
import logging, io
from trio_agentd import _worker
cleared = []
clear = logging.Manager._clear_cache
logging.Manager._clear_cache = lambda self: (cleared.append(1), clear(self))[1]
level = logging.getLogger().level
sys.stderr = io.StringIO()
_worker.log_to_stderr()
logging.getLogger("trio_agentd.test").info("shown")
print(json.dumps({"before": level, "cleared": len(cleared), "level": logging.getLogger().level,
                  "logged": sys.stderr.getvalue().split(" ", 3)[-1]}))
"""


def test_a_forked_workers_logging_clears_no_loggers_cache_and_logs_info() -> None:
    """The template sets the workers' level (INFO) once: a worker forked from it logs INFO
    without setting it again, which would clear every logger's cache (a write to each
    logger, copied into each worker); an exec'd worker sets it itself."""
    forked = _run(_LOGGING)
    execd = _run(_LOGGING, preamble="import json, sys\n")
    assert forked == {"before": logging.INFO, "cleared": 0, "level": logging.INFO,
                      "logged": "INFO shown\n"}
    assert execd == {"before": logging.WARNING, "cleared": 1, "level": logging.INFO,
                     "logged": "INFO shown\n"}
