"""Running out of resources is an error for one request, never the end of the daemon.

Theory of operation
-------------------
* :func:`raise_nofile_limit` raises the soft ``RLIMIT_NOFILE`` to the hard limit at process
  start (supervisor and worker entry points).
* :func:`is_exhaustion` / :func:`exhaustion_error` turn an ``OSError`` of a resource errno
  (EMFILE, ENFILE, ENOMEM, ENOBUFS, EAGAIN) into an ``AgentdError`` ``resource_exhausted`` whose
  one line names the limit and its value.
* :func:`accept_forever` is the accept loop of both servers. It accepts through
  :class:`trio.SocketListener` (which already skips ECONNABORTED and its kin) and, like
  :func:`trio.serve_listeners`, backs off :data:`~.timing.ACCEPT_BACKOFF` on the capacity errnos
  instead of raising. Unlike serve_listeners it logs through a :class:`RateLimitedLog`, and a
  supervisor may *shed*: it keeps one spare descriptor, and on EMFILE/ENFILE gives it up for a
  moment to accept the waiting connection, answer it with one error line and close it, so a
  client meets a clear ``resource_exhausted`` instead of a listener that never says hello.
* :class:`RateLimitedLog` logs a repeated cause once per interval, with a count of the lines it
  held back.
"""

from __future__ import annotations

import errno
import logging
import os
import socket as _socket
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import trio

from ._errors import AgentdError, ErrorCode
from .timing import ACCEPT_BACKOFF

# what accept(2) returns when the system or process is out of capacity: the set
# trio.serve_listeners backs off on (trio._highlevel_serve_listeners.ACCEPT_CAPACITY_ERRNOS)
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# ... and what pipe/fork/exec/open return for the same reason (EAGAIN: fork under RLIMIT_NPROC)
RESOURCE_ERRNOS = ACCEPT_CAPACITY_ERRNOS | {errno.EAGAIN}


def is_exhaustion(exc: BaseException) -> bool:
    """An ``OSError`` that means "out of resources", not "this request is wrong"."""
    return isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS


def nofile_limit() -> int | None:
    """The soft ``RLIMIT_NOFILE`` of this process (``None``: unlimited or unknown)."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == getattr(resource, "RLIM_INFINITY", -1) else soft


def exhaustion_text(errnum: int | None) -> str:
    """One line naming the resource, its limit and the fix (no request context)."""
    if errnum == errno.EMFILE:
        return (f"too many open files (RLIMIT_NOFILE {nofile_limit()}) — raise `ulimit -n` or"
                " close idle clients")
    if errnum == errno.ENFILE:
        return ("the system's open file table is full (ENFILE) — close files or raise"
                " fs.file-max")
    if errnum == errno.EAGAIN:
        return ("cannot start a process now (EAGAIN: RLIMIT_NPROC or the system's process"
                " table) — stop idle sessions or raise `ulimit -u`")
    if errnum == errno.ENOMEM:
        return "out of memory (ENOMEM) — free memory or stop idle sessions"
    if errnum == errno.ENOBUFS:
        return "out of kernel buffer space (ENOBUFS) — close idle clients"
    name = errno.errorcode.get(errnum, str(errnum)) if errnum is not None else "?"
    return f"out of resources ({name})"


def exhaustion_error(exc: OSError, what: str | None = None) -> AgentdError:
    """``resource_exhausted`` for ``exc``; ``what`` says what could not be done."""
    errnum = exc.errno
    text = exhaustion_text(errnum)
    details: dict[str, object] = {"errno": errno.errorcode.get(errnum or 0, str(errnum))}
    if errnum == errno.EMFILE:
        details.update(limit="RLIMIT_NOFILE", value=nofile_limit())
    return AgentdError(
        ErrorCode.RESOURCE_EXHAUSTED, f"{what}: {text}" if what else text, details
    )


def raise_nofile_limit(log: logging.Logger, *, report: bool = True) -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; log (a failure always, the limits
    only with ``report``) and return (soft, hard) now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if want == resource.RLIM_INFINITY:
        # Linux never has an infinite hard limit here; elsewhere (macOS) the kernel caps it
        want = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else soft
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            log.warning("RLIMIT_NOFILE: could not raise the soft limit %s to %s: %s",
                        soft, want, exc)
            return soft, hard
        if report:
            log.info("RLIMIT_NOFILE: raised the soft limit from %s to %s (hard %s)", soft,
                     want, _limit_text(hard))
        return want, hard
    if report:
        log.info("RLIMIT_NOFILE: soft limit %s (hard %s)", _limit_text(soft),
                 _limit_text(hard))
    return soft, hard


def _limit_text(value: int) -> str:
    import resource

    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


# --- rate-limited logging ------------------------------------------------------------------


@dataclass(slots=True)
class _Cause:
    last: float  # when a line for this cause was last written
    suppressed: int = 0  # lines held back since then
    total: int = 1  # occurrences since the cause first appeared (or was cleared)


class RateLimitedLog:
    """Log a repeated cause at most once per ``interval`` seconds.

    A cause is any hashable key (e.g. ``("accept", errno.EMFILE)``). The first occurrence is
    logged at once; later ones within ``interval`` of the last line are counted, and the next
    line written says how many were suppressed. ``clock`` is any monotonic clock in seconds
    (``trio.current_time`` in the daemon, so MockClock tests see exact times).
    """

    def __init__(
        self, logger: logging.Logger, interval: float, *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._causes: dict[Hashable, _Cause] = {}

    def log(
        self, level: int, key: Hashable, msg: str, *args: object, exc_info: bool = False
    ) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval`` ago.

        Returns whether a line was written. ``exc_info`` applies to written lines only.
        """
        now = self.clock()
        cause = self._causes.get(key)
        if cause is None:
            self._causes[key] = _Cause(last=now)
            self.logger.log(level, msg, *args, exc_info=exc_info)
            return True
        cause.total += 1
        if now - cause.last < self.interval:
            cause.suppressed += 1
            return False
        if cause.suppressed:
            msg += " (%d similar lines suppressed in the last %gs)"
            args = (*args, cause.suppressed, round(now - cause.last, 3))
        cause.last = now
        cause.suppressed = 0
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def error(self, key: Hashable, msg: str, *args: object, exc_info: bool = False) -> bool:
        return self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def clear(self, key: Hashable) -> int:
        """The cause is over: forget it. Returns how often it occurred (0: it was not active),
        so the caller can log one line saying it recovered."""
        cause = self._causes.pop(key, None)
        return 0 if cause is None else cause.total

    def active(self, key: Hashable) -> bool:
        return key in self._causes


