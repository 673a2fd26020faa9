"""The CLI's terminal: answers to stdout as bytes, the agent's stderr to ours, one-line
errors, a prompt read from stdin, the ``-v`` trace, and the blocking client set up to use them.
"""

from __future__ import annotations

import sys

from ._errors import NoSupervisor

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from ._paths import Layout


def error(message: str) -> None:
    """One error on stderr. Messages quote what others sent (agent specs, paths, a daemon's
    log), so control characters are shown escaped; line breaks stay (a log tail)."""
    from ._text import printable

    text = "\n".join(printable(line) for line in message.split("\n"))
    print(f"trio-agentd: error: {text}", file=sys.stderr)


def report_os_error(exc: OSError) -> None:
    where = f" ({exc.filename})" if exc.filename else ""
    error(f"{exc.strerror or exc}{where} — check the path and its permissions")


class StdoutClosed(Exception):
    """Writing an answer hit EPIPE. Not an OSError: the client must not take it for a lost
    connection (and resend), nor the CLI for a path problem."""


def stdin_is_tty() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (OSError, ValueError):
        return False


class Answer:
    """Writes answers to stdout as UTF-8 bytes, whatever the terminal's encoding; a lone
    surrogate from undecodable input goes back out as the byte it came from. Big output can
    go from the worker's socket to stdout without passing through Python (:meth:`splice_from`).
    """

    def __init__(self) -> None:
        self.buffer = getattr(sys.stdout, "buffer", None)
        self._splice: Splice | None = None
        self._splice_checked = False

    def splice_from(self, sock: int, size: int, timeout: float | None,
                    moved: Callable[[int], object]) -> bool:
        """Move the next ``size`` bytes of socket ``sock`` to stdout with ``splice``, calling
        ``moved(n)`` as each ``n`` of them reach stdout. ``False`` (nothing read): stdout
        cannot take spliced bytes (a terminal, a file opened to append, no ``splice``): read
        them instead.

        Raises:
            StdoutClosed: nobody reads our stdout any more.
            TimeoutError: nothing came within ``timeout`` (the socket's own timeout).
            ConnectionResetError: the connection ended within the bytes.
        """
        if not self._splice_checked:
            self._splice_checked = True
            if self.buffer is not None:
                self.buffer.flush()  # what went before goes first
                self._splice = Splice.open(sys.stdout.fileno())
        if self._splice is None:
            return False
        try:
            return self._splice.move(sock, size, timeout, moved)
        except BrokenPipeError:
            raise StdoutClosed from None

    def write_bytes(self, data: bytes) -> None:
        if not data:
            return
        try:
            if self.buffer is None:
                sys.stdout.write(data.decode("utf-8", "replace"))
                sys.stdout.flush()
                return
            self.buffer.write(data)
            self.buffer.flush()
        except BrokenPipeError:
            raise StdoutClosed from None

    def write(self, text: str) -> None:
        if not text:
            return
        try:
            if self.buffer is None:  # stdout replaced by a text-only stream
                sys.stdout.write(text)
                sys.stdout.flush()
                return
            try:
                data = text.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:  # a surrogate that was never a byte
                data = text.encode("utf-8", "backslashreplace")
            self.buffer.write(data)
            self.buffer.flush()
        except BrokenPipeError:
            raise StdoutClosed from None


SPLICE_PIPE = 1 << 20  # the room of our own pipe between the socket and a file (a chunk or more)


class Splice:
    """Bytes from a socket to an output with ``splice``: straight into it when it is a pipe,
    else through a pipe of our own (a file, ``/dev/null``). On Linux the bytes a worker sends
    with ``sendfile`` are pages it lends the socket, and a pipe takes them by reference: its
    output then reaches a pipe or ``/dev/null`` without being copied at all, a file with one
    copy (the file's own), never through Python. Blocking as a ``write`` is: a reader that does
    not read stops us, and so the worker (backpressure)."""

    def __init__(self, fd: int, pipe: tuple[int, int] | None) -> None:
        self.fd = fd
        self.pipe = pipe  # ours (read, write), or None: ``fd`` is a pipe itself
        self.usable = True  # a splice into ``fd`` failed with EINVAL: read instead from now

    @classmethod
    def open(cls, fd: int) -> Splice | None:
        """A splice into ``fd``, or ``None`` where it cannot be: no ``splice``, a terminal, a
        file opened to append (``splice`` refuses it), a device that is not ``/dev/null``."""
        import os
        import stat

        if not hasattr(os, "splice"):
            return None
        try:
            st = os.fstat(fd)
            append = _append(fd)
        except OSError:
            return None
        if stat.S_ISFIFO(st.st_mode):
            return cls(fd, None)
        null = stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
        if append or not (stat.S_ISREG(st.st_mode) or null):
            return None
        r, w = os.pipe()
        import contextlib
        import fcntl

        # past pipe-max-size it keeps the default room: only more splices for the same bytes
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, SPLICE_PIPE)
        return cls(fd, (r, w))

    def move(self, sock: int, size: int, timeout: float | None,
             moved: Callable[[int], object]) -> bool:
        """See :meth:`Answer.splice_from`."""
        if not self.usable:
            return False
        left = size
        while left:
            if self.pipe is None:
                try:
                    count = _splice_in(sock, self.fd, left, timeout)
                except OSError as exc:
                    if exc.errno != _EINVAL or left != size:
                        raise
                    self.usable = False  # nothing moved yet: read these bytes instead
                    return False
                moved(count)
            else:
                count = _splice_in(sock, self.pipe[1], min(left, SPLICE_PIPE), timeout)
                self._drain(count, moved)
            left -= count
        return True

    def close(self) -> None:
        """Close our pipe (the output is the caller's)."""
        import os

        if self.pipe is not None:
            os.close(self.pipe[0])
            os.close(self.pipe[1])
            self.pipe = None
            self.usable = False

    def _drain(self, count: int, moved: Callable[[int], object]) -> None:
        """Our pipe's ``count`` bytes into the output (written the plain way if it refuses
        ``splice``: they are in our pipe already)."""
        import os

        assert self.pipe is not None
        while count:
            if self.usable:
                try:
                    n = _splice_out(self.pipe[0], self.fd, count)
                except OSError as exc:
                    if exc.errno != _EINVAL:
                        raise
                    self.usable = False
                    continue
            else:
                data = os.read(self.pipe[0], count)
                view = memoryview(data)
                while view:
                    view = view[_write_out(self.fd, view) :]
                n = len(data)
            moved(n)
            count -= n


