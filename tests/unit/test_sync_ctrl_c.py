"""Ctrl-C on a blocking client's prompt: the cancel goes on a new connection and the command's
answer is asked for there; a cancel that cannot reach the worker is an error, never a resend of
the prompt on its own (which would join the running turn and wait for it). A fake clock, route,
worker and supervisor."""

from __future__ import annotations

from typing import Any

import pytest

from trio_agentd import _defaults, _syncclient
from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._paths import Layout

from .test_sync_retry_window import _Clock


class _Conn:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.closed = False

    def send(self, frame: dict[str, Any]) -> None:
        self.sent.append(frame)

    def close(self) -> None:
        self.closed = True


class _World:
    """``attaches``: what each ``_attach`` does (a connection, or an exception raised);
    ``answers``: what each ``_await_response`` does, by the id it waits for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, attaches: list[Any],
                 answers: list[tuple[str, Any]]) -> None:
        self.clock = _Clock()
        self.attaches = attaches
        self.answers = answers
        self.conns: list[_Conn] = []
        self.routes = 0
        monkeypatch.setattr("trio_agentd._syncclient.time.monotonic", self.clock.monotonic)
        monkeypatch.setattr("trio_agentd._syncclient.time.sleep", self.clock.sleep)
        monkeypatch.setattr(_syncclient, "_attach", self.attach)
        monkeypatch.setattr(_syncclient, "_await_response", self.await_response)
        monkeypatch.setattr(_syncclient, "_write_route", lambda *a: None)
        self.client = _syncclient.SyncClient(
            Layout(home="/h", socket="/s/d.sock", registry="/r"), autostart=False)
        monkeypatch.setattr(self.client, "_request_supervisor", self.route)

    def route(self, *args: Any) -> dict[str, Any]:
        self.routes += 1
        return {"session": "s", "worker_socket": "/w.sock", "worker_pid": 1, "grant": "g",
                "expires": 1e12}

    def attach(self, route: Any, timing: Any) -> _Conn:
        what = self.attaches.pop(0)
        if isinstance(what, BaseException):
            raise what
        conn = _Conn()
        self.conns.append(conn)
        return conn

    def await_response(self, conn: Any, rid: Any, on_event: Any, watch: Any) -> Any:
        kind, outcome = self.answers.pop(0)
        assert str(rid).startswith("cancel-") == (kind == "cancel"), (rid, kind)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def test_ctrl_c_cancels_on_a_new_connection_then_asks_for_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gone = AgentdError(ErrorCode.WORKER_UNAVAILABLE, "no hello in time")
    w = _World(monkeypatch, attaches=[True, gone, True], answers=[
        ("prompt", KeyboardInterrupt()),
        ("cancel", {"cancelled": True}),
        ("prompt", AgentdError(ErrorCode.COMMAND_CANCELLED, "command 1 was cancelled")),
    ])
    with pytest.raises(AgentdError) as info:
        w.client.request("prompt", {"session": "s", "text": "hi"})
    assert info.value.code == ErrorCode.COMMAND_CANCELLED
    first, second = w.conns
    assert first.closed  # the interrupted connection is not read again
    assert [f["op"] for f in first.sent] == ["prompt"]
    # the cancel, then the same command again (same id): the journal's answer
    assert [f["op"] for f in second.sent] == ["cancel", "prompt"]
    assert second.sent[0]["args"] == {"command_id": second.sent[1]["id"]}
    assert second.sent[1]["id"] == first.sent[0]["id"]
    assert w.routes == 1  # no new route: nothing was resent through the supervisor
    assert w.clock.now == pytest.approx(_defaults.CANCEL_RETRY_DELAY)


def test_a_cancel_that_cannot_reach_the_worker_is_an_error_not_a_resend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gone = AgentdError(ErrorCode.WORKER_UNAVAILABLE, "cannot reach the worker")
    w = _World(monkeypatch, attaches=[True, *[gone] * 1000],
               answers=[("prompt", KeyboardInterrupt())])
    with pytest.raises(AgentdError) as info:
        w.client.request("prompt", {"session": "s", "text": "hi"})
    assert info.value.code == ErrorCode.WORKER_UNAVAILABLE
    assert "cancel could not reach" in info.value.message
    assert "trio-agentd cancel s" in info.value.message
    assert w.routes == 1
    assert [f["op"] for c in w.conns for f in c.sent] == ["prompt"]  # never sent again
    assert _defaults.CANCEL_REACH - 1 < w.clock.now <= _defaults.CANCEL_REACH


def test_a_second_ctrl_c_leaves_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _World(monkeypatch, attaches=[True, True], answers=[
        ("prompt", KeyboardInterrupt()), ("cancel", KeyboardInterrupt())])
    with pytest.raises(KeyboardInterrupt):
        w.client.request("prompt", {"session": "s", "text": "hi"})
    assert all(c.closed for c in w.conns)
