"""The session id rule, in one place: the supervisor enforces it, the CLI checks it up front.

Imports nothing, and compiles no regular expression: the CLI's warm path checks every prompt's
session id, and a first ``re.compile`` costs it more than the check ever will.
"""

from __future__ import annotations

SESSION_ID_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_REST = _FIRST | frozenset("._-")


def is_session_id(value: object) -> bool:
    """Whether ``value`` is a valid session id (see ``SESSION_ID_RULE``): the whole string,
    so a trailing newline ("abc\\n") is refused too."""
    return (isinstance(value, str) and 0 < len(value) <= 64 and value[0] in _FIRST
            and _REST.issuperset(value))
