"""The async client: ``open_client`` (autostarting a supervisor if needed), on asyncio or Trio.

It runs on anyio: the same code serves a program under ``asyncio.run``, ``trio.run`` or
``anyio.run`` (either backend). The supervisor and workers are Trio programs of their own.

A :class:`Client` survives its supervisor: when the connection is lost (the supervisor was
killed, restarted or replaced) a request reconnects — autostarting a supervisor if needed —
with capped backoff for up to ``RETRY_FOR`` seconds from the loss and resends the command with
the *same* ``(client_id, id)``; the worker's journal answers a resend of a command that already
ran, so nothing runs twice.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import inspect
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from ._aio import (
    Inbox,
    MessageStream,
    NativeEvent,
    Silence,
    backend,
    connect_unix,
    native,
    raw_socket,
    watch,
)
from ._autostart import is_older, is_ours
from ._defaults import AUTOSTART_HELPER_MARGIN, CLOSE_TIMEOUT, RESEND_DELAY, RESEND_DELAY_MAX
from ._defaults import GRANT_MARGIN as _GRANT_MARGIN
from ._errors import AgentdError, ErrorCode, not_accepting, single_errors
from ._paths import Layout, check_socket_path
from ._protocol import (
    PROTOCOL_VERSION,
    Attach,
    AuthOk,
    Dropped,
    Event,
    Hello,
    Request,
    Response,
    WorkerHello,
    error_of,
)
from ._syncclient import CREATING_OPS, Output, _lease_holder, creator_args, version_mismatch
from ._syncconn import CONNECT_RETRY_PAUSE
from ._trust import isolated_python, prove_peer, prove_socket_dir
from ._wirerules import REROUTE as _REROUTE
from ._wirerules import RETRY_FOR as RETRY_FOR
from ._wirerules import RETRYABLE as _RETRYABLE
from ._wirerules import retry_deadline as _retry_deadline
from .timing import DEFAULT_TIMING, Timing

_EVENTS_BUFFERED = 8  # per request (chunks of up to 256 KiB: 2 MiB); a consumer that falls
# behind pauses the connection
_NO_RESEND = frozenset({"shutdown", "restart"})


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One turn's whole outcome, as :meth:`Client.prompt_turn` returns it."""

    session: str
    turn: int
    stdout: bytes
    """The reply, byte for byte."""
    stderr: bytes
    """The agent's diagnostics, kept apart from the reply."""
    exit_status: int | None
    """The agent's exit status (negative: killed by that signal); ``None`` for an agent that
    reports none (a Python agent that did not yield an ``ExitStatus``)."""


class _TaskStarter(Protocol):
    """Where the client starts its background tasks: an anyio task group (or a Trio nursery,
    on Trio)."""

    def start_soon(
        self, func: Callable[..., Coroutine[Any, Any, Any]], /, *args: Any, name: object = None
    ) -> object: ...


_Starter = Callable[[Callable[[], Coroutine[Any, Any, None]]], object]  # starts a task


class _Lost(Exception):
    """The connection ended before the response."""


