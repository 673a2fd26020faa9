"""One place per fact, errors as types: what the clients, doctor and the CLI share is defined
once, and the CLI branches on an error's type, never on its text."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest

from trio_agentd import _cli_io, _client, _protocol, _syncclient, _syncconn, _wirerules
from trio_agentd._doctor_repair import RealHooks
from trio_agentd._errors import AgentdError, ErrorCode, NoSupervisor, not_accepting, single_errors
from trio_agentd._paths import Layout
from trio_agentd._registry import Registry
from trio_agentd._registryfiles import OWNER_FILE, SCOPE_FILE, owner_dir_name
from trio_agentd.testing import make_owner_record

SHARED = {"MAX_FRAME", "RETRY_FOR", "RETRYABLE", "_RETRYABLE", "REROUTE", "_REROUTE",
          "CREATING_OPS"}


@pytest.mark.parametrize("module", [_client, _syncclient, _syncconn, _protocol])
def test_the_wire_rules_are_assigned_only_in_their_module(module: Any) -> None:
    tree = ast.parse(Path(module.__file__).read_text())
    assigned = {t.id for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert not assigned & SHARED, f"{module.__name__} defines {assigned & SHARED} again"


def test_both_clients_and_the_codec_read_the_same_values() -> None:
    client, sync, conn = vars(_client), vars(_syncclient), vars(_syncconn)
    assert client["_RETRYABLE"] is sync["RETRYABLE"] is _wirerules.RETRYABLE
    assert client["_REROUTE"] is sync["REROUTE"] is _wirerules.REROUTE
    assert client["RETRY_FOR"] == sync["RETRY_FOR"] == _wirerules.RETRY_FOR
    assert sync["CREATING_OPS"] is _wirerules.CREATING_OPS
    assert _protocol.MAX_FRAME == conn["MAX_FRAME"] == _wirerules.MAX_FRAME == 1 << 20


class _Refused:
    """A SyncClient whose connect fails as told."""

    error: AgentdError

    def __init__(self, layout: Layout, *, autostart: bool) -> None:
        assert not autostart
        self.trace = None

    def connect(self) -> None:
        raise self.error


def test_both_clients_say_a_supervisor_does_not_accept_connections_in_the_same_words() -> None:
    err = not_accepting("/run/x/d.sock", 1.25)
    assert err.code == ErrorCode.DAEMON_UNAVAILABLE
    assert err.details == {"wedged": True}
    assert err.message == ('the supervisor on /run/x/d.sock does not accept connections'
                           ' (waited 1.2s) — run "trio-agentd doctor --fix"')
    for module in (_client, _syncconn):
        assert vars(module)["not_accepting"] is not_accepting, module.__name__
        assert "does not accept connections" not in Path(str(module.__file__)).read_text()


def test_the_cli_takes_no_supervisor_from_the_error_type_not_its_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_syncclient, "SyncClient", _Refused)
    layout = Layout(home="/h", socket="/run/x.sock", registry="/r")
    _Refused.error = NoSupervisor("nobody listens on /run/x.sock")  # whatever it says
    assert _cli_io.client_or_none(layout) is None
    # a supervisor that is there but answers nothing is a failure, whatever it says
    _Refused.error = AgentdError(ErrorCode.DAEMON_UNAVAILABLE, "no supervisor answered",
                                 {"wedged": True})
    with pytest.raises(AgentdError, match="no supervisor answered"):
        _cli_io.client_or_none(layout)


def test_a_missing_socket_dir_is_no_supervisor() -> None:
    layout = Layout(home="/h", socket="/nonexistent-trio-agentd-dir/x.sock", registry="/r")
    client = _syncclient.SyncClient(layout, autostart=False)
    with pytest.raises(NoSupervisor) as caught:
        client.connect()
    assert caught.value.code == ErrorCode.DAEMON_UNAVAILABLE


def test_doctor_revokes_as_the_supervisor_reads_it(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry")
    registry.ensure()
    record = make_owner_record(generation="g1", pid=os.getpid())
    registry.write_in_place(record)
    assert registry.owner_json("g1") == tmp_path / "registry" / owner_dir_name("g1") / OWNER_FILE
    assert registry.scope_json("g1").name == SCOPE_FILE
    assert [r.generation for r in registry.scan()] == ["g1"]
    layout = Layout(home=tmp_path / "home", socket="/run/x.sock", registry=registry.root)
    RealHooks(layout).revoke("g1")
    assert registry.is_revoked("g1")
    assert registry.scan() == []
    assert sorted(os.listdir(registry.root)) == [".guard", "g1.revoked"]


def _raise(exc: BaseException) -> None:
    with single_errors():
        raise exc


def test_a_lone_error_anywhere_in_nested_groups_comes_out_bare_with_its_cause() -> None:
    cause = OSError("disk")
    inner = AgentdError(ErrorCode.STORAGE_ERROR, "no space")
    inner.__cause__ = cause
    with pytest.raises(AgentdError) as caught:
        _raise(ExceptionGroup("outer", [ExceptionGroup("inner", [inner])]))
    assert caught.value is inner
    assert caught.value.__cause__ is cause


def test_several_errors_become_one_internal_error_from_the_group() -> None:
    group = ExceptionGroup("two", [ValueError("a"), KeyError("b")])
    with pytest.raises(AgentdError) as caught:
        _raise(group)
    assert caught.value.code == ErrorCode.INTERNAL
    assert caught.value.__cause__ is group


def test_a_group_with_a_base_exception_is_left_as_it_is() -> None:
    group = BaseExceptionGroup("two", [KeyboardInterrupt(), ValueError("a")])
    with pytest.RaisesGroup(KeyboardInterrupt, ValueError) as caught:
        _raise(group)
    assert caught.value is group
