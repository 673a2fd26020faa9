"""Failed writes (ENOSPC, EDQUOT, EFBIG, EIO): the ``storage_error`` and bounded retries.

A journal write that fails is answered at once (``storage_error``); a write whose loss only
costs a later step (a worker descriptor, an owner record, a transcript line) is logged and
tried again after each of ``Timing.storage_retry_delays``, then given up on, logged again.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from ._errors import AgentdError, ErrorCode

T = TypeVar("T")

REMEDY = "free space on that filesystem (or raise its quota or file size limit)"
# the errnos of a write that failed for want of room (or of a failing disk), not of a bug
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def storage_error(
    path: str | os.PathLike[str], exc: OSError, *, what: str = "the journal", ran: bool = False
) -> AgentdError:
    """The one-line ``storage_error``: the file, the errno name, what happened, the fix."""
    cause = f"{errno_name(exc)} ({exc.strerror or exc})"
    if ran:
        text = (
            f"the turn ran but its result could not be made durable: writing {what}"
            f" {os.fspath(path)} failed with {cause} — {REMEDY}; the result is kept, and a"
            " resend of this same command gets it once there is room (send the prompt again"
            " and it runs anew)"
        )
    else:
        text = (
            f"the prompt was not run: writing {what} {os.fspath(path)} failed with {cause}"
            f" — {REMEDY}, then send the prompt again"
        )
    return AgentdError(
        ErrorCode.STORAGE_ERROR,
        text,
        {"path": os.fspath(path), "errno": errno_name(exc), "ran": ran},
    )


async def retried(
    fn: Callable[[], T],
    *,
    what: str,
    delays: Sequence[float],
    log: logging.Logger,
    failed: OSError | None = None,
) -> T:
    """``fn()``, tried again after each of ``delays`` while it raises ``OSError``.

    ``failed``: the caller's own first attempt already failed so: begin with the first delay.

    Raises:
        OSError: the last failure, once every delay is used up (logged as an error).
    """
    import trio

    attempt = 0
    exc = failed
    while True:
        if exc is not None:
            if attempt >= len(delays):
                log.error("could not write %s: %s (%s); gave up after %d attempts",
                          what, errno_name(exc), exc, attempt + 1)
                raise exc
            log.warning("could not write %s: %s (%s); trying again in %gs",
                        what, errno_name(exc), exc, delays[attempt])
            await trio.sleep(delays[attempt])
            attempt += 1
        try:
            result = fn()
        except OSError as err:
            exc = err
            continue
        if attempt:
            log.info("wrote %s after %d failed attempts", what, attempt)
        return result