class _Connection:
    """One connection and its reader task, routing responses and events by request id."""

    def __init__(
        self, ms: MessageStream, hello: Hello | None, *, route: dict[str, Any] | None = None
    ) -> None:
        self.ms = ms
        self.hello = hello  # None on a direct route to a worker
        self.route = route  # on a direct route: the route it was attached by
        self.pending: dict[int, Inbox[Response | Event]] = {}
        self.closed = False
        self.error: AgentdError | None = None  # why the reader stopped, if the peer broke it
        self.silence = Silence(native()[1])
        self.watchers = 0  # prompts outstanding that watch the peer's liveness
        self._watch_scope: anyio.CancelScope | None = None
        # no reader task: each request reads for all while it waits (see next_for); only
        # where an idle connection can tell that its peer closed it without reading
        self.leads = False
        self.reading = False  # a request reads for all now
        # a reader that gave up waiting on a silent peer: since when, for the request it
        # hands the reading to (so each of a chain of requests that give up before the
        # liveness interval does not start the silence over); None once nobody took it on
        self._silent_since: float | None = None
        self._successor: Inbox[Response | Event] | None = None  # handed the reading, not awake
        self._start_reader: _Starter | None = None

    async def run_reader(self) -> None:
        """Route responses and events by request id until the connection ends. A request
        whose consumer does not keep up stops this reader (bounded inbox, awaited): the peer's
        sends then block, and so does the agent behind them — backpressure, never a dropped
        chunk or an unbounded buffer."""
        try:
            await self._read(None)
        finally:
            self._end()
            await self.ms.aclose()

    async def next_for(self, inbox: Inbox[Response | Event]) -> Response | Event | None:
        """The next message of the request whose inbox is ``inbox``, or ``None`` at the end.

        On a connection that :attr:`leads` (no reader task), a request whose message is not
        there yet and that finds nobody reading reads for everyone until one comes for itself
        (or the end), then hands the reading to another request waiting, if any. So a lone
        request reads its own answer: no trip through the scheduler from a reader task to it.
        """
        while True:
            msg = inbox.take()
            if msg is not None or inbox.over:
                return msg
            if not self.leads:
                return await inbox.get()  # a reader task reads this connection
            if self.reading:
                try:
                    await inbox.wait()  # a message, the end, or a nudge: the reading is ours
                except BaseException:
                    # cancelled: a nudge that came meanwhile (the reading handed to us) goes on
                    inbox.unwait()
                    self._hand_over(inbox)
                    raise
                finally:
                    if self._successor is inbox:
                        self._successor = None
                continue
            self.reading = True
            self._successor = None  # (a request handed the reading may leave without it: this
            # reader hands over in turn when it is done)
            try:
                if not await self._read(inbox):
                    self._end()
                    await self.ms.aclose()
            finally:
                self.reading = False
                if self._start_reader is not None:  # (see read_for_the_gone)
                    if not self.closed:
                        self._start_reader(self.run_reader)
                    else:  # closed meanwhile: no reader will read; the requests waiting end
                        self._end()
                    self._start_reader = None
                self._hand_over(inbox)

    def _hand_over(self, inbox: Inbox[Response | Event]) -> None:
        """Nobody reads: wake another request waiting, to read (if the requests read). If
        none is, nobody waits on the peer any more: no silence is carried on."""
        if self.reading or not self.leads:
            return
        if self._successor is not None and self._successor is not inbox:
            return  # another request was handed the reading and is on its way to it
        self._successor = None
        for other in self.pending.values():
            if other is not inbox and other.nudge():
                self._successor = other
                return
        self._silent_since = None

    def read_for_the_gone(self, start: _Starter) -> None:
        """A request left before its answer (its caller gave up, its consumer stopped): what
        the worker still sends it must be read and dropped, whoever waits or not, or the turn
        stalls on a full socket. From now on a reader task reads this connection (``start``
        starts it, now or when the request reading now is done)."""
        if not self.leads or self.closed:
            return
        self.leads = False
        if self.reading:
            self._start_reader = start
        else:
            start(self.run_reader)
            for other in self.pending.values():
                other.nudge()  # (waiting for the reading: the reader's now)

    async def _read(self, inbox: Inbox[Response | Event] | None) -> bool:
        """Read and route messages until ``inbox`` holds one (``None``: for ever): ``True``;
        ``False`` once the connection ended (closed, broken, or a bad frame: :attr:`error`)."""
        since, self._silent_since = self._silent_since, None
        try:
            while inbox is None or not inbox.holding:
                self.silence.waiting(since)
                try:
                    msg = await self.ms.receive()
                except BaseException:
                    # cancelled: nobody waits on the peer now; a request the reading goes to
                    # next goes on counting from the same moment
                    self._silent_since = self.silence.waiting_since
                    self.silence.idle()
                    raise
                self.silence.arrived()
                since = None
                if msg is None:
                    return False
                if isinstance(msg, Response | Event) and isinstance(msg.id, int):
                    target = self.pending.get(msg.id)
                    # room in the inbox: no trip through the scheduler (a request that is
                    # gone drops it)
                    if target is not None and not target.offer(msg):
                        try:
                            await target.put(msg)
                        except BaseException:
                            target.force(msg)  # cancelled while waiting for room: kept
                            raise
            return True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        except AgentdError as exc:  # a malformed or oversized frame: fail the calls with it
            self.error = AgentdError(
                exc.code, f"the daemon sent a bad frame: {exc.message}", exc.details
            )
            return False

    def _end(self) -> None:
        """The connection is over: every pending request is told (the caller closes it), and
        its liveness watcher has nothing left to watch."""
        self.closed = True
        for inbox in self.pending.values():
            inbox.end()
        if self._watch_scope is not None:
            self._watch_scope.cancel()

    def idle_and_closed(self) -> bool:
        """A connection nobody reads whose peer closed it meanwhile (only one that
        :attr:`leads` can tell): marked closed, so that it is not used again."""
        if self.leads and not self.reading and not self.closed and self.ms.peer_closed():
            self.closed = True
        return self.closed

    def watch_from(
        self, nursery: _TaskStarter, ping: Callable[[], Request], timing: Timing,
        unresponsive: Callable[[], AgentdError], ping_timeout: float,
    ) -> None:
        """A request is outstanding (the caller counts it in ``watchers`` meanwhile): ping the
        peer after ``link_ping_interval`` of silence; if nothing arrives within
        ``ping_timeout`` of a ping, end the connection with ``unresponsive()`` (every pending
        request raises it).

        One watcher task serves the requests that follow each other on the connection: it
        ends when it wakes (at most ``link_ping_interval`` on) to find none outstanding, not
        at the end of each request, so back-to-back prompts spawn no task each, and make
        neither the ping nor the error unless they start a watcher."""
        if self._watch_scope is None:
            self._watch_scope = anyio.CancelScope()
            nursery.start_soon(self._watch, self._watch_scope, ping(), timing, unresponsive(),
                               ping_timeout)

    async def _watch(
        self, scope: anyio.CancelScope, ping: Request, timing: Timing, unresponsive: AgentdError,
        ping_timeout: float,
    ) -> None:
        with scope:
            try:
                at = await watch(self.silence, functools.partial(self.ms.send, ping),
                                 interval=timing.link_ping_interval, ping_timeout=ping_timeout,
                                 active=lambda: self.watchers > 0)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the connection ended anyway
            finally:
                if self._watch_scope is scope:
                    self._watch_scope = None
            if at is not None and not self.closed:
                self.error = unresponsive
                self.closed = True
                await self.ms.aclose()  # the reader ends: every pending request fails


