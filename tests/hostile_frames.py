"""Hostile request frames (no newline): each must get one ``bad_request`` and nothing else.

Shared by the unit tests of the decoder and the end-to-end test against a real supervisor.
"""

from __future__ import annotations

_REQ = b'{"type":"request","id":1,"op":"ping"'

HOSTILE_FRAMES: dict[str, bytes] = {
    # nesting: the decoder recursed once per level and raised RecursionError
    "deep_arrays_in_args": b'{"type":"request","id":1,"op":"ping","args":{"a":'
    + b"[" * 100_000 + b"]" * 100_000 + b"}}",
    "deep_objects_in_args": b'{"type":"request","id":1,"op":"ping","args":'
    + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    "deep_unclosed": b"[" * 500_000,
    "deep_after_escaped_quote": b'{"type":"request","id":1,"op":"ping","args":{"s":"\\"[[[","a":'
    + b"[" * 1000 + b"]" * 1000 + b"}}",
    "depth_65": b'{"type":"request","id":1,"op":"ping","args":{"a":'
    + b"[" * 63 + b"]" * 63 + b"}}",
    # numbers
    "id_1e999": b'{"type":"request","id":1e999,"op":"ping"}',
    "id_5000_digits": b'{"type":"request","id":' + b"9" * 5000 + b',"op":"ping"}',
    "arg_5000_digits": _REQ + b',"args":{"n":' + b"9" * 5000 + b"}}",
    "arg_1e999": _REQ + b',"args":{"n":-1e999}}',
    "id_2_pow_64": b'{"type":"request","id":18446744073709551616,"op":"ping"}',
    "id_nan": b'{"type":"request","id":NaN,"op":"ping"}',
    "id_infinity": b'{"type":"request","id":Infinity,"op":"ping"}',
    "arg_nan": _REQ + b',"args":{"n":NaN}}',
    "id_float": b'{"type":"request","id":1.5,"op":"ping"}',
    "id_bool": b'{"type":"request","id":true,"op":"ping"}',
    "id_null": b'{"type":"request","id":null,"op":"ping"}',
    "id_list": b'{"type":"request","id":[1],"op":"ping"}',
    # control and bidi-control characters in names
    "id_nul": b'{"type":"request","id":"a\\u0000","op":"ping"}',
    "id_escape": b'{"type":"request","id":"\\u001b]0;pwned\\u0007","op":"ping"}',
    "id_newline": b'{"type":"request","id":"abc\\n","op":"ping"}',
    "id_c1": b'{"type":"request","id":"a\\u009b2J","op":"ping"}',
    "id_del": b'{"type":"request","id":"a\\u007f","op":"ping"}',
    "id_rlo": b'{"type":"request","id":"a\\u202eb","op":"ping"}',
    "id_rli": b'{"type":"request","id":"a\\u2067b","op":"ping"}',
    "op_nul": b'{"type":"request","id":1,"op":"ping\\u0000"}',
    "op_newline": b'{"type":"request","id":1,"op":"ping\\n"}',
    "op_escape": b'{"type":"request","id":1,"op":"\\u001b[2Jping"}',
    "client_id_escape": _REQ + b',"client_id":"\\u001b[31m"}',
    # unknown fields and wrong types
    "unknown_field": _REQ + b',"zzz":1}',
    "args_typo": _REQ + b',"arg":{"session":"s"}}',
    "op_int": b'{"type":"request","id":1,"op":5}',
    "args_list": _REQ + b',"args":[]}',
    "args_string": _REQ + b',"args":"x"}',
    "client_id_int": _REQ + b',"client_id":5}',
    "no_type": b'{"id":1,"op":"ping"}',
    "type_int": b'{"type":5,"id":1,"op":"ping"}',
    "type_unknown": b'{"type":"nope","id":1,"op":"ping"}',
    "not_a_request": b'{"type":"response","id":1,"ok":true}',
    "top_level_array": b"[1,2,3]",
    "top_level_string": b'"ping"',
    # not JSON
    "empty": b"",
    "blank": b"   ",
    "garbage": b"this is not json",
    "trailing_garbage": _REQ + b"} x",
    "invalid_utf8": b'{"type":"request","id":"\xff\xfe","op":"ping"}',
    "overlong_utf8": b'{"type":"request","id":"\xc0\xaf","op":"ping"}',
    "lone_surrogate": b'{"type":"request","id":"\\ud800","op":"ping"}',
    "nul_byte": b'{"type":"request","id":1,"op":"ping"}\x00',
}

# valid frames that each of these may be mistaken for: they must decode
VALID_LOOKALIKES: dict[str, bytes] = {
    "brackets_in_a_string": b'{"type":"request","id":"' + b"[" * 100_000 + b'","op":"ping"}',
    "escaped_quotes_and_brackets": b'{"type":"request","id":1,"op":"ping",'
    b'"args":{"s":"\\"[{\\\\"}}',
    "depth_64": b'{"type":"request","id":1,"op":"ping","args":{"a":'
    + b"[" * 62 + b"]" * 62 + b"}}",
    "unicode_names": b'{"type":"request","id":"\xc3\xa9\xe2\x82\xac","op":"ping",'
    b'"client_id":"\xf0\x9f\x98\x80"}',
}
