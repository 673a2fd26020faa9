"""Route grants: the supervisor's permission for a client to talk to a session's worker directly.

A grant is ``<generation>.<expires_ms>.<mac>``, where ``mac`` is the HMAC-SHA256 of the session,
the supervisor generation and the expiry, keyed by the worker's token. The token is shared only
by the supervisor and its worker (0600 in a 0700 dir), so only the supervisor can mint a grant
the worker accepts. The worker honours a grant only while its generation is the supervisor it
currently serves under the fence; a replaced supervisor's grants are refused.

Pure: no clock, no I/O (the caller passes ``now``, wall-clock seconds: grants cross processes).
"""

from __future__ import annotations

import hashlib
import hmac
import re

_EXPIRY = re.compile(r"[0-9]{1,16}")  # milliseconds; ASCII digits only

def _mac(token: str, session: str, generation: str, expires_ms: int) -> str:
    msg = f"trio-agentd-grant\0{session}\0{generation}\0{expires_ms}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def make_grant(token: str, session: str, generation: str, expires_at: float) -> str:
    """A grant for ``session`` under ``generation``, valid until ``expires_at`` (wall clock)."""
    expires_ms = int(expires_at * 1000)
    return f"{generation}.{expires_ms}.{_mac(token, session, generation, expires_ms)}"


def grant_generation(grant: str) -> str | None:
    """The supervisor generation a grant names, or ``None`` if it is not shaped like one."""
    parts = grant.split(".")
    return parts[0] if len(parts) == 3 and parts[0] else None


def check_grant(
    grant: str, *, token: str, session: str, generation: str | None, now: float
) -> str | None:
    """``None`` if the grant admits a client to ``session`` now, else why not.

    Args:
        generation: the generation of the supervisor the worker currently serves (``None``:
            none yet, so no grant is honoured).
    """
    parts = grant.split(".")
    if len(parts) != 3 or not _EXPIRY.fullmatch(parts[1]) or not grant.isascii():
        return "malformed grant"
    gen, expires_raw, mac = parts
    expires_ms = int(expires_raw)
    if not hmac.compare_digest(mac.encode(), _mac(token, session, gen, expires_ms).encode()):
        return "grant not issued for this session by its supervisor"
    if generation is None or gen != generation:
        return f"grant of supervisor generation {gen}, which this worker no longer serves"
    if now * 1000 >= expires_ms:
        return "grant expired"
    return None