class Client:
    """A session client; requests are multiplexed by id and resent across reconnects.

    Cancellation: cancelling a request stops waiting for it; the command may still run in its
    worker (it is journalled there and a resend with the same id returns its result).
    """

    def __init__(
        self, nursery: _TaskStarter, layout: Layout, timing: Timing, *, autostart: bool
    ) -> None:
        self._nursery = nursery
        self.layout = layout
        self.timing = timing
        self.autostart = autostart
        self.client_id = os.urandom(8).hex()
        self._ids = itertools.count(1)
        self._conn: _Connection | None = None
        self._connect_lock = anyio.Lock()
        self.reconnects = 0
        # the data plane: per session, the supervisor's route and a direct worker connection
        self._routes: dict[str, dict[str, Any]] = {}
        self._direct: dict[str, _Connection] = {}
        self._attach_lock = anyio.Lock()
        self.reroutes = 0
        self._event: Callable[[], NativeEvent]
        self._event, self._now = native()

    @property
    def hello(self) -> Hello:
        assert self._conn is not None
        assert self._conn.hello is not None
        return self._conn.hello

    async def _connection(self) -> _Connection:
        async with self._connect_lock:
            if self._conn is None or self._conn.closed:
                if self._conn is not None:
                    self.reconnects += 1
                self._conn = await _connect(self.layout, self.timing, autostart=self.autostart)
                self._nursery.start_soon(self._conn.run_reader)
            return self._conn

    async def _exchange_once(
        self,
        rid: int,
        op: str,
        args: dict[str, Any],
        on_event: Callable[[dict[str, Any]], Any] | None,
    ) -> Any:
        return await self._exchange_on(await self._connection(), rid, op, args, on_event)

    async def _exchange_on(
        self,
        conn: _Connection,
        rid: int,
        op: str,
        args: dict[str, Any],
        on_event: Callable[[dict[str, Any]], Any] | None,
    ) -> Any:
        conn.watchers += 1
        try:
            if conn.route is not None and op == "prompt":
                # a direct route: a worker that answers nothing, not even a ping, fails it
                route = conn.route
                conn.watch_from(self._nursery, self._ping, self.timing,
                                lambda: _unresponsive(route, self.timing),
                                self.timing.link_ping_timeout)
            else:
                # the supervisor: however long a command takes, it answers pings meanwhile;
                # one stopped or blocked after its hello fails the request after the client's
                # patience
                conn.watch_from(self._nursery, self._ping, self.timing,
                                lambda: _supervisor_unresponsive(self.layout.socket, self.timing),
                                self.timing.patience)
            return await self._exchange_unwatched(conn, rid, op, args, on_event)
        finally:
            conn.watchers -= 1

    def _ping(self) -> Request:
        return Request(id=next(self._ids), op="ping", client_id=self.client_id)

    async def _exchange_unwatched(
        self,
        conn: _Connection,
        rid: int,
        op: str,
        args: dict[str, Any],
        on_event: Callable[[dict[str, Any]], Any] | None,
    ) -> Any:
        inbox: Inbox[Response | Event] = Inbox(_EVENTS_BUFFERED, self._event)
        answered = False
        conn.pending[rid] = inbox
        try:
            if conn.closed:  # the reader ended before this request was pending
                inbox.end()
            try:
                await conn.ms.send(Request(id=rid, op=op, client_id=self.client_id, args=args))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise _Lost("send failed") from None
            while (msg := await conn.next_for(inbox)) is not None:
                if isinstance(msg, Event):
                    if on_event is not None:
                        handled = on_event(msg.event)
                        if inspect.isawaitable(handled):
                            await handled  # an async sink: its pace is the reader's
                    continue
                answered = True
                if msg.ok:
                    return msg.result
                raise error_of(msg)
            if conn.error is not None:
                raise conn.error
            raise _Lost("the connection closed before the response")
        except BaseException:
            if not answered and not inbox.ended:  # gone before its answer: the rest comes
                conn.read_for_the_gone(self._nursery.start_soon)
            raise
        finally:
            conn.pending.pop(rid, None)
            inbox.abandon()  # a reader blocked on this request's inbox goes on

    async def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        on_event: Callable[[dict[str, Any]], Any] | None = None,
    ) -> Any:
        """Send one command and return its result (events go to ``on_event``).

        A lost connection is retried as the module docstring says; events are relayed only
        from the first attempt.

        Raises:
            AgentdError: the command failed (its wire code), or no supervisor could be reached
                again within ``RETRY_FOR`` seconds.
        """
        rid = next(self._ids)
        args = args or {}
        if op == "prompt":
            # the cwd and environment go with the route request only (a new session starts
            # with them), not with every prompt: copying the environment is most of a
            # prompt's client-side cost
            return await self._prompt_direct(rid, args, on_event)
        if op in CREATING_OPS:
            args = creator_args(args)
        return await self._request_supervisor(rid, op, args, on_event)

    async def _request_supervisor(
        self,
        rid: int,
        op: str,
        args: dict[str, Any],
        on_event: Callable[[dict[str, Any]], Any] | None,
    ) -> Any:
        budget = 0.0 if op in _NO_RESEND else RETRY_FOR
        deadline: float | None = None  # opened by the first loss (see _retry_deadline)
        delay = RESEND_DELAY
        while True:
            try:
                return await self._exchange_once(
                    rid, op, args, on_event
                )
            except _Lost as exc:
                error: Exception = exc
            except AgentdError as exc:
                if exc.code not in _RETRYABLE or exc.details.get("wedged") or (
                    exc.details.get("startup")
                ):
                    raise
                error = exc
            now = anyio.current_time()
            deadline = _retry_deadline(deadline, now, budget)
            if now + delay > deadline:
                raise AgentdError(
                    ErrorCode.DAEMON_UNAVAILABLE,
                    f"lost the supervisor on {self.layout.socket} ({error}) and could not reach"
                    f" one again within {budget:g}s",
                ) from None
            await anyio.sleep(delay)
            delay = min(delay * 2, RESEND_DELAY_MAX)

    # the data plane ------------------------------------------------------------------------
    async def _prompt_direct(
        self, rid: int, args: dict[str, Any], on_event: Callable[[dict[str, Any]], Any] | None
    ) -> Any:
        """A prompt over the session's direct route, with the same command id on every try.

        The supervisor grants the route (creating or recovering the session); the prompt goes
        to the worker itself. When the route fails (worker gone, grant refused, a supervisor
        replaced, connection lost) the client asks the supervisor again and resends the same
        ``(client_id, id)``: the worker's journal runs it at most once.

        A worker that sends nothing for ``link_ping_interval`` is pinged; one that answers
        nothing within ``link_ping_timeout`` of the ping (stopped, its event loop blocked) fails
        the prompt with ``worker_unresponsive`` — at most ``link_ping_interval +
        link_ping_timeout`` after its last sign of life. A turn that is merely silent goes on:
        its worker answers the pings. The command stays in the worker's journal: a resend with
        the same id later gets its result.
        """
        session = str(args.get("session") or "default")
        agent = args.get("agent")
        # output bytes come raw after each chunk's frame, not base64 in it
        worker_args = {"text": args.get("text"), "stream": args.get("stream", True) is not False,
                       "raw": True}
        deadline: float | None = None  # opened by the first loss (see _retry_deadline)
        delay = RESEND_DELAY
        fresh = False
        while True:
            route = await self._route(session, args, agent, fresh=fresh)
            try:
                conn = await self._attached(session, route)
                return await self._exchange_on(
                    conn, rid, "prompt", worker_args, on_event
                )
            except _Lost as exc:
                error: Exception = exc
            except AgentdError as exc:
                if exc.code == ErrorCode.WORKER_UNRESPONSIVE:
                    self._forget_route(session)  # the next prompt asks the supervisor again
                    raise
                if exc.code not in _REROUTE:
                    raise
                error = exc
            self._forget_route(session)
            self.reroutes += 1
            now = self._now()
            deadline = _retry_deadline(deadline, now, RETRY_FOR)
            if now + delay > deadline:
                raise AgentdError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"session {session}: its worker could not be reached again within"
                    f" {RETRY_FOR:g}s ({error})",
                ) from None
            await anyio.sleep(delay)
            delay = min(delay * 2, RESEND_DELAY_MAX)
            fresh = True

    async def _route(
        self, session: str, args: dict[str, Any], agent: Any, *, fresh: bool
    ) -> dict[str, Any]:
        route = self._routes.get(session)
        if (
            fresh
            or route is None
            or (agent is not None and agent != route.get("agent"))
            or float(route.get("expires", 0)) - _GRANT_MARGIN < time.time()
        ):
            creator = creator_args(args)
            route_args: dict[str, Any] = {
                k: creator[k] for k in ("session", "agent", "cwd", "env") if k in creator
            }
            if fresh:
                route_args["resend"] = True  # a command already sent: not into a new session
            route = dict(await self._request_supervisor(
                next(self._ids), "route", {**route_args, "session": session}, None
            ))
            self._routes[session] = route
        return route

    async def _attached(self, session: str, route: dict[str, Any]) -> _Connection:
        conn = self._direct.get(session)
        if conn is not None and not conn.idle_and_closed():
            return conn  # attached already: no lock (and no trip through the scheduler)
        async with self._attach_lock:
            conn = self._direct.get(session)
            if conn is None or conn.idle_and_closed():
                if conn is not None and conn.leads:
                    self._nursery.start_soon(conn.ms.aclose)  # (no reader closed it)
                conn = await _attach(route, self.timing)
                self._direct[session] = conn
                self._read_direct(conn)
            return conn

    def _read_direct(self, conn: _Connection) -> None:
        """How a direct connection is read: by the requests waiting on it (it :attr:`leads`)
        where an idle one can tell that its worker closed it; else by a reader task."""
        conn.leads = conn.ms.can_tell_closed
        if not conn.leads:
            self._nursery.start_soon(conn.run_reader)

    def _forget_route(self, session: str) -> None:
        self._routes.pop(session, None)
        conn = self._direct.pop(session, None)
        if conn is not None:
            conn.closed = True
            self._nursery.start_soon(conn.ms.aclose)

    async def prompt(self, session: str, text: str, *, agent: str | None = None) -> str:
        """Send a prompt and return the whole reply (bytes that are not UTF-8 are replaced)."""
        return (await self.prompt_bytes(session, text, agent=agent)).decode(errors="replace")

    async def prompt_bytes(self, session: str, text: str, *, agent: str | None = None) -> bytes:
        """Send a prompt and return the whole output, byte for byte."""
        parts: list[bytes] = []
        output = Output(parts.append)
        result = await self.request(
            "prompt", {"session": session, "text": text, "agent": agent, "stream": False},
            on_event=output.on_event,
        )
        output.finish(result)
        return b"".join(parts)

    async def prompt_turn(
        self, session: str, text: str, *, agent: str | None = None
    ) -> TurnResult:
        """Send a prompt and return its whole outcome: reply, stderr and exit status. A
        non-zero exit status is an outcome, not an error."""
        out: list[bytes] = []
        err: list[bytes] = []
        output = Output(out.append, err.append)
        result = await self.request(
            "prompt", {"session": session, "text": text, "agent": agent, "stream": False},
            on_event=output.on_event,
        )
        output.finish(result)
        status = result.get("exit_status") if isinstance(result, dict) else None
        return TurnResult(
            session=str(result.get("session", session)) if isinstance(result, dict) else session,
            turn=int(result.get("turn", 0)) if isinstance(result, dict) else 0,
            stdout=b"".join(out),
            stderr=b"".join(err),
            exit_status=status if isinstance(status, int) else None,
        )

    async def stream_prompt(
        self, session: str, text: str, *, agent: str | None = None
    ) -> AsyncIterator[str]:
        """Yield the reply's text as the agent produces it (see :meth:`stream_prompt_bytes`)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        async for data in self.stream_prompt_bytes(session, text, agent=agent):
            if piece := decoder.decode(data):
                yield piece
        if tail := decoder.decode(b"", final=True):
            yield tail

    async def stream_prompt_bytes(
        self, session: str, text: str, *, agent: str | None = None
    ) -> AsyncIterator[bytes]:
        """Yield the reply's bytes as the agent produces them, each exactly once, even across
        a resend after a lost connection. (The agent's stderr and exit status are not part of
        the reply: :meth:`prompt_turn` returns them.)

        Backpressure: a consumer that stops iterating stops this client reading, and so the
        worker sending, and so the agent (its pipe fills): nothing is dropped or buffered
        without bound. A consumer that closes the iterator (``aclose``, ``contextlib.aclosing``)
        lets go of the prompt: the rest of its output is read and dropped, so other prompts to
        the session are not held up behind it (the turn goes on in its worker).

        Raises:
            AgentdError: the prompt failed (its wire code) or no supervisor could be reached.

        Cancellation: stops reading; the prompt still completes in its worker (it runs in
        the client's own nursery, not in this generator).
        """
        send, recv = anyio.create_memory_object_stream[bytes](_EVENTS_BUFFERED)
        failure: list[AgentdError] = []

        async def run() -> None:
            async with send:
                pending: list[bytes] = []
                output = Output(pending.append)

                async def on_event(event: dict[str, Any]) -> None:
                    output.on_event(event)
                    while pending:
                        await send.send(pending.pop(0))

                try:
                    result = await self.request(
                        "prompt", {"session": session, "text": text, "agent": agent},
                        on_event=on_event,
                    )
                    output.finish(result)
                    for data in pending:
                        await send.send(data)
                except AgentdError as exc:
                    failure.append(exc)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # the consumer went away

        self._nursery.start_soon(run)
        try:
            async for piece in recv:
                yield piece
        finally:
            recv.close()  # a consumer that stopped early: the prompt's task goes on
        if failure:
            raise failure[0]

    async def cancel(self, session: str) -> bool:
        """Cancel the turn ``session`` is running (its processes get SIGINT, then TERM and KILL
        after the stop grace); ``True`` once it ended, ``False`` if none was running. The
        prompt that ran it fails with ``command_cancelled``."""
        result = await self.request("cancel", {"session": session})
        return bool(isinstance(result, dict) and result.get("cancelled"))

    async def sessions(self) -> list[dict[str, Any]]:
        return list(await self.request("sessions"))

    async def status(self) -> dict[str, Any]:
        return dict(await self.request("status"))


def _supervisor_unresponsive(socket: str, timing: Timing) -> AgentdError:
    return AgentdError(
        ErrorCode.DAEMON_UNAVAILABLE,
        f"the supervisor on {socket} answers nothing, not even a ping within"
        f" {timing.patience:g}s (stopped, or its event loop is blocked) — run"
        ' "trio-agentd doctor --fix"',
        {"wedged": True},
    )


def _unresponsive(route: dict[str, Any], timing: Timing) -> AgentdError:
    session = route.get("session")
    return AgentdError(
        ErrorCode.WORKER_UNRESPONSIVE,
        f"session {session}: its worker (pid {route.get('worker_pid')}) answers nothing, not"
        f" even a ping within {timing.link_ping_timeout:g}s (stopped, or its event loop is"
        " blocked) — send the prompt again later (the same id gets its result if it ran)",
        {"session": session, "pid": route.get("worker_pid")},
    )


async def _attach(route: dict[str, Any], timing: Timing) -> _Connection:
    """Connect to a session's worker and present the supervisor's grant.

    Raises:
        AgentdError: ``worker_unavailable`` (nobody there, or someone else's pid answered),
            ``grant_refused``, or ``permission_denied`` when the socket is not proven ours.
    """
    path = str(route["worker_socket"])
    try:
        prove_socket_dir(os.path.dirname(path))
    except AgentdError as exc:
        if exc.code != ErrorCode.DAEMON_UNAVAILABLE:
            raise
        raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, exc.message) from None
    try:
        with anyio.fail_after(timing.connect_timeout):
            stream = await connect_unix(path)
    except OSError as exc:  # (a TimeoutError too)
        raise AgentdError(
            ErrorCode.WORKER_UNAVAILABLE, f"cannot reach the worker at {path}: {exc or 'timeout'}"
        ) from None
    ms = MessageStream(stream)
    try:
        prove_peer(raw_socket(stream), path)
    except BaseException:
        await ms.aclose()
        raise
    try:
        with anyio.fail_after(timing.hello_timeout):
            hello = await ms.receive()
            if not isinstance(hello, WorkerHello) or hello.pid != route.get("worker_pid"):
                raise AgentdError(ErrorCode.WORKER_UNAVAILABLE,
                                  f"{path} is not the worker the route named")
            await ms.send(Attach(grant=str(route["grant"])))
            reply = await ms.receive()
        if isinstance(reply, Dropped):
            raise AgentdError(reply.code, reply.message)
        if not isinstance(reply, AuthOk):
            raise AgentdError(
                ErrorCode.WORKER_UNAVAILABLE, f"the worker at {path} did not admit us"
            )
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):  # (TimeoutError)
        await ms.aclose()
        raise AgentdError(
            ErrorCode.WORKER_UNAVAILABLE, f"the worker at {path} did not answer"
        ) from None
    except BaseException:
        await ms.aclose()
        raise
    return _Connection(ms, None, route=route)


async def _probe(layout: Layout, timing: Timing) -> tuple[MessageStream, Hello] | None:
    try:
        prove_socket_dir(layout.socket_dir)
    except AgentdError as exc:
        if exc.code == ErrorCode.DAEMON_UNAVAILABLE:
            return None  # no socket dir: nobody listens
        raise
    start = time.monotonic()
    while True:
        try:
            with anyio.fail_after(timing.connect_timeout):
                stream = await connect_unix(layout.socket)
            break
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return None
        except (TimeoutError, BlockingIOError):
            # its backlog is full (EAGAIN at once, on a unix socket): a live supervisor that
            # is only busy gets patience, as for its hello; advice to repair only past
            # patience, or at once when nothing holds its lease
            waited = time.monotonic() - start
            if waited >= timing.patience or _lease_holder(layout) is None:
                raise not_accepting(layout.socket, waited) from None
        await anyio.sleep(min(CONNECT_RETRY_PAUSE, timing.patience - waited))
    waited = time.monotonic() - start
    ms = MessageStream(stream)
    wait = timing.hello_timeout  # (patience is one budget: connecting, then the hello)
    try:
        prove_peer(raw_socket(stream), layout.socket)
        while True:
            with anyio.move_on_after(wait) as scope:
                msg = await ms.receive()
            if not scope.cancelled_caught:
                break
            # a live supervisor that is only slow gets patience; a dead one does not
            waited += wait
            if waited >= timing.patience or _lease_holder(layout) is None:
                raise AgentdError(
                    ErrorCode.DAEMON_UNAVAILABLE,
                    f"the supervisor on {layout.socket} sent no hello within {round(waited, 1):g}s"
                    ' — run "trio-agentd doctor --fix"',
                    {"wedged": True},
                )
            wait = min(timing.patience_tick, timing.patience - waited)
    except (anyio.BrokenResourceError, OSError):
        await ms.aclose()
        return None
    except BaseException:
        await ms.aclose()
        raise
    if not isinstance(msg, Hello):
        await ms.aclose()
        if isinstance(msg, Response) and not msg.ok:
            raise error_of(msg)
        return None
    return ms, msg


async def _autostart(layout: Layout, timing: Timing, *, handover: bool = False) -> None:
    """Autostart through a helper process, so the daemon never becomes our (zombie) child.

    ``handover``: the helper hands an older supervisor over to one of this installation
    (``trio_agentd._autostart.hand_over``); what it says (busy sessions it waits for, or what
    to run) is logged as warnings of ``trio_agentd.client``.
    """
    import subprocess

    argv = [*isolated_python("trio_agentd._autostart"), "--socket", layout.socket,
            "--home", str(layout.home), "--registry", str(layout.registry)]
    bound = timing.startup_timeout + AUTOSTART_HELPER_MARGIN
    if handover:
        from ._defaults import HANDOVER_EXIT_GRACE

        argv += ["--handover", "--handover-wait", repr(timing.handover_wait)]
        bound += timing.handover_wait + HANDOVER_EXIT_GRACE
    with anyio.move_on_after(bound) as scope:
        done = await anyio.run_process(argv, check=False, stdin=subprocess.DEVNULL, cwd="/")
    if scope.cancelled_caught:
        from ._autostart import startup_timeout

        raise startup_timeout(layout, timing.startup_timeout)
    said = done.stderr.decode(errors="replace").strip()
    if done.returncode != 0:
        code = ErrorCode.VERSION_MISMATCH if handover and "trio-agentd restart" in said else (
            ErrorCode.DAEMON_UNAVAILABLE)
        raise AgentdError(code, said or "autostart failed", {"startup": True})
    if said:
        import logging

        for line in said.splitlines():
            logging.getLogger("trio_agentd.client").warning("%s", line)


async def _connect(layout: Layout, timing: Timing, *, autostart: bool) -> _Connection:
    got = await _probe(layout, timing)
    if got is None and autostart:
        await _autostart(layout, timing)
        got = await _probe(layout, timing)
    if got is None:
        raise AgentdError(ErrorCode.DAEMON_UNAVAILABLE, f"no supervisor on {layout.socket}")
    ms, hello = got
    seen = {"protocol": hello.protocol, "app_version": hello.app_version}
    if autostart and not is_ours(seen) and is_older(seen):
        # an upgrade: the older supervisor is handed over to one of this installation
        await ms.aclose()
        await _autostart(layout, timing, handover=True)
        got = await _probe(layout, timing)
        if got is None:
            raise AgentdError(ErrorCode.DAEMON_UNAVAILABLE, f"no supervisor on {layout.socket}")
        ms, hello = got
    if hello.protocol != PROTOCOL_VERSION:
        await ms.aclose()
        raise version_mismatch(
            layout, {"protocol": hello.protocol, "app_version": hello.app_version}
        )
    try:
        layout.check_served_home(hello.home)
    except AgentdError:
        await ms.aclose()
        raise
    return _Connection(ms, hello)


@contextlib.asynccontextmanager
async def open_client(
    socket: str | None = None,
    *,
    home: str | None = None,
    registry: str | None = None,
    autostart: bool = True,
    timing: Timing = DEFAULT_TIMING,
) -> AsyncIterator[Client]:
    """Connect to the supervisor on ``socket`` (default: the per-user socket, see
    ``Layout.resolve``), autostarting one if needed.

    Raises:
        AgentdError: ``daemon_unavailable`` (with the exit code and log tail if an autostarted
            supervisor died), ``version_mismatch``.

    Runs on asyncio and on Trio (``asyncio.run``, ``trio.run``, ``anyio.run`` with either
    backend); anywhere else, or outside an event loop, it raises ``AgentdError`` (``config``)
    at once, saying so.

    Cancellation: the connection is closed; a supervisor autostarted for us keeps running.
    """
    backend()
    layout = Layout.resolve(socket=socket, home=home, registry=registry, home_flag="home=")
    check_socket_path(layout.socket)
    first = await _connect(layout, timing, autostart=autostart)
    with single_errors():
        async with anyio.create_task_group() as tasks:
            client = Client(tasks, layout, timing, autostart=autostart)
            client._conn = first
            tasks.start_soon(first.run_reader)
            try:
                yield client
            finally:
                tasks.cancel_scope.cancel()
                # (the direct connections that lead have no reader task to close them)
                conns = [*client._direct.values(), client._conn]
                with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
                    for conn in conns:
                        if conn is not None:
                            await conn.ms.aclose()
