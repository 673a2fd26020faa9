"""The CLI's terminal: answers to stdout as bytes, the agent's stderr to ours, one-line
errors, a prompt read from stdin, the ``-v`` trace, and the blocking client set up to use them.
"""

from __future__ import annotations

import sys

from ._errors import NoSupervisor

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
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
    surrogate from undecodable input goes back out as the byte it came from."""

    def __init__(self) -> None:
        self.buffer = getattr(sys.stdout, "buffer", None)

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


class Diagnostics:
    """Writes the agent's stderr to ours as it comes, byte for byte."""

    def __init__(self) -> None:
        self.buffer = getattr(sys.stderr, "buffer", None)
        # no stderr at all (descriptor 2 closed when we started): as if nobody read it
        self.closed = sys.stderr is None

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
