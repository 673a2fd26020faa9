"""Telling a service manager how the supervisor is doing: the ``sd_notify`` protocol.

When the supervisor runs under systemd with ``Type=notify`` the manager sets ``NOTIFY_SOCKET``
(an AF_UNIX datagram socket: a path, or ``@name`` for an abstract one) and, with
``WatchdogSec=``, ``WATCHDOG_USEC`` (and maybe ``WATCHDOG_PID``). The protocol is one datagram
per message, of ``KEY=VALUE`` lines:

- ``READY=1`` once the supervisor serves (socket bound, ownership record written);
- ``STATUS=serving N sessions (M workers running)`` whenever that text changes;
- ``STOPPING=1`` when it begins to stop;
- ``WATCHDOG=1`` every ``WATCHDOG_USEC / 2``, sent only by the self-check loop after a check
  that proved the supervisor healthy (its record current, its socket intact): a wedged
  supervisor stops pinging and the manager restarts it.

The variables are read once and removed from the environment, so neither workers nor a
successor supervisor inherit them. A failure to notify is logged once and never fatal.

The decisions (:func:`notify_address`, :func:`watchdog_interval`, :class:`WatchdogSchedule`,
:func:`status_text`) are pure; :class:`Notifier` is the thin I/O shell (trio datagram socket).
"""

from __future__ import annotations

import logging
import os
import socket as _socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Final

import trio

from .timing import SD_NOTIFY_TIMEOUT

log = logging.getLogger("trio_agentd.supervisor")

NOTIFY_ENV: Final = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def notify_address(value: str) -> str:
    """The ``sendto`` address for a ``NOTIFY_SOCKET`` value: an absolute path as it is, ``@name``
    as the abstract address ``\\0name``.

    Raises:
        ValueError: anything else (a relative path, ``vsock:``…), naming the value.
    """
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    raise ValueError(
        f"NOTIFY_SOCKET={value!r} is neither an absolute path nor an abstract socket (@name)"
    )


_USEC_INFINITY: Final = 2**64 - 1  # systemd's "no limit"; never a watchdog period


