"""The one error type of the public API, carrying its wire code."""

from __future__ import annotations

from ._plain import StrEnum  # enum.StrEnum to type checkers; no enum import (ps path)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager
    from typing import Any


class ErrorCode(StrEnum):
    """Machine-readable error codes of the public protocol."""

    BAD_REQUEST = "bad_request"
    UNKNOWN_OP = "unknown_op"
    UNKNOWN_SESSION = "unknown_session"
    OWNERSHIP_LOST = "ownership_lost"
    SHUTTING_DOWN = "shutting_down"
    WORKER_UNAVAILABLE = "worker_unavailable"
    # the worker's process is there but it answers nothing, not even a ping (SIGSTOPped, or
    # its event loop blocked): the prompt waiting on it fails; the worker's journal keeps the
    # command, so a resend with the same id later gets its result
    WORKER_UNRESPONSIVE = "worker_unresponsive"
    COMMAND_INTERRUPTED = "command_interrupted"
    COMMAND_CANCELLED = "command_cancelled"
    # `trio-agentd kill SESSION` ended the prompt's turn (or the prompt queued behind it)
    SESSION_KILLED = "session_killed"
    # a durable write (journal append or flush) failed: ENOSPC, EDQUOT, EFBIG, EIO
    STORAGE_ERROR = "storage_error"
    FRAME_TOO_LARGE = "frame_too_large"
    PERMISSION_DENIED = "permission_denied"
    VERSION_MISMATCH = "version_mismatch"
    INTERNAL = "internal"
    # the session's agent cannot be loaded or started (a module:attribute agent whose import
    # or factory fails): the session is failed with that cause until `trio-agentd retry`
    AGENT_FAILED = "agent_failed"
    # not on the public wire as a response code, but used by the CLI and the worker link
    ALREADY_RUNNING = "already_running"
    SUPERVISOR_GENERATION_STALE = "supervisor_generation_stale"
    DAEMON_UNAVAILABLE = "daemon_unavailable"
    CONFIG = "config"
    # a worker refused a client's direct route (expired, or of a replaced supervisor): the
    # client asks the supervisor for a new route and resends with the same command id
    GRANT_REFUSED = "grant_refused"
    # the daemon ran out of a resource for this one request (open files, processes, memory, a
    # cap on connections or sessions); it keeps serving, and a retry later may succeed
    RESOURCE_EXHAUSTED = "resource_exhausted"
    # worker to supervisor (a ``dropped`` frame), not on the public wire: the worker stopped
    # cleanly on its own (an operator's TERM/INT/HUP/QUIT): a stop, not a crash to respawn
    WORKER_STOPPED = "worker_stopped"
    # `trio-agentd rm` of a session that runs a turn (without --force)
    SESSION_BUSY = "session_busy"
    # a `logs -f` follower that fell too far behind a turn's output was let go
    FOLLOWER_BEHIND = "follower_behind"


def single_errors() -> AbstractContextManager[None]:
    """Re-raise a one-exception group as that exception (public API never leaks groups).

    Nurseries wrap everything that escapes them, including the user's own exception from the
    body of ``async with open_client()``. A group of several exceptions becomes an
    ``AgentdError`` (``internal``) from the group.

    Why by hand: neither Python nor trio offers this as public API. ``except*`` splits a group
    by type but always re-raises a group; trio's own collapse is private, and the loose mode
    that used it (``strict_exception_groups=False``) is deprecated. Nested groups (a nursery in
    a nursery) are flattened first, so one error anywhere in the tree comes out bare.
    """
    import contextlib  # here: the CLI's warm path imports this module, and never needs it

    return contextlib.contextmanager(_single_errors)()


def _single_errors() -> Iterator[None]:
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from leaves[0].__cause__
        if all(isinstance(e, Exception) for e in leaves):
            raise AgentdError(ErrorCode.INTERNAL, f"several errors: {leaves}") from group
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        else:
            out.append(exc)
    return out


class AgentdError(Exception):
    """Base of every error trio-agentd raises to its users.

    Attributes:
        code: the wire code.
        message: one human line that names the cause and, where there is one, the fix.
        details: machine-readable extras (e.g. the ownership-lost cause).
    """

    def __init__(
        self, code: ErrorCode | str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = str(code)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"AgentdError({self.code!r}, {self.message!r})"


class NoSupervisor(AgentdError):
    """Nobody listens on the socket (no socket dir, no socket, or the connection refused):
    ``daemon_unavailable``, as opposed to a supervisor that is there but does not answer
    (``details["wedged"]``). Commands that only report on a supervisor (``status``, ``stop``)
    take it as "none is running", never as a failure."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.DAEMON_UNAVAILABLE, message)


def not_accepting(socket: str, waited: float) -> AgentdError:
    """A supervisor is there (its socket, maybe its lease) but takes no connection: its
    backlog stayed full past patience, or nothing holds its lease. Both clients raise it."""
    return AgentdError(
        ErrorCode.DAEMON_UNAVAILABLE,
        f"the supervisor on {socket} does not accept connections (waited"
        f' {waited:.1f}s) — run "trio-agentd doctor --fix"',
        {"wedged": True},
    )
