"""Worker command journals (trio_agentd._journal)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agentd import _journal as j
from trio_agentd._journal import JournalState, compacted, key_of, parse

# --- record writers ---------------------------------------------------------------------------


def test_accepted_line_is_compact_json_with_newline() -> None:
    assert j.accepted("cli", 7, "prompt", {"text": "hi"}) == (
        b'{"kind":"accepted","client_id":"cli","id":7,"op":"prompt","args":{"text":"hi"}}\n'
    )


def test_completed_line() -> None:
    assert j.completed("cli", "c-1", {"reply": "ok"}) == (
        b'{"kind":"completed","client_id":"cli","id":"c-1","result":{"reply":"ok"}}\n'
    )


def test_interrupted_line() -> None:
    assert j.interrupted("", 3) == b'{"kind":"interrupted","client_id":"","id":3}\n'


def test_record_with_newline_in_text_is_one_line() -> None:
    line = j.accepted("c", 1, "prompt", {"text": "a\nb\n"})
    assert line.count(b"\n") == 1
    assert parse(line).accepted[("c", "1")]["args"] == {"text": "a\nb\n"}


def test_key_of_uses_the_command_id_as_text() -> None:
    assert key_of("c", 5) == ("c", "5")
    assert key_of("c", "5") == ("c", "5")


# --- parse ------------------------------------------------------------------------------------


def test_parse_empty_journal() -> None:
    state = parse(b"")
    assert state == JournalState()
    assert state.pending() == []


def test_parse_tracks_accepted_completed_interrupted() -> None:
    data = (
        j.accepted("c", 1, "prompt", {"t": "a"})
        + j.completed("c", 1, "r1")
        + j.accepted("c", 2, "prompt", {"t": "b"})
        + j.accepted("d", "x", "prompt", {})
        + j.interrupted("d", "x")
        + j.accepted("c", 3, "prompt", {"t": "c"})
    )
    state = parse(data)
    assert state.completed == {("c", "1"): "r1"}
    assert state.interrupted == {("d", "x")}
    assert list(state.accepted) == [("c", "1"), ("c", "2"), ("d", "x"), ("c", "3")]
    assert state.pending() == [
        (
            ("c", "2"),
            {"kind": "accepted", "client_id": "c", "id": 2, "op": "prompt", "args": {"t": "b"}},
        ),
        (
            ("c", "3"),
            {"kind": "accepted", "client_id": "c", "id": 3, "op": "prompt", "args": {"t": "c"}},
        ),
    ]
    assert state.skipped_lines == 0


def test_parse_keys_commands_per_client() -> None:
    data = j.accepted("a", 1, "prompt", {}) + j.accepted("b", 1, "prompt", {})
    data += j.completed("a", 1, "done")
    state = parse(data)
    assert [k for k, _ in state.pending()] == [("b", "1")]
    assert state.completed == {("a", "1"): "done"}


def test_parse_completed_result_none_is_completed() -> None:
    state = parse(j.accepted("c", 1, "p", {}) + j.completed("c", 1, None))
    assert state.completed == {("c", "1"): None}
    assert state.pending() == []


@pytest.mark.parametrize(
    "junk",
    [b"{not json", b"[1,2]", b'"text"', b"42", b'{"kind":"mystery","id":1}', b"\xff\xfe{}", b"{}"],
)
def test_parse_skips_a_bad_line_and_keeps_the_rest(junk: bytes) -> None:
    data = j.accepted("c", 1, "p", {}) + junk + b"\n" + j.completed("c", 1, "r")
    state = parse(data)
    assert state.skipped_lines == 1
    assert state.completed == {("c", "1"): "r"}
    assert list(state.accepted) == [("c", "1")]


def test_parse_takes_what_only_json_decodes_a_prompt_that_is_not_utf8() -> None:
    # a surrogate-escaped prompt is written as a lone-surrogate escape, which msgspec refuses
    text = b"caf\xe9".decode(errors="surrogateescape")
    line = j.accepted("c", 1, "prompt", {"text": text})
    assert b"\\udce9" in line
    state = parse(line + j.completed("c", 1, {"reply": text}) + b'{"kind":"started","id":NaN}\n')
    assert state.accepted[("c", "1")]["args"] == {"text": text}
    assert state.completed == {("c", "1"): {"reply": text}}
    assert state.skipped_lines == 0  # NaN too: json takes it, as it always did


def test_parse_ignores_blank_lines() -> None:
    data = b"\n  \n" + j.accepted("c", 1, "p", {}) + b"\n\n"
    state = parse(data)
    assert state.skipped_lines == 0
    assert list(state.accepted) == [("c", "1")]


def test_parse_truncated_last_line_is_ignored() -> None:
    good = j.accepted("c", 1, "p", {}) + j.completed("c", 1, "r")
    tail = j.accepted("c", 2, "p", {})[:20]
    state = parse(good + tail)
    assert state.skipped_lines == 1
    assert list(state.accepted) == [("c", "1")]
    assert state.pending() == []


def test_apply_matches_parse() -> None:
    lines = [j.accepted("c", 1, "p", {"a": 1}), j.interrupted("c", 1), j.accepted("c", 2, "p", {})]
    state = JournalState()
    for line in lines:
        state.apply(json.loads(line))
    assert state == parse(b"".join(lines))


# --- a real journal, truncated at every byte --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Op:
    kind: str
    client: str
    cid: int | str
    payload: Any


ops = st.builds(
    Op,
    st.sampled_from(["accepted", "completed", "interrupted"]),
    st.sampled_from(["", "c1", "c2"]),
    st.integers(min_value=0, max_value=4) | st.sampled_from(["a", "b"]),
    st.none() | st.integers() | st.text(max_size=6) | st.lists(st.booleans(), max_size=2),
)


def line_of(op: Op) -> bytes:
    if op.kind == "accepted":
        return j.accepted(op.client, op.cid, "prompt", {"text": op.payload})
    if op.kind == "completed":
        return j.completed(op.client, op.cid, op.payload)
    return j.interrupted(op.client, op.cid)


def expected_state(lines: list[bytes]) -> JournalState:
    state = JournalState()
    for line in lines:
        state.apply(json.loads(line))
    return state


@settings(max_examples=60)
@given(st.lists(ops, min_size=1, max_size=8))
def test_parse_ignores_a_truncated_tail_at_every_byte_offset(journal: list[Op]) -> None:
    lines = [line_of(op) for op in journal]
    data = b"".join(lines)
    ends: list[int] = []  # offset of each record's newline: the record is complete from there
    offset = 0
    for line in lines:
        offset += len(line)
        ends.append(offset - 1)
    clean_cuts = {0, *ends, *(e + 1 for e in ends)}
    for cut in range(len(data) + 1):
        state = parse(data[:cut])
        complete = [line for line, end in zip(lines, ends, strict=True) if end <= cut]
        want = expected_state(complete)
        assert (state.accepted, state.completed, state.interrupted) == (
            want.accepted,
            want.completed,
            want.interrupted,
        )
        assert state.pending() == want.pending()
        # The partial tail (if any) is the only thing skipped.
        assert state.skipped_lines == (0 if cut in clean_cuts else 1)


# --- compaction -------------------------------------------------------------------------------


def sample_state() -> JournalState:
    data = (
        j.accepted("c", 1, "prompt", {"t": "a"})
        + j.completed("c", 1, "r1")
        + j.accepted("c", 2, "prompt", {"t": "b"})
        + j.accepted("c", 3, "prompt", {"t": "c"})
        + j.completed("c", 3, {"r": 3})
        + j.accepted("d", "x", "prompt", {"t": "d"})
        + j.completed("d", "x", None)
        + j.accepted("c", 4, "prompt", {"t": "e"})
    )
    return parse(data)


def test_compacted_keeps_pending_and_newest_results() -> None:
    out = compacted(sample_state(), keep_completed=2)
    assert out == (
        j.accepted("c", 2, "prompt", {"t": "b"})
        + j.accepted("c", 4, "prompt", {"t": "e"})
        + j.accepted("c", 3, "prompt", {"t": "c"})
        + j.completed("c", 3, {"r": 3})
        + j.accepted("d", "x", "prompt", {"t": "d"})
        + j.completed("d", "x", None)
    )
    again = parse(out)
    assert again.pending() == sample_state().pending()
    assert again.completed == {("c", "3"): {"r": 3}, ("d", "x"): None}


def test_compacted_with_room_for_everything_keeps_every_result() -> None:
    state = sample_state()
    again = parse(compacted(state, keep_completed=100))
    assert again.completed == state.completed
    assert again.pending() == state.pending()


def test_compacted_result_without_accepted_record_survives() -> None:
    state = parse(j.completed("c", 9, "orphan"))
    again = parse(compacted(state, keep_completed=5))
    assert again.completed == {("c", "9"): "orphan"}
    assert again.pending() == []


def test_compacted_keep_zero_drops_every_result() -> None:
    # Regression: items()[-0:] is the whole list.
    state = sample_state()
    out = compacted(state, keep_completed=0)
    assert out == j.accepted("c", 2, "prompt", {"t": "b"}) + j.accepted(
        "c", 4, "prompt", {"t": "e"}
    )


def test_compacted_keeps_interrupted_markers() -> None:
    # Regression: without its marker, a resend of an interrupted non-replayable command would
    # run it again instead of answering command_interrupted.
    state = parse(
        j.accepted("c", 1, "shell", {"t": "rm x"})
        + j.interrupted("c", 1)
        + j.accepted("c", 2, "shell", {"t": "ls"})
    )
    again = parse(compacted(state, keep_completed=100))
    assert again.interrupted == {("c", "1")}
    assert again.pending() == state.pending()


@given(st.lists(ops, max_size=12), st.integers(min_value=1, max_value=6))
def test_compacted_preserves_pending_and_keeps_newest_results(journal: list[Op], keep: int) -> None:
    state = parse(b"".join(line_of(op) for op in journal))
    again = parse(compacted(state, keep_completed=keep))
    assert again.pending() == state.pending()
    newest = list(state.completed.items())[-keep:]
    assert list(again.completed.items()) == newest
    assert again.interrupted == state.interrupted
    assert again.skipped_lines == 0
    # Compacting a compacted journal changes nothing that matters.
    twice = parse(compacted(again, keep_completed=keep))
    assert (twice.pending(), twice.completed, twice.interrupted) == (
        again.pending(),
        again.completed,
        again.interrupted,
    )


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(text=st.text(alphabet=st.characters() | st.sampled_from(["\udcff", "\udc80", "é", "\x00"])),
       extra=_json)
def test_a_line_carries_the_record_it_decodes_to(text: str, extra: Any) -> None:
    """The worker applies the record a line was made from instead of decoding its own line:
    the two must be the same, whatever the text (surrogate-escaped, non-ASCII, control)."""
    line = j.accepted("c", 7, "prompt", {"text": text, "extra": extra}, boot="b")
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert isinstance(line, j.Line)
    assert j.record_of(line) is line.rec  # the record it was made from
    assert line.rec == json.loads(line)
    assert j.record_of(bytes(line)) == line.rec  # a plain line (read back) is decoded
    assert parse(line).accepted[("c", "7")] == line.rec
    done = j.completed("c", 7, {"reply": text})
    assert parse(line + done).completed[("c", "7")] == {"reply": text}


@settings(max_examples=60)
@given(st.lists(ops, min_size=1, max_size=8), st.integers(min_value=1, max_value=300))
def test_parse_reads_a_torn_tail_in_room_written_ahead_as_without_it(
    journal: list[Op], room: int
) -> None:
    """The worker writes zeros ahead of its records; a record cut short by a kill lies in them.
    Whatever the cut, the zeros change nothing: the state is the one of the bytes before them."""
    data = b"".join(line_of(op) for op in journal)
    for cut in range(len(data) + 1):
        with_room, without = parse(data[:cut] + bytes(room)), parse(data[:cut])
        assert (with_room.accepted, with_room.completed, with_room.interrupted) == (
            without.accepted, without.completed, without.interrupted)
        assert with_room.skipped_lines == without.skipped_lines


def test_parse_reads_a_record_appended_after_room_by_an_older_version() -> None:
    """An older version takes the zeros a newer one left for a torn line, ends it with a
    newline and appends after it: the records it wrote there are read, the zeros skipped."""
    first = j.accepted("c1", 1, "prompt", {"text": "one"})
    second = j.completed("c1", 1, "done")
    state = parse(first + bytes(500) + b"\n" + second + bytes(100))
    assert state.skipped_lines == 0
    assert state.completed == {key_of("c1", 1): "done"}


def test_parse_skips_a_record_with_nul_bytes_in_it() -> None:
    """Zeros among a record's bytes: not all of them reached the disk (a flush that never
    happened). The record is skipped, not read as what is left of it."""
    first = j.accepted("c1", 1, "prompt", {"text": "one"})
    second = j.completed("c1", 1, "done")
    for hole in (bytes(3) + second, second[:5] + bytes(4) + second[9:], bytes(4096) + second):
        state = parse(first + hole)
        assert state.skipped_lines == 1
        assert state.completed == {}
        assert list(state.accepted) == [key_of("c1", 1)]
