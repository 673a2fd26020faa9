"""Which supervisor a client hands over, and which sessions keep it waiting (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from trio_agentd._autostart import busy_sessions, is_older, is_ours, version_key
from trio_agentd._version import APP_VERSION, PROTOCOL_VERSION


@pytest.mark.parametrize(("text", "key"), [
    ("0.1.0", (0, 1, 0)), ("0.10.1", (0, 10, 1)), ("1.2.3rc1", (1, 2, 3)),
    ("2.0.dev3", (2, 0)), ("x", ()), ("", ()), (None, ()), (3, ()),
])
def test_version_key(text: object, key: tuple[int, ...]) -> None:
    assert version_key(text) == key


def test_versions_order_by_number_not_by_text() -> None:
    assert version_key("0.10.0") > version_key("0.9.9")


def _hello(app: Any = APP_VERSION, protocol: Any = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"type": "hello", "app_version": app, "protocol": protocol}


def test_only_an_older_installation_is_handed_over() -> None:
    assert is_ours(_hello())
    assert not is_older(_hello())
    assert is_older(_hello(app="0.0.1"))
    assert is_older(_hello(app="99.0", protocol=PROTOCOL_VERSION - 1))  # protocol first
    assert is_older(_hello(app="garbage"))
    assert is_older(_hello(protocol=None))
    # a newer one is used as it is (or refused for another protocol), never replaced by itself
    assert not is_older(_hello(app="99.0"))
    assert not is_older(_hello(protocol=PROTOCOL_VERSION + 1))
    assert not is_ours(_hello(app="99.0"))


def test_busy_sessions_from_the_field_or_an_older_supervisors_idle_time() -> None:
    rows = [
        {"session": "a", "state": "ready", "idle_s": 0.0, "busy": False},
        {"session": "b", "state": "ready", "idle_s": 3.0, "busy": True},
        {"session": "c", "state": "ready", "idle_s": 0},  # no field: idle 0 on a ready session
        {"session": "d", "state": "ready", "idle_s": 4.2},
        {"session": "e", "state": "stopped", "idle_s": 0},
        "not a row",
    ]
    assert busy_sessions(rows) == ["b", "c"]
    assert busy_sessions({"not": "a list"}) == []
