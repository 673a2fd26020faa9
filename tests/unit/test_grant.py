"""Route grants (``_grant``): pure checks of who a grant admits, when, and what it refuses.

A grant is ``<generation>.<expires_ms>.<mac>``; the mac binds session, generation and expiry to
the worker's token. ``check_grant`` returns ``None`` (admitted) or a reason; it takes ``now``
(wall-clock seconds) so every boundary here is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agentd._grant import check_grant, grant_generation, make_grant

TOKEN = "0123456789abcdef0123456789abcdef"
SESSION = "s1"
GEN = "9f1c2e3d4b5a69788796a5b4c3d2e1f0"  # a supervisor generation: uuid4().hex
EXPIRES = 1_700_000_600.0  # wall clock
NOW = 1_700_000_000.0

FOREIGN = "grant not issued for this session by its supervisor"


def _grant(**changes: object) -> str:
    fields: dict[str, object] = {
        "token": TOKEN, "session": SESSION, "generation": GEN, "expires_at": EXPIRES,
    }
    fields.update(changes)
    return make_grant(**fields)  # type: ignore[arg-type]


def _check(grant: str, **changes: object) -> str | None:
    fields: dict[str, object] = {
        "token": TOKEN, "session": SESSION, "generation": GEN, "now": NOW,
    }
    fields.update(changes)
    return check_grant(grant, **fields)  # type: ignore[arg-type]


def test_grant_checks_out_for_its_session_and_generation_before_expiry() -> None:
    grant = _grant()
    assert _check(grant) is None
    assert grant_generation(grant) == GEN
    gen, expires_ms, mac = grant.split(".")
    assert (gen, expires_ms) == (GEN, "1700000600000")
    assert len(mac) == 64  # hex HMAC-SHA256
    assert set(mac) <= set("0123456789abcdef")


def test_grant_for_another_session_is_refused() -> None:
    assert _check(_grant(session="s2")) == FOREIGN
    assert _check(_grant(), session="s2") == FOREIGN


def test_grant_of_a_replaced_supervisor_generation_is_refused() -> None:
    # a genuine grant (right token, session, mac) of the previous supervisor: the worker now
    # serves a newer generation, so it is refused whatever its expiry
    old = _grant(generation="old0generation")
    assert _check(old) == (
        "grant of supervisor generation old0generation, which this worker no longer serves"
    )
    # ... and the newer supervisor's grant is admitted
    assert _check(_grant()) is None


def test_grant_with_no_supervisor_served_yet_is_refused() -> None:
    assert _check(_grant(), generation=None) == (
        f"grant of supervisor generation {GEN}, which this worker no longer serves"
    )


def test_grant_minted_with_another_token_is_refused() -> None:
    assert _check(_grant(token="not-the-worker-token")) == FOREIGN
    assert _check(_grant(), token="another-workers-token") == FOREIGN


def _tampered(grant: str, part: int, value: str) -> str:
    parts = grant.split(".")
    parts[part] = value
    return ".".join(parts)


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda g: _tampered(g, 2, "0" * 64), id="zero-mac"),
        pytest.param(lambda g: _tampered(g, 2, g.split(".")[2][:-1] + (
            "0" if g.split(".")[2][-1] != "0" else "1")), id="one-hex-digit-of-mac"),
        pytest.param(lambda g: _tampered(g, 2, g.split(".")[2].upper()), id="mac-upper-case"),
        pytest.param(lambda g: _tampered(g, 2, g.split(".")[2][:32]), id="mac-truncated"),
        pytest.param(lambda g: _tampered(g, 2, ""), id="mac-empty"),
        pytest.param(lambda g: _tampered(g, 1, "9999999999999"), id="expiry-extended"),
    ],
)
def test_tampered_grant_is_refused(tamper: Callable[[str], str]) -> None:
    grant = _grant()
    forged = tamper(grant)
    assert forged != grant
    assert _check(forged) == FOREIGN


def test_generation_swapped_keeps_mac_is_refused_as_foreign() -> None:
    # the generation is under the mac: naming the current generation on an old grant fails
    old = _grant(generation="old0generation")
    forged = _tampered(old, 0, GEN)
    assert _check(forged) == FOREIGN


@pytest.mark.parametrize(
    "grant",
    ["", ".", "..", "a.b", "a.b.c.d", f"{GEN}.soon.{'0' * 64}", f"{GEN}.-1.{'0' * 64}",
     f"{GEN}.1.5.{'0' * 64}", f"{GEN}. 1.{'0' * 64}", f"{GEN}.+1.{'0' * 64}"],
)
def test_malformed_grant_is_refused_with_a_reason(grant: str) -> None:
    assert _check(grant) == "malformed grant"


def test_grant_is_refused_exactly_at_expiry() -> None:
    grant = _grant(expires_at=NOW + 10)  # expires_ms = (NOW + 10) * 1000 exactly
    assert _check(grant, now=NOW + 9.999) is None
    assert _check(grant, now=NOW + 10) == "grant expired"  # now*1000 >= expires_ms
    assert _check(grant, now=NOW + 10.001) == "grant expired"
    assert _check(grant, now=NOW + 1e6) == "grant expired"


def test_expiry_is_kept_to_the_millisecond_rounding_down() -> None:
    # 0.0009 s past a millisecond is cut: the grant never outlives what the supervisor said
    grant = _grant(expires_at=NOW + 1.0009)
    assert grant.split(".")[1] == str(int((NOW + 1.0009) * 1000))
    assert _check(grant, now=NOW + 1.0008) == "grant expired"


def test_generation_check_comes_before_expiry() -> None:
    # a replaced supervisor's expired grant says why it would never work again
    grant = _grant(generation="old0generation", expires_at=NOW - 1)
    assert _check(grant) == (
        "grant of supervisor generation old0generation, which this worker no longer serves"
    )


def test_grant_generation_of_malformed_strings_is_none() -> None:
    assert grant_generation("") is None
    assert grant_generation("a.b") is None
    assert grant_generation(".1.m") is None
    assert grant_generation("a.b.c.d") is None


# --- arbitrary input -------------------------------------------------------------------------


_grantish = st.one_of(
    st.text(),
    st.tuples(st.text(), st.text(), st.text()).map(".".join),
    st.tuples(
        st.text(max_size=40),
        st.text(alphabet="0123456789\u0661\u00b2\u2460\uff11", max_size=20),
        st.text(alphabet="0123456789abcdefABCDEF", max_size=70),
    ).map(".".join),
)


@settings(max_examples=400, deadline=None)
@given(
    grant=_grantish,
    session=st.text(max_size=20),
    generation=st.one_of(st.none(), st.text(max_size=40)),
    now=st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12),
)
def test_arbitrary_strings_never_raise_only_return_a_reason(
    grant: str, session: str, generation: str | None, now: float
) -> None:
    reason = check_grant(grant, token=TOKEN, session=session, generation=generation, now=now)
    # a reason, never an exception; and nothing made up admits anyone (a mac needs the token)
    assert isinstance(reason, str)
    assert reason


@settings(max_examples=200, deadline=None)
@given(
    session=st.text(max_size=20),
    generation=st.text(alphabet="0123456789abcdef", min_size=1, max_size=32),
    expires_at=st.floats(min_value=0, max_value=4e9),
)
def test_round_trip_admits_until_expiry(session: str, generation: str, expires_at: float) -> None:
    grant = make_grant(TOKEN, session, generation, expires_at)
    expires_ms = int(expires_at * 1000)
    assert grant_generation(grant) == generation
    before = (expires_ms - 1) / 1000
    if before * 1000 < expires_ms:
        assert check_grant(grant, token=TOKEN, session=session, generation=generation,
                           now=before) is None
    # the boundary is in float milliseconds: the first wall-clock time whose ms reach it
    at = expires_ms / 1000
    while at * 1000 < expires_ms:
        at = math.nextafter(at, math.inf)
    assert check_grant(grant, token=TOKEN, session=session, generation=generation,
                       now=at) == "grant expired"
    assert check_grant(grant, token=TOKEN, session=session + "x", generation=generation,
                       now=before) == FOREIGN


@pytest.mark.parametrize(
    "expiry",
    [pytest.param("\u00b2", id="superscript-two"), pytest.param("\u2460", id="circled-one"),
     pytest.param("1" * 4301, id="over-int-digit-limit")],
)
def test_digit_like_or_huge_expiry_is_malformed_not_an_exception(expiry: str) -> None:
    assert _check(f"{GEN}.{expiry}.{'0' * 64}") == "malformed grant"


@pytest.mark.parametrize("grant", [f"{GEN}.1.\ud800", f"\ud800.1.{'0' * 64}"])
def test_lone_surrogate_is_refused_not_an_exception(grant: str) -> None:
    assert _check(grant) is not None
