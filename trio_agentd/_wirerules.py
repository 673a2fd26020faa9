"""Rules of the wire that need no codec, in one place for every side that speaks it.

The bound on a line, how long a client keeps resending a command across lost connections,
which error codes mean "reconnect and resend" or "ask the supervisor for a new route", and
which ops may create a session. The blocking client (``_syncclient``, on the CLI's warm path),
the async client (``_client``) and the codec (``_protocol``) all read them from here. Loop-free
and cheap to import: it imports only the error codes.
"""

from __future__ import annotations

from ._defaults import RETRY_FOR as RETRY_FOR  # seconds a command keeps being resent
from ._errors import ErrorCode

MAX_FRAME = 1 << 20  # bytes per line, newline excluded

# errors that mean "this supervisor is going away": reconnect and resend
RETRYABLE = frozenset({ErrorCode.DAEMON_UNAVAILABLE, ErrorCode.SHUTTING_DOWN})
# a direct route that fails with these goes back to the supervisor for a new one
REROUTE = frozenset({ErrorCode.WORKER_UNAVAILABLE, ErrorCode.GRANT_REFUSED})
# ops that may create a session: they carry the creating client's cwd and environment
CREATING_OPS = frozenset({"prompt", "create_session", "route"})


def retry_deadline(deadline: float | None, now: float, window: float) -> float:
    """When a command stops being resent: ``window`` seconds after its *first* lost try.

    The window opens at the loss, not at the send: a turn that ran for minutes before its
    connection dropped (a worker killed mid-turn) still gets its whole window to reach the
    respawned worker, whose journal answers the resend. Later losses keep the first one's
    window, so a connection that keeps dropping is given up ``window`` after it first did.
    """
    return now + window if deadline is None else deadline
