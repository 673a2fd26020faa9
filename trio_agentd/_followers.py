"""Who follows a session's turns live (``logs -f``): bounded per-follower queues that a turn
pushes to without ever waiting.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import trio

from ._defaults import FOLLOW_MAX_BYTES


class _Follower:
    """One ``logs -f`` subscriber: the events it has not been sent yet, at most ``max_bytes``
    of output. Pushing never waits: one that falls further behind is let go (``dropped``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.size = 0
        self.dropped = False
        self.ready = trio.Event()

    def push(self, event: dict[str, Any], size: int = 0) -> None:
        if self.dropped:
            return
        if self.size and self.size + size > self.max_bytes:  # (one piece always fits)
            self.dropped = True
            self.queue.clear()
            self.size = 0
        else:
            self.queue.append(event)
            self.size += size
        self.ready.set()

    async def next(self) -> tuple[dict[str, Any], int] | None:
        """The next event and its size; ``None`` once dropped."""
        while not self.queue and not self.dropped:
            await self.ready.wait()
            self.ready = trio.Event()
        if self.dropped:
            return None
        event = self.queue.popleft()
        size = len(event["data"]) if event.get("kind") == "chunk" else 0
        return event, size

    def done(self, size: int) -> None:
        """``size`` bytes of output were sent on: room for as many more."""
        self.size -= size


class Followers:
    """Who follows the session's turns as they stream (``follow``), and the turn they see.

    The turn calls :meth:`chunk` for every piece of output and the worker :meth:`turn_done`
    at each turn's end; both only append to bounded queues (see :class:`_Follower`).
    """

    def __init__(self, max_bytes: int = FOLLOW_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.all: set[_Follower] = set()
        self.current: dict[str, Any] | None = None  # the streaming turn's start event

    def add(self) -> _Follower:
        follower = _Follower(self.max_bytes)
        self.all.add(follower)
        return follower

    def remove(self, follower: _Follower) -> None:
        self.all.discard(follower)

    def _push(self, event: dict[str, Any], size: int = 0) -> None:
        for follower in self.all:
            follower.push(event, size)

    def chunk(self, command: list[Any], turn: int, prompt: Callable[[], str | None], at: int,
              data: bytes) -> None:
        if self.current is None or self.current["command"] != command:
            self.current = {"kind": "turn_started", "turn": turn, "command": command,
                            "prompt": prompt()}
            self._push(self.current)
        if not self.all:
            return
        self._push({"kind": "chunk", "turn": turn, "command": command, "at": at,
                    "data": data}, len(data))

    def turn_done(self, turns: int) -> None:
        self.current = None
        self._push({"kind": "turn_done", "turns": turns})
