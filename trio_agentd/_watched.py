"""A value tasks wait on, small enough to keep a few per session.

``trio_util.AsyncValue`` keeps three dictionaries per value from its start (its waiters
grouped by predicate, its transforms), about 1.5 KB even while nobody waits; a supervisor
keeps two values per session, thousands of sessions. :class:`WatchedValue` has the part of
its interface the sessions use (``value``, ``wait_value``, ``wait_transition``, with the same
meaning) and costs two slots while nobody waits: a waiter's record exists only while it waits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar, overload

import trio

T = TypeVar("T")


class _Waiter(Generic[T]):
    __slots__ = ("event", "predicate", "result")

    def __init__(self, predicate: Callable[[T, T], bool]) -> None:
        self.predicate = predicate
        self.event = trio.Event()
        self.result: tuple[T, T] | None = None  # (new, old): the change that woke it


class WatchedValue(Generic[T]):
    """A value; tasks wait for it to match (:meth:`wait_value`) or to change
    (:meth:`wait_transition`). Setting an equal value changes nothing and wakes nobody.

    A waiter is woken by the assignment that matched it, with that value, even if the value
    has moved on before the waiter runs (as ``trio_util.AsyncValue``'s).
    """

    __slots__ = ("_value", "_waiters")

    def __init__(self, value: T) -> None:
        self._value = value
        self._waiters: list[_Waiter[T]] | None = None  # None while nobody waits

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._value!r})"

    @property
    def value(self) -> T:
        return self._value

    @value.setter
    def value(self, new: T) -> None:
        if self._value == new:
            return
        old, self._value = self._value, new
        waiters = self._waiters
        if waiters is None:
            return
        waiting: list[_Waiter[T]] = []
        for w in waiters:
            if w.predicate(new, old):
                w.result = (new, old)
                w.event.set()
            else:
                waiting.append(w)
        self._waiters = waiting or None

    @overload
    async def wait_value(self, value_or_predicate: Callable[[T], bool]) -> T: ...
    @overload
    async def wait_value(self, value_or_predicate: T) -> T: ...
    async def wait_value(self, value_or_predicate: T | Callable[[T], bool]) -> T:
        """Return the value once ``predicate(value)`` holds (or it equals the value given): at
        once (after a checkpoint) if it holds now, else at the first assignment that makes it
        hold, with the value assigned then.

        Cancellation: nothing to undo; the wait is forgotten.
        """
        if callable(value_or_predicate):
            predicate: Callable[[T], bool] = value_or_predicate
        else:
            wanted = value_or_predicate

            def predicate(v: T) -> bool:
                return bool(v == wanted)

        if predicate(self._value):
            value = self._value
            await trio.lowlevel.checkpoint()
            return value
        new, _old = await self._wait(lambda new, _old: predicate(new))
        return new

    async def wait_transition(self) -> tuple[T, T]:
        """``(new, old)`` of the next change of the value.

        Cancellation: nothing to undo; the wait is forgotten.
        """
        return await self._wait(lambda _new, _old: True)

    async def _wait(self, predicate: Callable[[T, T], bool]) -> tuple[T, T]:
        w = _Waiter(predicate)
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(w)
        try:
            await w.event.wait()
        finally:
            if w.result is None and self._waiters is not None:  # cancelled: forget it
                self._waiters.remove(w)
                if not self._waiters:
                    self._waiters = None
        assert w.result is not None
        return w.result
