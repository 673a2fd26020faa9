"""``loads`` and ``dumps`` of the stdlib's ``json``, straight on its C accelerator (``_json``).

Why: ``import json`` imports ``re`` (its whitespace and number patterns) and costs a short
command such as ``trio-agentd -p`` or ``ps`` more than its whole round trip to the daemon. The
two functions here give the same results and raise the same errors as ``json.loads`` and
``json.dumps`` for what the CLI reads and writes; the stdlib module is imported only where it
decides the answer: a text that does not parse (its error is the one raised), a byte string in
another encoding than UTF-8, or an interpreter without ``_json``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from typing import Any

_json: Any = None
try:
    import _json as _accelerator
except ImportError:  # an interpreter without the accelerator: the stdlib does it all
    pass
else:
    _json = _accelerator

_WHITESPACE = " \t\n\r"  # what json skips around a value
_POS_INF = float("inf")
_CONSTANTS = {"-Infinity": -_POS_INF, "Infinity": _POS_INF, "NaN": float("nan")}


class _Context:
    """The options ``json.JSONDecoder()`` gives its scanner, as the C scanner reads them."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


_scan = None if _json is None else _json.make_scanner(_Context())


def loads(data: str | bytes | bytearray) -> Any:
    """``json.loads(data)``: the same value, or the same ``JSONDecodeError``."""
    if isinstance(data, (bytes, bytearray)):
        # json.detect_encoding: a BOM or a zero byte up front is UTF-16/32 (or UTF-8-sig)
        if data[:1] in (b"\0", b"\xef", b"\xfe", b"\xff") or data[1:2] == b"\0":
            return _stdlib_loads(data)
        try:
            text = data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return _stdlib_loads(data)
    elif isinstance(data, str):
        text = data
    else:
        return _stdlib_loads(data)  # its TypeError
    if _scan is None:
        return _stdlib_loads(text)
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = _scan(text, start)
    except StopIteration:
        return _stdlib_loads(text)  # no value: json's "Expecting value" error
    if end != len(text) and text[end:].lstrip(_WHITESPACE):
        return _stdlib_loads(text)  # json's "Extra data" error
    return value


def dumps(obj: Any, *, separators: tuple[str, str] | None = None,
          sort_keys: bool = False) -> str:
    """``json.dumps(obj, separators=..., sort_keys=...)`` with the defaults otherwise."""
    item_sep, key_sep = separators if separators is not None else (", ", ": ")
    if _json is None:
        import json

        return json.dumps(obj, separators=(item_sep, key_sep), sort_keys=sort_keys)
    if isinstance(obj, str):
        return str(_json.encode_basestring_ascii(obj))
    encode = _json.make_encoder(
        {}, _not_serializable, _json.encode_basestring_ascii, None, key_sep, item_sep,
        sort_keys, False, True,
    )
    return "".join(encode(obj, 0))


def _not_serializable(obj: object) -> None:
    raise TypeError(f"Object of type {obj.__class__.__name__} is not JSON serializable")


def _stdlib_loads(data: Any) -> Any:
    import json

    return json.loads(data)
