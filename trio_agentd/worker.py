"""``python -m trio_agentd.worker`` — a session worker (started by the supervisor only).

With ``--template`` it is the supervisor's fork template (``_forktemplate``): each worker it
forks returns from ``serve_template()`` and runs ``main()`` as an exec'd worker does.

A worker that ends (a stop, a signal, an error it reports) leaves with ``os._exit`` once its
files are closed, its log flushed and the ``atexit`` handlers (an agent's too) have run: the
interpreter's own teardown of every module and object costs a worker ~10 ms of CPU (measured),
a second for a shutdown of 100 sessions, and does nothing a worker needs. An exception nothing
handled ends it the ordinary way, with its traceback in worker.log.
"""

import atexit
import contextlib
import logging
import os
import sys

from ._trioimport import import_trio

import_trio()  # before ``_worker`` does: the template (or an exec'd worker) runs no ldconfig
from ._worker import main  # noqa: E402


def _exit_code(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into a status (a message: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_and_exit() -> None:
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # a closed or broken stream: nobody reads it any more, nothing is lost unflushed
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--template"]:
        from ._forktemplate import serve_template

        serve_template()
    run_and_exit()