def _decimal(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _shown(value: str) -> str:
    """A variable's value for a log line: quoted, and cut short past 40 characters."""
    return repr(value) if len(value) <= 40 else f"{value[:40]!r}… ({len(value)} characters)"


def watchdog_interval(usec: str | None, wd_pid: str | None, pid: int) -> float | None:
    """How often to send ``WATCHDOG=1`` (seconds): half of ``WATCHDOG_USEC``; ``None`` when
    there is no watchdog, or it is meant for another process (``WATCHDOG_PID``).

    Raises:
        ValueError: a ``WATCHDOG_USEC`` or ``WATCHDOG_PID`` that is not a positive integer.
    """
    if not usec:
        return None
    # ASCII digits only ('²'.isdigit() is true), and no more than systemd's usec_t holds (a
    # longer number would overflow the float division)
    if not _decimal(usec) or len(usec) > 20 or not 0 < int(usec) < _USEC_INFINITY:
        raise ValueError(f"WATCHDOG_USEC={_shown(usec)} is not a positive number of"
                         f" microseconds below 2^64")
    if wd_pid:
        if not _decimal(wd_pid) or len(wd_pid) > 19:
            raise ValueError(f"WATCHDOG_PID={_shown(wd_pid)} is not a process id")
        if int(wd_pid) != pid:
            return None
    return int(usec) / 2 / 1_000_000


def status_text(sessions: int, running: int) -> str:
    """The ``STATUS=`` line: what ``systemctl --user status`` shows."""
    noun = "session" if sessions == 1 else "sessions"
    workers = "worker" if running == 1 else "workers"
    return f"serving {sessions} {noun} ({running} {workers} running)"


class WatchdogSchedule:
    """When the next ``WATCHDOG=1`` is due: ``interval`` after the last one (or after
    :meth:`start`). Pure: the caller passes the time."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._next: float | None = None

    def start(self, now: float) -> None:
        self._next = now + self.interval

    def due(self, now: float) -> bool:
        return self._next is not None and now >= self._next

    def sent(self, now: float) -> None:
        self._next = now + self.interval


Sender = Callable[[bytes], Awaitable[None]]


class Notifier:
    """Sends ``sd_notify`` messages to ``address``; ``address`` None sends nothing (and
    ``watchdog`` is then None too).

    Args:
        sender: replaces the datagram socket (tests record what would be sent, on MockClock).
    """

    def __init__(
        self, address: str | None, *, watchdog: float | None = None, sender: Sender | None = None
    ) -> None:
        self.address = address
        self.watchdog = WatchdogSchedule(watchdog) if watchdog and address else None
        self._sender = sender
        self._sock: trio.socket.SocketType | None = None
        self._last_status: str | None = None
        self._stopping = False  # then the stopping STATUS stays: no "serving …" over it
        self._failed = 0  # failures since the first one was logged
        # one datagram at a time: two tasks waiting on a full socket at once (the self-check's
        # WATCHDOG and the shutdown's STOPPING) would be trio's BusyResourceError
        self._sending = trio.StrictFIFOLock()

    @property
    def enabled(self) -> bool:
        return self.address is not None or self._sender is not None

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str], pid: int | None = None) -> Notifier:
        """A notifier for ``NOTIFY_SOCKET`` / ``WATCHDOG_USEC`` / ``WATCHDOG_PID``, which are
        removed from ``environ`` (children must not inherit them). A bad value is logged once
        and that part is off."""
        raw = {k: environ.pop(k, None) for k in NOTIFY_ENV}
        address: str | None = None
        if raw["NOTIFY_SOCKET"]:
            try:
                address = notify_address(raw["NOTIFY_SOCKET"])
            except ValueError as exc:
                log.warning("sd_notify: %s; not notifying the service manager", exc)
        interval: float | None = None
        try:
            interval = watchdog_interval(raw["WATCHDOG_USEC"], raw["WATCHDOG_PID"],
                                         os.getpid() if pid is None else pid)
        except ValueError as exc:
            log.warning("sd_notify: %s; no watchdog pings", exc)
        if interval is not None and address is None:
            log.warning("sd_notify: WATCHDOG_USEC is set but NOTIFY_SOCKET is not; no watchdog"
                        " pings")
        return cls(address, watchdog=interval)

    async def send(self, *fields: str) -> None:
        """Send ``fields`` (``KEY=VALUE`` each) as one datagram. Never raises: the first
        failure is logged, later ones are only counted (and logged at debug level)."""
        if not self.enabled:
            return
        data = "\n".join(fields).encode()
        try:
            with trio.fail_after(SD_NOTIFY_TIMEOUT):  # the wait for the lock included
                async with self._sending:
                    await self._deliver(data)
        except (OSError, trio.TooSlowError) as exc:
            self._failed += 1
            why = "timed out" if isinstance(exc, trio.TooSlowError) else str(exc)
            if self._failed == 1:
                log.warning("sd_notify to %s failed (%s): the service manager may not see"
                            " this supervisor's state; further failures are not logged",
                            self._shown(), why)
            else:
                log.debug("sd_notify failed again (%d failures): %s", self._failed, why)

    async def _deliver(self, data: bytes) -> None:
        if self._sender is not None:
            await self._sender(data)
        else:
            await self._send_datagram(data)

    async def _send_datagram(self, data: bytes) -> None:
        assert self.address is not None
        if self._sock is None:
            self._sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
        await self._sock.sendto(data, self.address)

    def _shown(self) -> str:
        a = self.address or "?"
        return "@" + a[1:] if a.startswith("\0") else a

    async def ready(self, status: str) -> None:
        self._last_status = status
        if self.watchdog is not None:
            self.watchdog.start(trio.current_time())
        await self.send("READY=1", f"STATUS={status}")

    async def status(self, text: str) -> None:
        """``STATUS=text`` if it differs from the last one sent (none once stopping)."""
        if text != self._last_status and not self._stopping:
            self._last_status = text
            await self.send(f"STATUS={text}")

    async def stopping(self, status: str) -> None:
        self._last_status = status
        self._stopping = True
        await self.send("STOPPING=1", f"STATUS={status}")

    async def healthy(self) -> None:
        """The supervisor just proved itself healthy: ``WATCHDOG=1`` if one is due."""
        wd = self.watchdog
        now = trio.current_time()
        if wd is not None and wd.due(now):
            wd.sent(now)
            await self.send("WATCHDOG=1")

    def check_period(self, self_check_interval: float) -> float:
        """How often the self-check must run for the pings to be on time."""
        if self.watchdog is None:
            return self_check_interval
        return min(self_check_interval, self.watchdog.interval)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
