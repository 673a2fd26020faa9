"""Text that is not valid UTF-8 on a wire that is: paths, arguments and prompts travel intact.

A Unix path, an argument or an environment value is bytes; Python holds the bytes that are not
UTF-8 as surrogate escapes (``'caf\\udce9'`` for ``b'caf\\xe9'``). JSON frames must be UTF-8, so
such a string goes on the wire as ``{"$bytes": "<base64 of its bytes>"}`` and comes back as the
same string (:func:`to_wire`, :func:`from_wire`). Valid text is sent as it is: the encoding costs
nothing unless a string needs it. Pure; imports nothing at load (CLI warm path).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from typing import Any

TAG = "$bytes"
TAG_IN_FRAME = b'"$bytes"'  # a frame without it needs no decoding


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def to_wire(obj: Any) -> Any:
    """``obj`` (JSON-like) with every string that is not valid UTF-8 as ``{"$bytes": b64}``
    (dict keys too, as their valid-text display form: keys cannot be objects)."""
    if isinstance(obj, str):
        if not _has_surrogate(obj):
            return obj
        import base64

        try:
            raw = obj.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate that was never a byte: shown escaped
            return shown(obj)
        return {TAG: base64.b64encode(raw).decode("ascii")}
    if isinstance(obj, dict):
        return {(shown(k) if isinstance(k, str) else k): to_wire(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_wire(v) for v in obj]
    return obj


def from_wire(obj: Any) -> Any:
    """The inverse of :func:`to_wire`: ``{"$bytes": b64}`` back to the surrogate-escaped
    string. A malformed one is left as it is (the field's own check refuses it)."""
    if isinstance(obj, dict):
        if len(obj) == 1 and isinstance(obj.get(TAG), str):
            import base64
            import binascii

            try:
                return base64.b64decode(obj[TAG], validate=True).decode(
                    "utf-8", "surrogateescape")
            except (binascii.Error, ValueError):
                return obj
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_wire(v) for v in obj]
    return obj


def shown(text: str) -> str:
    """``text`` as valid UTF-8 for a human: each byte that is not UTF-8 as ``\\xNN``."""
    if not _has_surrogate(text):
        return text
    return text.encode("utf-8", "surrogateescape" if _escapable(text) else "surrogatepass"
                       ).decode("utf-8", "backslashreplace")


def _escapable(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True
