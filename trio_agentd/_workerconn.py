"""One connection to a worker: a supervisor's (authenticated by its claim) or a client's
direct route, and its paced turn notices.
"""

from __future__ import annotations

import contextlib
import math

import trio
from trio_util import AsyncValue

from ._fence import Fence
from ._protocol import (
    Notice,
)
from ._stream import MessageStream


class Conn:
    """A supervisor connection (``fence``: its claim), or a client's direct route (``direct``:
    admitted by a grant of the supervisor generation ``fence`` was for)."""

    def __init__(self, ms: MessageStream, fence: Fence, *, direct: bool = False,
                 notice_interval: float = 0.0) -> None:
        self.ms = ms
        self.fence = fence
        self.direct = direct
        self.notice_interval = notice_interval
        self.scope = trio.CancelScope()
        self.dropped = False
        # the newest turn notice not yet sent (notices coalesce: only the latest matters)
        self.notice: Notice | None = None
        self.notice_ready = trio.Event()
        self.in_flight = AsyncValue(0)  # requests being handled

    async def send_notices(self) -> None:
        """Send turn notices one at a time, never cancelled half-way through a frame (that
        would corrupt the stream): runs for the connection's life.

        Notices coalesce into the latest (only it matters) and are paced: two may go at once
        (a lone turn's ``turn_started`` and ``turn_done`` are never held), then one per
        ``notice_interval`` (a token bucket of two), so back-to-back prompts cost the
        supervisor a notice per interval instead of two per prompt, and its view of a busy
        session lags by at most that.
        """
        tokens, last = float(_NOTICE_BURST), -math.inf
        while True:
            await self.notice_ready.wait()
            self.notice_ready = trio.Event()
            if self.notice is None:
                continue  # sent already, by the hold below
            if self.notice_interval > 0:
                now = trio.current_time()
                tokens = min(float(_NOTICE_BURST), tokens + (now - last) / self.notice_interval)
                last = now
                if tokens < 1:
                    # notices that come meanwhile replace this one (nothing wakes this task
                    # for them): the latest goes when the hold ends
                    await trio.sleep(self.notice_interval - tokens * self.notice_interval)
                    tokens, last = 1.0, trio.current_time()
            else:
                tokens = float(_NOTICE_BURST)
            notice, self.notice = self.notice, None
            if notice is None:
                continue
            tokens -= 1
            if not self.dropped:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.ms.send(notice)


_NOTICE_BURST = 2  # notices that may go at once: a lone turn's start and end