# --- accepting connections -----------------------------------------------------------------


class _Reserve:
    """One spare descriptor, given up for a moment to answer a connection on EMFILE."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.take()

    def take(self) -> bool:
        if self.fd is None:
            try:
                self.fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return False
        return True

    def release(self) -> bool:
        if self.fd is None:
            return False
        os.close(self.fd)
        self.fd = None
        return True

    def close(self) -> None:
        self.release()


def _shed_one(sock: trio.socket.SocketType, reserve: _Reserve, line: bytes) -> bool:
    """Accept one waiting connection with the reserve descriptor, answer ``line``, close it.

    Synchronous (no checkpoint between giving the spare descriptor up and accept(2)) and never
    waits: returns whether a connection was answered.
    """
    if not reserve.release():
        reserve.take()
        return False
    try:
        # a second socket object on the listener's descriptor (no new descriptor), for a
        # non-blocking accept(2) now
        view = _socket.socket(sock.family, sock.type, fileno=sock.fileno())
        try:
            view.setblocking(False)
            conn, _ = view.accept()
        except OSError:
            return False
        finally:
            view.detach()
        with conn:
            try:
                conn.setblocking(False)
                conn.send(line)  # a fresh connection's buffer is empty: a short line fits
            except OSError:
                pass
        return True
    finally:
        reserve.take()


async def accept_forever(
    listener: trio.SocketListener,
    start: Callable[[trio.SocketStream], None],
    *,
    rl: RateLimitedLog,
    what: str,
    shed_line: Callable[[int], bytes] | None = None,
    backoff: float = ACCEPT_BACKOFF,
) -> None:
    """Accept connections and hand each to ``start`` until the listener is closed.

    On EMFILE, ENFILE, ENOMEM or ENOBUFS it logs (rate-limited) and tries again after
    ``backoff`` seconds, as :func:`trio.serve_listeners` does; with ``shed_line`` (errno →
    one line) a connection waiting during EMFILE/ENFILE is answered with that line and closed
    rather than left waiting. Any other ``OSError`` is raised: the caller restarts the loop.
    Returns once the listener's socket is closed.
    """
    reserve = _Reserve() if shed_line is not None else None
    failures = 0  # failed accepts since the last one that worked
    try:
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if listener.socket.fileno() == -1:
                    return
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                failures += 1
                shed = False
                if (
                    reserve is not None
                    and shed_line is not None
                    and exc.errno in (errno.EMFILE, errno.ENFILE)
                ):
                    shed = _shed_one(listener.socket, reserve, shed_line(exc.errno))
                rl.error(
                    (what, "accept", exc.errno),
                    "%s: accept failed: %s; %s", what, exhaustion_text(exc.errno),
                    "answered a new connection with resource_exhausted" if shed
                    else f"trying again in {backoff:g}s",
                )
                if not shed:
                    await trio.sleep(backoff)
                continue
            if failures:
                rl.log(logging.INFO, (what, "accept", "again"),
                       "%s: accepting connections again (after %d failed accepts)", what,
                       failures)
                failures = 0
            start(stream)
    finally:
        if reserve is not None:
            reserve.close()
