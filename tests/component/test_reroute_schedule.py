"""The client's direct-route fallback on MockClock: back to the supervisor for a new route at
exact virtual times (capped doubling from 25 ms), the same command id on every try."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trio_agentd import _client
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._paths import Layout
from trio_agentd.timing import DEFAULT_TIMING


class _Recorder:
    """Fakes for the two halves of a direct prompt: the supervisor's ``route`` and the
    worker's answer; records when each was asked."""

    def __init__(self, failures: list[str]) -> None:
        self.failures = failures  # error codes of the worker attempts that fail, in order
        self.routes: list[float] = []
        self.attempts: list[tuple[float, int]] = []  # (time, command id)

    async def request_supervisor(self, rid: int, op: str, args: dict[str, Any],
                                 on_event: Any) -> Any:
        assert op == "route"
        self.routes.append(trio.current_time())
        return {"session": args["session"], "agent": "echo", "worker_socket": "/w.sock",
                "worker_pid": 1, "grant": "g", "expires": 1e12}

    async def attached(self, session: str, route: dict[str, Any]) -> Any:
        return object()

    async def exchange_on(self, conn: Any, rid: int, op: str, args: dict[str, Any],
                          on_event: Any) -> Any:
        self.attempts.append((trio.current_time(), rid))
        if self.failures:
            raise AgentdError(self.failures.pop(0), "fake failure")
        return {"turn": 1, "reply": "ok\n"}


def _client_with(rec: _Recorder, nursery: trio.Nursery) -> _client.Client:
    c = _client.Client(nursery, Layout(home="/h", socket="/s/d.sock", registry="/r"),
                       DEFAULT_TIMING, autostart=False)
    c._request_supervisor = rec.request_supervisor  # type: ignore[method-assign]
    c._attached = rec.attached  # type: ignore[method-assign]
    c._exchange_on = rec.exchange_on  # type: ignore[method-assign]
    c._forget_route = lambda session: None  # type: ignore[method-assign]
    return c


async def test_a_failing_route_is_renewed_with_capped_backoff_and_the_same_id(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    codes = [ErrorCode.WORKER_UNAVAILABLE, ErrorCode.GRANT_REFUSED] * 4
    rec = _Recorder(list(codes))
    client = _client_with(rec, nursery)
    result = await client._prompt_direct(7, {"session": "s", "text": "hi"}, None)
    assert result == {"turn": 1, "reply": "ok\n"}
    # 25 ms doubling, capped at 1 s: tries at 0, .025, .075, .175, .375, .775, 1.575, 2.575,
    # 3.575; a fresh route before every retry; one command id throughout
    assert [t for t, _ in rec.attempts] == pytest.approx(
        [0, 0.025, 0.075, 0.175, 0.375, 0.775, 1.575, 2.575, 3.575]
    )
    assert {rid for _, rid in rec.attempts} == {7}
    assert rec.routes == pytest.approx([t for t, _ in rec.attempts])
    assert client.reroutes == len(codes)


async def test_an_error_that_is_not_the_routes_is_raised_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    rec = _Recorder([ErrorCode.BAD_REQUEST])
    client = _client_with(rec, nursery)
    with pytest.raises(AgentdError) as info:
        await client._prompt_direct(7, {"session": "s", "text": "hi"}, None)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert rec.attempts == [(0.0, 7)]
    assert client.reroutes == 0


async def test_the_route_is_given_up_after_its_bound(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    rec = _Recorder([ErrorCode.WORKER_UNAVAILABLE] * 1000)
    client = _client_with(rec, nursery)
    with pytest.raises(AgentdError) as info:
        await client._prompt_direct(7, {"session": "s", "text": "hi"}, None)
    assert info.value.code == ErrorCode.WORKER_UNAVAILABLE
    assert "could not be reached again within 60s" in info.value.message
    last = rec.attempts[-1][0]
    assert last <= _client.RETRY_FOR
    assert last + 1.0 > _client.RETRY_FOR  # the next try (1 s later) would be past the bound


class _LongTurn(_Recorder):
    """The first try is a turn that runs ``turn`` seconds before its connection drops (its
    worker killed mid-turn); every try after it fails ``failures`` times, then answers."""

    def __init__(self, turn: float, failures: list[str]) -> None:
        super().__init__(failures)
        self.turn = turn

    async def exchange_on(self, conn: Any, rid: int, op: str, args: dict[str, Any],
                          on_event: Any) -> Any:
        if not self.attempts:
            self.attempts.append((trio.current_time(), rid))
            await trio.sleep(self.turn)
            raise AgentdError(ErrorCode.WORKER_UNAVAILABLE, "connection lost mid-turn")
        return await super().exchange_on(conn, rid, op, args, on_event)


async def test_a_turn_longer_than_the_window_that_drops_is_still_resent(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The resend window opens at the loss, not at the send: a 5-minute turn whose worker dies
    is resent (same id) 25 ms after the drop, and answered from the respawned worker."""
    rec = _LongTurn(300.0, [])
    client = _client_with(rec, nursery)
    result = await client._prompt_direct(7, {"session": "s", "text": "hi"}, None)
    assert result == {"turn": 1, "reply": "ok\n"}
    assert rec.attempts == [(0.0, 7), (pytest.approx(300.025), 7)]


async def test_the_window_after_a_long_turn_is_the_whole_bound_from_the_drop(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    rec = _LongTurn(300.0, [ErrorCode.WORKER_UNAVAILABLE] * 1000)
    client = _client_with(rec, nursery)
    with pytest.raises(AgentdError) as info:
        await client._prompt_direct(7, {"session": "s", "text": "hi"}, None)
    assert info.value.code == ErrorCode.WORKER_UNAVAILABLE
    last = rec.attempts[-1][0]
    assert 300.0 + _client.RETRY_FOR - 1.0 < last <= 300.0 + _client.RETRY_FOR


async def test_a_supervisor_request_lost_after_a_long_wait_is_still_resent(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The same for a command to the supervisor: answered only after 100 s (a long stop), then
    its connection lost; the resend goes out 25 ms later."""
    c = _client.Client(nursery, Layout(home="/h", socket="/s/d.sock", registry="/r"),
                       DEFAULT_TIMING, autostart=False)
    tries: list[float] = []

    async def exchange_once(rid: int, op: str, args: dict[str, Any], on_event: Any) -> Any:
        tries.append(trio.current_time())
        if len(tries) == 1:
            await trio.sleep(100.0)
            raise AgentdError(ErrorCode.DAEMON_UNAVAILABLE, "supervisor went away")
        return {"ok": True}

    c._exchange_once = exchange_once  # type: ignore[method-assign]
    assert await c._request_supervisor(3, "kill", {"session": "s"}, None) == {"ok": True}
    assert tries == [0.0, pytest.approx(100.025)]
