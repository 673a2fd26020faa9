"""The blocking client's resend window opens at the loss, not at the send (a fake clock: the
client's ``time.monotonic`` and ``time.sleep``; a fake route, worker and supervisor)."""

from __future__ import annotations

from typing import Any

import pytest

from trio_agentd import _syncclient
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._paths import Layout
from trio_agentd._syncconn import _Lost
from trio_agentd._wirerules import RETRY_FOR, retry_deadline


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Conn:
    payload_sink: Any = None

    def send(self, frame: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _client(monkeypatch: pytest.MonkeyPatch, clock: _Clock, answers: list[Any]
            ) -> tuple[_syncclient.SyncClient, list[float]]:
    """A client whose worker takes each of ``answers`` in turn: ``(seconds, outcome)``, the
    outcome raised if it is an exception; the times of its tries are returned."""
    monkeypatch.setattr("trio_agentd._syncclient.time.monotonic", clock.monotonic)
    monkeypatch.setattr("trio_agentd._syncclient.time.sleep", clock.sleep)
    monkeypatch.setattr(_syncclient, "_attach", lambda route, timing: _Conn())
    monkeypatch.setattr(_syncclient, "_write_route", lambda *a: None)
    tries: list[float] = []

    def await_response(conn: Any, rid: Any, on_event: Any, watch: Any) -> Any:
        tries.append(clock.now)
        seconds, outcome = answers.pop(0)
        clock.now += seconds
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(_syncclient, "_await_response", await_response)
    client = _syncclient.SyncClient(Layout(home="/h", socket="/s/d.sock", registry="/r"),
                                    autostart=False)
    route = {"session": "s", "worker_socket": "/w.sock", "worker_pid": 1, "grant": "g",
             "expires": 1e12}
    monkeypatch.setattr(client, "_request_supervisor", lambda *a: route)
    return client, tries


def test_a_turn_longer_than_the_window_that_drops_is_still_resent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    client, tries = _client(monkeypatch, clock, [(300.0, _Lost("dropped")), (0.0, {"turn": 1})])
    assert client.request("prompt", {"session": "s", "text": "hi"}) == {"turn": 1}
    assert tries == [0.0, pytest.approx(300.025)]
    assert client.resent


def test_the_window_after_a_long_turn_is_the_whole_bound_from_the_drop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    lost = [(0.0, AgentdError(ErrorCode.WORKER_UNAVAILABLE, "gone"))] * 1000
    client, tries = _client(monkeypatch, clock, [(300.0, _Lost("dropped")), *lost])
    with pytest.raises(AgentdError) as info:
        client.request("prompt", {"session": "s", "text": "hi"})
    assert info.value.code == ErrorCode.WORKER_UNAVAILABLE
    assert 300.0 + RETRY_FOR - 1.0 < tries[-1] <= 300.0 + RETRY_FOR


def test_the_first_loss_opens_the_window_and_later_ones_keep_it() -> None:
    assert retry_deadline(None, 500.0, 60.0) == 560.0
    assert retry_deadline(560.0, 590.0, 60.0) == 560.0
    assert retry_deadline(None, 7.0, 0.0) == 7.0  # no resend: the first loss is the end
