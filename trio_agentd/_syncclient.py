"""The blocking client the CLI uses: plain sockets and stdlib json, no event loop.

The CLI runs on every command, so its warm path (a daemon already running) imports only this,
the path rules and the error type: connecting, reading a hello and one request/response needs no
event loop. Trio programs use :func:`trio_agentd.open_client` instead.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from typing import Any

from ._errors import AgentdError, ErrorCode
from ._paths import Layout, check_socket_path
from ._version import PROTOCOL_VERSION
from .timing import DEFAULT_TIMING, Timing

MAX_FRAME = 1 << 20


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def read_message(self, timeout: float | None) -> dict[str, Any] | None:
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_FRAME:
                raise AgentdError(ErrorCode.FRAME_TOO_LARGE, "daemon sent an oversized line")
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise AgentdError(ErrorCode.INTERNAL, "daemon sent a non-object frame")
        return obj

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.settimeout(None)
        self.sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def close(self) -> None:
        self.sock.close()


def probe(layout: Layout, timing: Timing = DEFAULT_TIMING) -> tuple[_Conn, dict[str, Any]] | None:
    """Connect and read the hello; ``None`` if nobody listens (no socket, or refused).

    Raises:
        AgentdError: ``daemon_unavailable`` if something accepts but sends no hello in time.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timing.connect_timeout)
    try:
        s.connect(layout.socket)
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        s.close()
        return None
    except TimeoutError:
        s.close()
        raise AgentdError(
            ErrorCode.DAEMON_UNAVAILABLE,
            f"the supervisor on {layout.socket} does not accept connections"
            ' — run "trio-agentd doctor --fix"',
        ) from None
    except OSError:
        s.close()
        raise
    conn = _Conn(s)
    try:
        hello = conn.read_message(timing.hello_timeout)
    except TimeoutError:
        conn.close()
        raise AgentdError(
            ErrorCode.DAEMON_UNAVAILABLE,
            f"the supervisor on {layout.socket} accepted but sent no hello within"
            f' {timing.hello_timeout}s — run "trio-agentd doctor --fix"',
        ) from None
    except (OSError, ValueError):
        conn.close()
        return None
    if hello is None:
        conn.close()
        return None
    if hello.get("type") != "hello":
        conn.close()
        err = hello.get("error") or {}
        raise AgentdError(
            str(err.get("code", ErrorCode.INTERNAL)), str(err.get("message", "no hello"))
        )
    return conn, hello


class SyncClient:
    """One connection to the supervisor, autostarting it if needed."""

    def __init__(
        self, layout: Layout, *, timing: Timing = DEFAULT_TIMING, autostart: bool = True
    ) -> None:
        self.layout = layout
        self.timing = timing
        self.autostart = autostart
        self.client_id = os.urandom(8).hex()
        self._ids = 0
        self._conn: _Conn | None = None
        self.hello: dict[str, Any] = {}

    def connect(self) -> dict[str, Any]:
        check_socket_path(self.layout.socket)
        got = probe(self.layout, self.timing)
        if got is None and self.autostart:
            got = self._autostart()
        if got is None:
            raise AgentdError(
                ErrorCode.DAEMON_UNAVAILABLE, f"no supervisor is running on {self.layout.socket}"
            )
        self._conn, self.hello = got
        if self.hello.get("protocol") != PROTOCOL_VERSION:
            raise AgentdError(
                ErrorCode.VERSION_MISMATCH,
                f"the supervisor speaks protocol {self.hello.get('protocol')}"
                f" (app {self.hello.get('app_version')}), this client speaks {PROTOCOL_VERSION}"
                " — run `trio-agentd restart`",
            )
        return self.hello

    def _autostart(self) -> tuple[_Conn, dict[str, Any]] | None:
        from ._autostart import autostart_and_wait

        autostart_and_wait(self.layout, self.timing)
        return probe(self.layout, self.timing)

    def request(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> Any:
        if self._conn is None:
            self.connect()
        assert self._conn is not None
        self._ids += 1
        rid = self._ids
        self._conn.send(
            {"type": "request", "id": rid, "client_id": self.client_id, "op": op,
             "args": args or {}}
        )
        while True:
            msg = self._conn.read_message(None)
            if msg is None:
                raise AgentdError(
                    ErrorCode.DAEMON_UNAVAILABLE,
                    f"the supervisor on {self.layout.socket} closed the connection",
                )
            if msg.get("id") != rid:
                if msg.get("type") == "response" and msg.get("id") is None and not msg.get("ok"):
                    err = msg.get("error") or {}
                    raise AgentdError(str(err.get("code")), str(err.get("message")))
                continue
            if msg.get("type") == "event":
                if on_event is not None:
                    on_event(msg.get("event") or {})
                continue
            if msg.get("type") == "response":
                if msg.get("ok"):
                    return msg.get("result")
                err = msg.get("error") or {}
                raise AgentdError(
                    str(err.get("code", ErrorCode.INTERNAL)),
                    str(err.get("message", "request failed")),
                    err.get("details") or {},
                )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
