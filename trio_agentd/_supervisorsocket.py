"""The supervisor's listener: the socket lease, bind (after probing what is there), rebind, accept.

Theory of operation
-------------------
The lease (an flock on ``lease_path``, naming its holder) makes this supervisor the one that
may bind the socket path; only then is a path that answers nothing unlinked and bound again,
mode 0600 in a proven-private dir. The bound inode is remembered: the self-check asks
:meth:`SupervisorSocket.intact` and rebinds a path that was unlinked or replaced, and shutdown
unlinks the path only while it is still ours. A socket passed by a service manager (socket
activation) is listened on as it is and never unlinked. Which client a connection serves, and
how, is the caller's: accepting hands each stream to a ``start`` callback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket as _socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from . import _fs
from ._errors import AgentdError, ErrorCode
from ._exhaustion import RateLimitedLog, accept_forever, exhaustion_error
from ._paths import Layout
from ._protocol import encode, fail
from ._sdactivate import InheritedListener
from ._trust import bind_private, prove_socket_dir
from .timing import Timing

log = logging.getLogger("trio_agentd.supervisor")


class ClientListener(Protocol):
    """Where client connections come from when it is not the supervisor's Unix socket: an
    in-memory listener (``trio_agentd.testing.MemoryListener``) runs the whole supervisor on
    MockClock. ``close`` ends a pending ``accept`` with ``trio.ClosedResourceError``."""

    async def accept(self) -> trio.abc.Stream: ...

    def close(self) -> None: ...


@dataclass(slots=True, kw_only=True)
class SupervisorSocket:
    """Where clients connect: the lease, and the listening socket bound (or inherited) under it.

    Attributes:
        client_listener: where clients connect instead of the Unix socket (then no socket is bound,
            watched or rebound).
        inherited: the listening socket a service manager passed (socket activation).
    """

    layout: Layout
    timing: Timing
    generation: str
    rl: RateLimitedLog
    client_listener: ClientListener | None = None
    inherited: InheritedListener | None = None
    # an inherited socket is the manager's: never unlinked
    _bound_by_us: bool = field(default=False, init=False)
    _lease_fd: int | None = field(default=None, init=False)
    listen_sock: trio.socket.SocketType | None = field(default=None, init=False)
    _bound_ino: int | None = field(default=None, init=False)

    def listen(self) -> None:
        """Listen on the Unix socket: the one a service manager passed, else one we bind (none
        with an injected listener)."""
        if self.client_listener is not None:
            return
        if self.inherited is not None:
            self.take_inherited(self.inherited)
        else:
            self.bind()

    # the lease ------------------------------------------------------------------------------
    def take_lease(self) -> None:
        path = self.layout.lease_path
        fd = _fs.try_lock(path)
        if fd is None:
            holder: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
                holder = json.loads(f.read() or b"{}")
            raise AgentdError(
                ErrorCode.ALREADY_RUNNING,
                f"socket lease {path} is held by supervisor pid {holder.get('pid', '?')},"
                f" generation {holder.get('generation', '?')} — use it, or stop it with"
                " `trio-agentd shutdown`",
                {"pid": holder.get("pid"), "generation": holder.get("generation")},
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "generation": self.generation}).encode(), 0)
        self._lease_fd = fd

    def release_lease(self) -> None:
        if self._lease_fd is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.layout.lease_path).st_ino == os.fstat(self._lease_fd).st_ino:
                    os.unlink(self.layout.lease_path)
            _fs.unlock(self._lease_fd)
            self._lease_fd = None

    # the listening socket ----------------------------------------------------------------
    def bind(self) -> None:
        path = self.layout.socket
        # before every bind and rebind: the dir may have been deleted and made again by
        # someone else since we started
        prove_socket_dir(self.layout.socket_dir)
        if os.path.lexists(path):
            probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            probe.settimeout(self.timing.connect_timeout)
            try:
                probe.connect(path)
            except OSError as exc:
                if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                raise AgentdError(
                    ErrorCode.ALREADY_RUNNING,
                    f"something outside our lease is listening on {path} — stop it first",
                )
            finally:
                probe.close()
        self.listen_sock = trio.socket.from_stdlib_socket(bind_private(path))
        self._bound_ino = os.stat(path).st_ino
        self._bound_by_us = True

    def take_inherited(self, inherited: InheritedListener) -> None:
        """Listen on the socket the service manager bound (proven ours already)."""
        self.listen_sock = trio.socket.from_stdlib_socket(inherited.sock)
        self._bound_ino = inherited.ino
        self._bound_by_us = False
        log.info("listening on %s, a socket passed by the service manager (socket"
                 " activation)", self.layout.socket)

    def close(self, *, unlink: bool) -> None:
        if self.client_listener is not None:
            self.client_listener.close()
        sock = self.listen_sock
        self.listen_sock = None
        if sock is None:
            return
        if unlink and self._bound_by_us:
            with contextlib.suppress(OSError):
                if os.stat(self.layout.socket).st_ino == self._bound_ino:
                    os.unlink(self.layout.socket)
        sock.close()

    def intact(self) -> bool:
        try:
            return os.stat(self.layout.socket).st_ino == self._bound_ino
        except FileNotFoundError:
            return False

    def rebind(self) -> trio.socket.SocketType | None:
        # refused: nothing changes, and the next self-check tries again
        prove_socket_dir(self.layout.socket_dir)
        old = self.listen_sock
        self.listen_sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.layout.socket)  # we hold the lease: the path is ours
        self.bind()
        if old is not None:
            old.close()
        log.warning("socket %s was removed or replaced; bound it again", self.layout.socket)
        return self.listen_sock

    async def accept_loop(
        self, sock: trio.socket.SocketType | None, start: Callable[[trio.abc.Stream], None]
    ) -> None:
        """Accept clients until ``sock`` is closed (shutdown, or replaced by a rebind); each is
        handed to ``start``.

        Out of descriptors (or memory), it backs off and goes on; a connection that arrives
        meanwhile is answered with one ``resource_exhausted`` line. Beyond ``max_clients``
        connections, a new one gets that line too.
        """
        if sock is None or sock.fileno() == -1:
            return
        await accept_forever(
            trio.SocketListener(sock), start, rl=self.rl, what="supervisor",
            shed_line=lambda e: encode(fail(None, exhaustion_error(OSError(e, os.strerror(e))))),
        )

    @staticmethod
    async def accept_from(
        listener: ClientListener, start: Callable[[trio.abc.Stream], None]
    ) -> None:
        """Accept clients from an injected listener until it is closed."""
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            start(stream)