_EINVAL = 22


def _append(fd: int) -> bool:
    import fcntl
    import os

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)


def _splice_in(sock: int, out: int, count: int, timeout: float | None) -> int:
    """Up to ``count`` bytes from ``sock`` into ``out``; waits for them as ``recv`` would.

    Raises:
        TimeoutError: nothing came within ``timeout``.
        ConnectionResetError: the connection ended.
    """
    import os
    import select

    while True:
        try:
            n = os.splice(sock, out, count)
        except BlockingIOError:
            if _writable_now(out):  # so it is the socket that has nothing yet
                if not _wait(sock, select.POLLIN, timeout):
                    raise TimeoutError("timed out") from None
            else:
                _wait(out, select.POLLOUT, None)  # the reader's pace: never a timeout
            continue
        if not n:
            raise ConnectionResetError("the connection ended within a chunk")
        return n


def _splice_out(pipe: int, out: int, count: int) -> int:
    import os
    import select

    while True:
        try:
            return os.splice(pipe, out, count)
        except BlockingIOError:  # an output someone made non-blocking
            _wait(out, select.POLLOUT, None)


def _write_out(fd: int, data: memoryview) -> int:
    import os
    import select

    while True:
        try:
            return os.write(fd, data)
        except BlockingIOError:
            _wait(fd, select.POLLOUT, None)


def _writable_now(fd: int) -> bool:
    import select

    return _wait(fd, select.POLLOUT, 0)


def _wait(fd: int, events: int, timeout: float | None) -> bool:
    import select

    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(None if timeout is None else timeout * 1000))


class Diagnostics:
    """Writes the agent's stderr to ours as it comes, byte for byte."""

    def __init__(self) -> None:
        self.buffer = getattr(sys.stderr, "buffer", None)
        self.closed = False

    def write_bytes(self, data: bytes) -> None:
        if not data or self.closed:
            return
        try:
            if self.buffer is None:  # stderr replaced by a text-only stream
                sys.stderr.write(data.decode("utf-8", "replace"))
                sys.stderr.flush()
                return
            self.buffer.write(data)
            self.buffer.flush()
        except BrokenPipeError:
            # nobody reads our stderr: its diagnostics have nowhere to go; the answer (stdout)
            # and the exit status still do, and the transcript keeps them
            self.closed = True


def read_prompt_from_stdin() -> str | None:
    """The prompt on stdin, one trailing newline dropped; None if stdin is empty or closed."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        return None
    data: bytes = stream.read()
    if not data:
        return None
    text = data.decode("utf-8", "surrogateescape")
    return text[:-1] if text.endswith("\n") else text


class Trace:
    """``-v``: each connection step on stderr, one line each, with the time since the
    command started (ms)."""

    def __init__(self) -> None:
        import time

        self.clock = time.monotonic
        self.start = self.clock()

    def __call__(self, line: str) -> None:
        from ._text import printable

        ms = (self.clock() - self.start) * 1000
        print(f"trio-agentd: [{ms:7.1f} ms] {printable(line)}", file=sys.stderr, flush=True)


_trace: Trace | None = None  # set by -v on a client command (start_trace)


def start_trace() -> None:
    """``-v``: from here on, every client prints its connection steps on stderr."""
    global _trace
    _trace = Trace()


def current_trace() -> Trace | None:
    """The ``-v`` trace, or ``None`` without ``-v``."""
    return _trace


def new_client(layout: Layout, *, autostart: bool = True, connect: bool = True) -> Any:
    from ._syncclient import SyncClient

    client = SyncClient(layout, autostart=autostart)
    client.progress = lambda line: print(f"trio-agentd: {line}", file=sys.stderr, flush=True)
    client.trace = _trace
    if connect:
        client.connect()
    return client


def client_or_none(layout: Layout) -> Any:
    from ._syncclient import SyncClient

    client = SyncClient(layout, autostart=False)
    client.trace = _trace
    try:
        client.connect()
    except NoSupervisor:
        return None
    return client
