"""``_jsonfast`` is the stdlib's ``json.loads`` / ``json.dumps`` without importing ``json``: the
same values, the same text, the same errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trio_agentd
from trio_agentd import _jsonfast

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _same(a: object, b: object) -> bool:
    return json.dumps(a) == json.dumps(b)  # NaN != NaN, but its text is the same


@given(_VALUES, st.sampled_from([None, (",", ":"), (", ", ": ")]), st.booleans())
def test_dumps_writes_what_json_writes(value: object, separators: tuple[str, str] | None,
                                       sort_keys: bool) -> None:
    assert _jsonfast.dumps(value, separators=separators, sort_keys=sort_keys) == json.dumps(
        value, separators=separators, sort_keys=sort_keys)


@given(_VALUES, st.sampled_from(["", " ", "\n", " \t\r\n"]))
def test_loads_reads_what_json_reads(value: object, space: str) -> None:
    text = space + json.dumps(value) + space
    assert _same(_jsonfast.loads(text), json.loads(text))
    assert _same(_jsonfast.loads(text.encode()), json.loads(text.encode()))


@pytest.mark.parametrize("data", [
    "", " ", "{", '{"a": 1} x', '{"a": 1}{}', "[1,]", "\ufeff{}", b"\xef\xbb\xbf{}",
    b"\xff\xfe{\x00}\x00",
    b'"\xff"', "NaN", "-Infinity", '"\\ud800"', b'{"a":"\xed\xa0\x80"}', "1e999", "[" * 5 + "]" * 5,
])
def test_loads_answers_or_fails_as_json_does(data: str | bytes) -> None:
    def outcome(loads: Callable[[str | bytes], object]) -> tuple[str, object]:
        try:
            return "value", json.dumps(loads(data))
        except ValueError as exc:
            return type(exc).__name__, str(exc)

    assert outcome(_jsonfast.loads) == outcome(json.loads)


def test_dumps_refuses_what_json_refuses() -> None:
    with pytest.raises(TypeError, match=r"^Object of type bytes is not JSON serializable$"):
        _jsonfast.dumps({"a": b"x"})
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        _jsonfast.dumps(loop)


def test_it_imports_neither_json_nor_re() -> None:
    # -S: no site (an editable install's import hook loads re); the package found by its path
    code = ("import sys; from trio_agentd import _jsonfast;"
            " _jsonfast.loads(_jsonfast.dumps({'a': [1, 2.5, None, 'x']}));"
            " print(sorted({'json', 're'} & set(sys.modules)))")
    env = {"PYTHONPATH": str(Path(trio_agentd.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.strip() == "[]"
