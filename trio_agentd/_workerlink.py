"""The supervisor's side of one authenticated worker connection.

A reader task routes each response (and the events before it) to the call that sent the request;
calls are multiplexed by a link-local request id. When the link drops, every pending call fails
with :class:`WorkerDropped` so the caller can reconnect and resend the *same* command id (the
worker's journal makes the resend safe).

A worker that stops answering (SIGSTOP, a blocked event loop) keeps the connection open, so
:meth:`WorkerLink.watch_liveness` pings it and closes the link as *unresponsive* when nothing
answers within ``link_ping_timeout`` of a ping (see :mod:`._liveness`): the handle then
recovers it as a worker that does not answer. While a call is outstanding or the worker runs a
turn (its notices say so) it is pinged after ``link_ping_interval`` of silence (counted from the
call's or turn's start at the earliest); an idle link only after ``link_idle_ping_interval``, so
idle sessions cost next to nothing, and :meth:`WorkerLink.probe` (a route granted to a client)
makes an idle link prove itself within ``link_ping_interval + link_ping_timeout``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio

from ._errors import AgentdError, ErrorCode
from ._liveness import Silence, watch
from ._protocol import Auth, AuthOk, Dropped, Event, Notice, Request, Response, WorkerHello
from ._stream import MessageStream

log = logging.getLogger("trio_agentd.supervisor")

EventSink = Callable[[dict[str, Any]], Awaitable[None]]
_BUFFERED = 16  # messages per call between the link's reader and the call


class WorkerDropped(Exception):
    """The link to a worker broke before the response arrived."""


class WorkerLink:
    def __init__(self, ms: MessageStream, hello: WorkerHello) -> None:
        self.ms = ms
        self.hello = hello
        self._ids = itertools.count(1)
        self._pending: dict[int, trio.MemorySendChannel[Response | Event]] = {}
        self.closed = trio.Event()
        self.drop_reason: str | None = None
        self.drop_code: str | None = None  # the code of the worker's ``dropped`` frame
        self.on_notice: Callable[[Notice], None] = lambda _n: None
        self.silence = Silence()
        # when the ping the worker never answered was sent (the link was closed for it)
        self.unresponsive: float | None = None
        self._on_close: set[trio.CancelScope] = set()  # see :meth:`cancelled_on_close`

    @contextlib.contextmanager
    def cancelled_on_close(self) -> Iterator[trio.CancelScope]:
        """A cancel scope that the link's end cancels (at once if it has ended): a wait for
        something else *or* the link's end, with no task and no nursery to wait on ``closed``
        (every live session waits so for its link's whole life: a task and a nursery each are
        kilobytes a session)."""
        scope = trio.CancelScope()
        if self.closed.is_set():
            scope.cancel()
        self._on_close.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._on_close.discard(scope)

    async def run_reader(self) -> None:
        """Route messages until the link ends; then fail every pending call."""
        try:
            while True:
                self.silence.waiting()
                msg = await self.ms.receive()
                self.silence.arrived()
                if msg is None:
                    break
                if isinstance(msg, Response | Event):
                    rid = msg.id
                    chan = self._pending.get(rid) if isinstance(rid, int) else None
                    if chan is not None:
                        # awaited: a client that reads slowly slows this link, the worker's
                        # sends and its agent; nothing is dropped, nothing grows
                        with contextlib.suppress(trio.BrokenResourceError):
                            await chan.send(msg)
                elif isinstance(msg, Notice):
                    self.silence.peer_busy(msg.kind == "turn_started")
                    self.on_notice(msg)
                elif isinstance(msg, Dropped):
                    self.drop_reason = msg.message
                    self.drop_code = msg.code
                    if msg.code != ErrorCode.WORKER_STOPPED:
                        log.warning("worker %s dropped us: %s", self.hello.session, msg.message)
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError, AgentdError):
            pass
        finally:
            self.closed.set()
            for scope in self._on_close:
                scope.cancel()
            for chan in self._pending.values():
                chan.close()
            self._pending.clear()
            await self.ms.aclose()

    async def call(
        self, op: str, args: dict[str, Any], *, client_id: str, on_event: EventSink | None = None
    ) -> Response:
        """Send one request and wait for its response, relaying its events.

        Raises:
            WorkerDropped: the link ended first.

        Cancellation: the request may still run in the worker (it is journalled there).
        """
        if self.closed.is_set():
            raise WorkerDropped(self.drop_reason or "link closed")
        rid = next(self._ids)
        send, recv = trio.open_memory_channel[Response | Event](_BUFFERED)
        self._pending[rid] = send
        self.silence.call_started()  # the busy ping pace, from now
        try:
            try:
                await self.ms.send(Request(id=rid, op=op, client_id=client_id, args=args))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise WorkerDropped(str(exc)) from None
            async for msg in recv:
                if isinstance(msg, Response):
                    return msg
                if on_event is not None:
                    await on_event(msg.event)
            raise WorkerDropped(self.drop_reason or "worker connection closed")
        finally:
            self.silence.call_ended()
            self._pending.pop(rid, None)
            recv.close()  # the reader, if blocked on this call's channel, goes on

    def probe(self) -> None:
        """A client is about to use the worker directly (it was granted a route): unless the
        worker says something within ``link_ping_interval`` (the client's prompt makes it send
        a notice), it is pinged then. So a route to a hung worker leads to ``recovering``
        within ``link_ping_interval + link_ping_timeout``, not the idle interval."""
        self.silence.probe()

    async def watch_liveness(
        self, *, interval: float, ping_timeout: float, idle_interval: float | None = None
    ) -> None:
        """Ping the worker whenever nothing has arrived from it for ``interval`` while a call
        is outstanding or it runs a turn (counted from the call's or turn's start at the
        earliest), or for ``idle_interval`` otherwise (``None``: ``interval`` always; a
        :meth:`probe` shortens it to ``interval``); if nothing arrives
        within ``ping_timeout`` of a ping, mark the link ``unresponsive`` and close it (every
        pending call fails with :class:`WorkerDropped`). Returns once the link closed.

        So a call waiting on a hung worker fails at most ``interval + ping_timeout`` after the
        later of its start and the worker's last sign of life, and an idle hung worker is
        found at most ``idle_interval + ping_timeout`` after its last sign of life.
        """
        async def ping() -> None:
            await self.ms.send(Request(id=next(self._ids), op="ping", client_id="supervisor"))

        at: float | None = None
        with (self.cancelled_on_close(),
              contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError)):
            at = await watch(self.silence, ping, interval=interval,
                             ping_timeout=ping_timeout, idle_interval=idle_interval)
        if at is None:
            return  # the link broke first: its reader fails the pending calls
        self.unresponsive = at
        self.drop_reason = f"the worker answered no ping within {ping_timeout:g}s"
        log.warning("worker %s (pid %s) is unresponsive: it answered no ping within %gs",
                    self.hello.session, self.hello.pid, ping_timeout)
        await self.ms.aclose()  # the reader ends and fails every pending call

    async def aclose(self) -> None:
        await self.ms.aclose()


async def link_over_stream(
    stream: trio.abc.Stream,
    *,
    token: str,
    generation: str,
    pid: int,
    start_id: str | None,
    socket: str,
) -> WorkerLink:
    """Authenticate to a worker over a connected stream (the caller bounds the time).

    Raises:
        AgentdError: ``worker_unavailable`` naming why.
    """
    ms = MessageStream(stream)
    try:
        hello = await ms.receive()
        if not isinstance(hello, WorkerHello):
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, "worker sent no hello")
        await ms.send(
            Auth(token=token, generation=generation, pid=pid, start_id=start_id, socket=socket)
        )
        reply = await ms.receive()
        if isinstance(reply, Dropped):
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, f"worker refused us: {reply.message}")
        if not isinstance(reply, AuthOk):
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, "worker did not confirm auth")
        return WorkerLink(ms, hello)
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        await ms.aclose()
        raise AgentdError(
            ErrorCode.WORKER_UNAVAILABLE, f"lost the worker during auth: {exc}"
        ) from None
    except AgentdError as exc:
        await ms.aclose()
        if exc.code == ErrorCode.WORKER_UNAVAILABLE:
            raise
        raise AgentdError(  # a malformed or oversized frame
            ErrorCode.WORKER_UNAVAILABLE, f"worker sent a bad frame during auth: {exc.message}"
        ) from None
    except BaseException:
        await ms.aclose()
        raise
