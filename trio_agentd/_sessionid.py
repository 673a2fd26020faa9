"""The session id rule, in one place: the supervisor enforces it, the CLI checks it up front.

Imports only ``re`` (which the CLI's argparse loads anyway), so the CLI's warm path can use it.
"""

from __future__ import annotations

import re

SESSION_ID_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
# fullmatch, not match with "$": "$" also matches before a trailing newline ("abc\n")
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def is_session_id(value: object) -> bool:
    """Whether ``value`` is a valid session id (see ``SESSION_ID_RULE``)."""
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None
