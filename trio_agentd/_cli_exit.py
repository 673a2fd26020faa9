"""The CLI's exit statuses, and how it ends: quietly when stdout's reader is gone, at once
when nothing is left to clean up.

Exit codes: 0 success, 1 failure, 2 usage error, 3 ``doctor`` found a problem it did not fix,
141 (128 + SIGPIPE, as ``yes | head``) stdout was closed before everything was written. A prompt
exits with its agent's status instead (see :func:`._cli_prompt.prompt_exit_code`).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from typing import NoReturn

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_DOCTOR = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C, as a shell reports it
EXIT_PIPE = 128 + 13  # stdout closed early: the status a shell reports for death by SIGPIPE
EXIT_OWN = 125  # a prompt failed in trio-agentd itself (as docker run, env and timeout say it)


def quiet_pipe_exit() -> int:
    """Stdout's reader is gone: exit 141 without a word, as ``yes | head`` does."""
    try:  # what is still buffered would fail again in the interpreter's flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return EXIT_PIPE


def stdout_broken() -> bool:
    """Whether stdout is a pipe nobody reads any more (poll reports POLLERR for it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


# modules whose presence means something may still run at exit: a thread to join, a log
# handler to flush (the daemon, a test calling main() in-process)
_EXIT_HOOKED = ("threading", "logging")


def exit_now(code: int) -> None:
    """End the process with ``code``, skipping the interpreter's teardown when nothing needs it.

    A short command (``-p``, ``ps``) spends milliseconds tearing down the modules it imported;
    once its output is flushed that work changes nothing, so it leaves with ``os._exit``. When
    anything may still need the ordinary exit (an ``atexit`` hook, a thread, logging, output
    that cannot be flushed), it takes ``sys.exit`` as before.
    """
    import atexit

    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        sys.exit(code)  # the ordinary exit reports or hides it as it always did
    if atexit._ncallbacks() or any(name in sys.modules for name in _EXIT_HOOKED):
        sys.exit(code)
    os._exit(code)


def exit_after_cleanup(code: int) -> NoReturn:
    """End a long-running process (the supervisor, once stopped) with ``code``: its ``atexit``
    handlers run, its log handlers are flushed and closed, stdout and stderr flushed, and then
    it leaves without the interpreter's teardown of every module and object, which only costs
    time: a supervisor that held 100 sessions took 0.5 to 1.1 s from the end of ``trio.run``
    to its exit on a loaded 2-core machine, and 8 ms without (measured), and ``trio-agentd
    shutdown`` waits for its exit. A thread that is not a daemon thread is still waited for:
    with one left, the ordinary exit runs.
    """
    import atexit
    import contextlib
    import threading

    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    if "logging" in sys.modules:
        import logging

        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # a closed or broken stream: nobody reads it any more, nothing is lost unflushed
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code)
