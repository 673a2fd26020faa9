"""Single-flight: concurrent callers share one run of an operation.

The operation runs in a long-lived service nursery, not in the first caller's task, so a
cancelled caller does not cancel it for everyone. Each flight has a fresh ``trio.Event`` and its
own result; a failure is re-raised to every waiter as a new error ``from`` the stored one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import trio

from ._errors import AgentdError, ErrorCode

T = TypeVar("T")


class _Flight(Generic[T]):
    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: T | None = None
        self.error: BaseException | None = None


class SingleFlight(Generic[T]):
    def __init__(self, nursery: trio.Nursery, operation: Callable[[], Awaitable[T]]) -> None:
        self._nursery = nursery
        self._operation = operation
        self._current: _Flight[T] | None = None

    async def run(self) -> T:
        """Join the flight in progress, or start one; return its result.

        Cancellation: the caller stops waiting; the flight goes on.
        """
        flight = self._current
        if flight is None:
            flight = self._current = _Flight()
            self._nursery.start_soon(self._fly, flight)
        await flight.done.wait()
        if flight.error is not None:
            raise AgentdError(ErrorCode.INTERNAL, f"shared operation failed: {flight.error}") from (
                flight.error
            )
        return flight.value  # type: ignore[return-value]

    async def _fly(self, flight: _Flight[T]) -> None:
        try:
            flight.value = await self._operation()
        except Exception as exc:
            flight.error = exc
        finally:
            self._current = None
            flight.done.set()
