"""Process-group records of the worker journal (trio_agentd._journal): ``group`` and
``group_stopped``, the orphans they name, and what compaction keeps of them."""

from __future__ import annotations

import json

from trio_agentd import _journal as j
from trio_agentd._identity import GroupIdentity
from trio_agentd._journal import compacted, parse

G = GroupIdentity(pgid=4242, pid=4242, start_id="boot:123")
H = GroupIdentity(pgid=5151, pid=5151, start_id="boot:456")


def test_group_record_round_trips() -> None:
    line = j.group("cli", 7, G)
    assert json.loads(line) == {"kind": "group", "client_id": "cli", "id": 7, "pgid": 4242,
                                "pid": 4242, "start": "boot:123"}
    state = parse(j.accepted("cli", 7, "prompt", {"text": "x"}) + j.started("cli", 7) + line)
    assert state.skipped_lines == 0
    assert state.orphan_groups() == [(("cli", "7"), G)]


def test_a_group_of_a_command_that_ended_is_no_orphan() -> None:
    head = j.accepted("c", 1, "prompt", {}) + j.started("c", 1) + j.group("c", 1, G)
    assert parse(head + j.completed("c", 1, {"turn": 1})).orphan_groups() == []
    assert parse(head + j.interrupted("c", 1)).orphan_groups() == []


def test_group_stopped_marks_it_handled_once() -> None:
    data = (j.accepted("c", 1, "prompt", {}) + j.group("c", 1, G) + j.group("c", 1, H)
            + j.group_stopped("c", 1, G, "stopped"))
    assert parse(data).orphan_groups() == [(("c", "1"), H)]


def test_a_malformed_group_record_is_skipped() -> None:
    state = parse(b'{"kind":"group","client_id":"c","id":1,"pid":"x"}\n')
    assert state.skipped_lines == 1
    assert state.groups == {}


def test_compaction_keeps_the_unhandled_groups_of_pending_commands_only() -> None:
    data = (
        j.accepted("c", 1, "prompt", {}) + j.started("c", 1) + j.group("c", 1, G)
        + j.group("c", 1, H) + j.group_stopped("c", 1, H, "gone")
        + j.accepted("c", 2, "prompt", {}) + j.group("c", 2, H) + j.completed("c", 2, "r")
    )
    state = parse(data)
    again = parse(compacted(state, keep_completed=10))
    assert again.orphan_groups() == [(("c", "1"), G)]
    assert again.completed == {("c", "2"): "r"}
    assert again.groups == {(("c", "1"), 4242, "boot:123"): G}
