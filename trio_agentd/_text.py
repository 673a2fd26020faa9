"""Making untrusted text safe to print on a terminal. Pure; imports nothing (CLI warm path).

Session names are checked, but agent specs, socket paths, states and whatever a peer sends are
free text: an agent spec like ``exec:printf "\\x1b]0;pwned\\x07"`` would retitle the terminal, or
a right-to-left override would make a table cell read backwards. :func:`printable` renders
every such character visibly instead (``\\x1b``, ``\\u202e``).
"""

from __future__ import annotations

# C0 controls, DEL, C1 controls, and the bidi controls of Unicode TR9 ("Trojan Source"):
# ALM, LRM/RLM, the embeddings and overrides LRE..RLO, the isolates LRI..PDI.
CONTROL_CODEPOINTS: tuple[int, ...] = (
    *range(0x00, 0x20),
    *range(0x7F, 0xA0),
    0x061C,
    0x200E,
    0x200F,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
)

# the same set as a regex character class body (for validation patterns)
CONTROL_CLASS = "\\x00-\\x1f\\x7f-\\x9f\\u061c\\u200e\\u200f\\u202a-\\u202e\\u2066-\\u2069"

_ESCAPES = {cp: (f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}") for cp in CONTROL_CODEPOINTS}


def printable(text: str) -> str:
    """``text`` with every control or bidi-control character written as a visible escape.

    Everything else (including other non-ASCII text) is kept as is; the result holds no
    character of :data:`CONTROL_CODEPOINTS`.
    """
    return text.translate(_ESCAPES)


def has_control(text: str) -> bool:
    """Whether ``text`` holds a character :func:`printable` would escape."""
    return text.translate(_ESCAPES) != text
