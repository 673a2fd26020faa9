"""Text that is not UTF-8 (surrogate-escaped bytes) crosses the JSON wire intact."""

from __future__ import annotations

import json
import os

from hypothesis import given
from hypothesis import strategies as st

from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._protocol import ErrorBody, Request, Response, decode, encode, fail
from trio_agentd._wirestr import from_wire, shown, to_wire

NOT_UTF8 = os.fsdecode(b"caf\xe9/bad\xffdir")  # 'caf\udce9/bad\udcffdir'


@given(st.binary(max_size=64))
def test_any_bytes_round_trip_through_json(raw: bytes) -> None:
    text = raw.decode("utf-8", "surrogateescape")
    wire = json.dumps(to_wire({"text": text, "env": {"PWD": text}}), ensure_ascii=False)
    wire.encode("utf-8")  # valid UTF-8: no surrogate left on the wire
    back = from_wire(json.loads(wire))
    assert back == {"text": text, "env": {"PWD": text}}
    assert back["text"].encode("utf-8", "surrogateescape") == raw


def test_valid_text_is_sent_as_it_is() -> None:
    assert to_wire({"text": "café ✓", "n": 3}) == {"text": "café ✓", "n": 3}


def test_a_request_frame_carries_surrogates_and_decodes_to_the_same_text() -> None:
    frame = encode(Request(id=1, client_id="c", op="prompt",
                           args={"text": NOT_UTF8, "cwd": NOT_UTF8}))
    frame.decode("utf-8")  # the frame itself is valid UTF-8
    msg = decode(frame.rstrip(b"\n"))
    assert isinstance(msg, Request)
    assert msg.args == {"text": NOT_UTF8, "cwd": NOT_UTF8}


def test_an_error_message_with_such_a_path_is_shown_with_escapes() -> None:
    frame = encode(fail(7, AgentdError(ErrorCode.BAD_REQUEST, f"no dir {NOT_UTF8}",
                                       {"cwd": NOT_UTF8})))
    msg = decode(frame.rstrip(b"\n"))
    assert isinstance(msg, Response)
    assert isinstance(msg.error, ErrorBody)
    assert msg.error.message == "no dir caf\\xe9/bad\\xffdir"
    assert msg.error.details == {"cwd": NOT_UTF8}
    assert shown(NOT_UTF8) == "caf\\xe9/bad\\xffdir"
