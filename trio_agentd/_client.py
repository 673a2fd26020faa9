"""The async client for Trio programs: ``open_client`` (autostarting a supervisor if needed)."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket as _socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from ._errors import AgentdError, ErrorCode
from ._paths import Layout, check_socket_path
from ._protocol import PROTOCOL_VERSION, Event, Hello, Request, Response, error_of
from ._stream import MessageStream
from .timing import DEFAULT_TIMING, Timing


class Client:
    """A connection to the supervisor; requests are multiplexed by id.

    Cancellation: cancelling a request stops waiting for it; the command may still run in its
    worker (it is journalled there and a resend with the same id returns its result).
    """

    def __init__(self, ms: MessageStream, hello: Hello, layout: Layout) -> None:
        self._ms = ms
        self.hello = hello
        self.layout = layout
        self.client_id = os.urandom(8).hex()
        self._ids = itertools.count(1)
        self._pending: dict[int, trio.MemorySendChannel[Response | Event]] = {}
        self._closed = False

    async def _reader(self) -> None:
        try:
            while True:
                msg = await self._ms.receive()
                if msg is None:
                    break
                if isinstance(msg, Response | Event) and isinstance(msg.id, int):
                    chan = self._pending.get(msg.id)
                    if chan is not None:
                        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                            chan.send_nowait(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, AgentdError):
            pass
        finally:
            self._closed = True
            for chan in self._pending.values():
                chan.close()

    async def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        on_event: Callable[[dict[str, Any]], Any] | None = None,
    ) -> Any:
        """Send one command and return its result.

        Raises:
            AgentdError: the command failed (its wire code) or the connection was lost.
        """
        if self._closed:
            raise AgentdError(ErrorCode.DAEMON_UNAVAILABLE, "connection to the supervisor closed")
        rid = next(self._ids)
        send, recv = trio.open_memory_channel[Response | Event](1024)
        self._pending[rid] = send
        try:
            await self._ms.send(
                Request(id=rid, op=op, client_id=self.client_id, args=args or {})
            )
            async for msg in recv:
                if isinstance(msg, Event):
                    if on_event is not None:
                        on_event(msg.event)
                    continue
                if msg.ok:
                    return msg.result
                raise error_of(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._pending.pop(rid, None)
        raise AgentdError(ErrorCode.DAEMON_UNAVAILABLE, "the supervisor closed the connection")

    async def prompt(self, session: str, text: str, *, agent: str | None = None) -> str:
        """Send a prompt and return the whole reply."""
        result = await self.request(
            "prompt", {"session": session, "text": text, "agent": agent, "stream": False}
        )
        return str(result.get("reply", "")) if isinstance(result, dict) else str(result)

    async def stream_prompt(
        self, session: str, text: str, *, agent: str | None = None
    ) -> AsyncIterator[str]:
        """Yield the reply's chunks as the agent produces them.

        Raises:
            AgentdError: the prompt failed (its wire code) or the connection was lost.

        Cancellation: stops reading; the prompt still completes in its worker.
        """
        if self._closed:
            raise AgentdError(ErrorCode.DAEMON_UNAVAILABLE, "connection to the supervisor closed")
        rid = next(self._ids)
        send, recv = trio.open_memory_channel[Response | Event](1024)
        self._pending[rid] = send
        try:
            await self._ms.send(
                Request(
                    id=rid,
                    op="prompt",
                    client_id=self.client_id,
                    args={"session": session, "text": text, "agent": agent},
                )
            )
            async for msg in recv:
                if isinstance(msg, Event):
                    yield str(msg.event.get("text", ""))
                    continue
                if not msg.ok:
                    raise error_of(msg)
                return
        finally:
            self._pending.pop(rid, None)
        raise AgentdError(ErrorCode.DAEMON_UNAVAILABLE, "the supervisor closed the connection")

    async def sessions(self) -> list[dict[str, Any]]:
        result = await self.request("sessions")
        return list(result)

    async def status(self) -> dict[str, Any]:
        return dict(await self.request("status"))


async def _probe(layout: Layout, timing: Timing) -> tuple[MessageStream, Hello] | None:
    sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        with trio.fail_after(timing.connect_timeout):
            await sock.connect(layout.socket)
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        sock.close()
        return None
    except trio.TooSlowError:
        sock.close()
        raise AgentdError(
            ErrorCode.DAEMON_UNAVAILABLE,
            f'the supervisor on {layout.socket} does not accept connections — run "trio-agentd'
            ' doctor --fix"',
        ) from None
    ms = MessageStream(trio.SocketStream(sock))
    try:
        with trio.fail_after(timing.hello_timeout):
            msg = await ms.receive()
    except trio.TooSlowError:
        await ms.aclose()
        raise AgentdError(
            ErrorCode.DAEMON_UNAVAILABLE,
            f"the supervisor on {layout.socket} sent no hello within {timing.hello_timeout}s"
            ' — run "trio-agentd doctor --fix"',
        ) from None
    except (trio.BrokenResourceError, OSError):
        await ms.aclose()
        return None
    if not isinstance(msg, Hello):
        await ms.aclose()
        if isinstance(msg, Response) and not msg.ok:
            raise error_of(msg)
        return None
    return ms, msg


async def _autostart(layout: Layout, timing: Timing) -> None:
    """Autostart through a helper process, so the daemon never becomes our (zombie) child."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "trio_agentd._autostart", "--socket", layout.socket,
            "--home", str(layout.home), "--registry", str(layout.registry)]
    with trio.move_on_after(timing.startup_timeout + 5) as scope:
        done = await trio.run_process(
            argv, check=False, capture_stdout=True, capture_stderr=True,
            stdin=subprocess.DEVNULL,
        )
    if scope.cancelled_caught:
        from ._autostart import startup_timeout

        raise startup_timeout(layout, timing.startup_timeout)
    if done.returncode != 0:
        raise AgentdError(
            ErrorCode.DAEMON_UNAVAILABLE,
            done.stderr.decode(errors="replace").strip() or "autostart failed",
        )


@contextlib.asynccontextmanager
async def open_client(
    socket: str | None = None,
    *,
    home: str | None = None,
    registry: str | None = None,
    autostart: bool = True,
    timing: Timing = DEFAULT_TIMING,
) -> AsyncIterator[Client]:
    """Connect to the supervisor on ``socket`` (default: SPEC §3), autostarting one if needed.

    Raises:
        AgentdError: ``daemon_unavailable`` (with the exit code and log tail if an autostarted
            supervisor died), ``version_mismatch``.

    Cancellation: the connection is closed; a supervisor autostarted for us keeps running.
    """
    layout = Layout.resolve(socket=socket, home=home, registry=registry)
    check_socket_path(layout.socket)
    got = await _probe(layout, timing)
    if got is None and autostart:
        await _autostart(layout, timing)
        got = await _probe(layout, timing)
    if got is None:
        raise AgentdError(ErrorCode.DAEMON_UNAVAILABLE, f"no supervisor on {layout.socket}")
    ms, hello = got
    if hello.protocol != PROTOCOL_VERSION:
        await ms.aclose()
        raise AgentdError(
            ErrorCode.VERSION_MISMATCH,
            f"the supervisor speaks protocol {hello.protocol} (app {hello.app_version}), this"
            f" client speaks {PROTOCOL_VERSION} — run `trio-agentd restart`",
        )
    client = Client(ms, hello, layout)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client._reader)
        try:
            yield client
        finally:
            nursery.cancel_scope.cancel()
            await ms.aclose()
