"""The enum stand-ins of the ps path (``trio_agentd._plain.Enum``/``StrEnum``) against the
``enum`` module's: the same answers for everything this package asks of an enum."""

from __future__ import annotations

import copy
import enum
import pickle
import sys
from typing import Any

import msgspec
import pytest

from trio_agentd import _jsonfast
from trio_agentd._doctor_plan import Status, Step
from trio_agentd._errors import ErrorCode
from trio_agentd._ownership import Cause, Phase, RestoreVerdict
from trio_agentd._plain import Enum as PlainEnum
from trio_agentd._plain import StrEnum as PlainStrEnum
from trio_agentd._plain import enc_hook
from trio_agentd._procstate import Liveness

_CLASS = """
class {name}(Base):
    "Colours."
    RED = "red"
    GREEN = "green-ish"
    _single = "one underscore: a member"
    _{name}__private = "not a member"
    __dunder__ = "not a member"

    @property
    def upper_name(self):
        return self.name.upper()

    def shade(self):
        return f"shade of {{self.value}}"
"""


def _make(base: type, name: str = "Colour") -> Any:
    # a class statement, as the package writes them (enum's metaclass needs its namespace)
    ns: dict[str, Any] = {"Base": base}
    exec(_CLASS.format(name=name), ns)
    return ns[name]


def _answers(cls: Any) -> list[Any]:
    red, green = cls.RED, cls.GREEN
    out: list[Any] = [
        [m.name for m in cls], [m.value for m in cls], len(cls), list(cls.__members__),
        cls("red") is red, cls(red) is red, cls["GREEN"] is green,
        str(red), f"{red}", f"{red:>6}", repr(red), red.shade(),
        red == red, red == green, hash(red) == hash(red.name), hash(red) == hash("red"),
        red == "red", {red: 1}.get("red"), red in cls, "nope" in list(cls),
        copy.copy(red) is red, copy.deepcopy(red) is red, pickle.loads(pickle.dumps(red)) is red,
        red.upper_name, cls.__dunder__, isinstance(red, cls), isinstance(red, str),
    ]
    with pytest.raises(ValueError, match="'blue' is not a valid Colour") as info:
        cls("blue")
    out.append(str(info.value))
    with pytest.raises(KeyError):
        cls["BLUE"]
    with pytest.raises(AttributeError):
        cls.RED = "x"
    with pytest.raises(AttributeError):
        del cls.RED
    with pytest.raises(TypeError):
        _make(cls, "More")
    return out


@pytest.mark.parametrize(("std", "plain"), [(enum.Enum, PlainEnum),
                                            (enum.StrEnum, PlainStrEnum)])
def test_the_stand_ins_answer_as_the_enum_module(
    std: type, plain: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    # module-level for pickle: both classes answer as Colour of this module
    got = []
    for base in (std, plain):
        cls = _make(base)
        cls.__module__ = __name__
        monkeypatch.setattr(sys.modules[__name__], "Colour", cls, raising=False)
        got.append(_answers(cls))
    assert got[0] == got[1]


def test_str_members_encode_as_their_values() -> None:
    """The stdlib's JSON, ours, and msgspec with the package's hook: each member as its
    value (as a key too); msgspec refuses anything else the hook is given."""
    obj = {"code": ErrorCode.INTERNAL, Status.CURRENT: [Cause.REVOKED, Phase.OWNER]}
    want = b'{"code":"internal","current":["revoked","owner"]}'
    assert msgspec.json.encode(obj, enc_hook=enc_hook) == want
    assert _jsonfast.dumps(obj).replace(" ", "").encode() == want
    with pytest.raises(TypeError):
        msgspec.json.encode(Liveness.DEAD, enc_hook=enc_hook)


@pytest.mark.parametrize("cls", [ErrorCode, Status, Step, Cause, Phase, RestoreVerdict])
def test_the_package_str_enums_are_their_values(cls: Any) -> None:
    for member in cls:
        assert type(member.value) is str
        assert str(member) == member.value == member
        assert cls(member.value) is member is cls[member.name]


def test_liveness_members_are_only_themselves() -> None:
    assert [m.value for m in Liveness] == ["alive", "dead", "unknown"]
    assert Liveness.DEAD != "dead"  # type: ignore[comparison-overlap]
    assert str(Liveness.DEAD) == "Liveness.DEAD"
    assert Liveness("dead") is Liveness.DEAD
