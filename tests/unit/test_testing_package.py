"""trio_agentd.testing's public surface, and the pytest plugin's cost and reach."""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import trio_agentd.testing
from trio_agentd.testing._daemon import fits_socket_dir


def test_every_public_name_resolves_and_is_documented() -> None:
    names = trio_agentd.testing.__all__
    assert sorted(names) == sorted(set(names))
    for name in names:
        value = getattr(trio_agentd.testing, name)
        assert inspect.isclass(value) or callable(value), name
        assert (value.__doc__ or "").strip(), f"trio_agentd.testing.{name} has no docstring"
    assert set(names) <= set(dir(trio_agentd.testing))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = trio_agentd.testing.Nope


def test_the_names_the_docs_need_are_public_and_the_old_private_paths_still_work() -> None:
    from trio_agentd._handle import WorkerHandle
    from trio_agentd._recovery import Mode
    from trio_agentd.testing import _fakeops, _fakesupervisor

    assert trio_agentd.testing.WorkerHandle is WorkerHandle
    assert trio_agentd.testing.Mode is Mode
    assert trio_agentd.testing.FakeWorkerOps is _fakeops.FakeWorkerOps
    assert trio_agentd.testing.Behaviour is _fakeops.Behaviour
    assert trio_agentd.testing.MemoryListener is _fakesupervisor.MemoryListener
    from trio_agentd.testing import MemoryRegistry, make_worker_core

    assert make_worker_core(MemoryRegistry()).session_id == "s1"


def _text(doc: str | None) -> str:
    return " ".join((doc or "").split())


def test_the_docstrings_say_what_a_user_needs_to_know() -> None:
    t = trio_agentd.testing
    assert "the last one repeats" in _text(t.Behaviour.__doc__)
    assert "the last one repeats" in _text(t.FakeWorkerOps.__doc__)
    assert "spawns nothing" in _text(t.WorkerHandle.__doc__)
    package = _text(t.__doc__)
    assert "wait_all_tasks_blocked()" in package
    assert "Nothing is spawned until asked" in package
    for field in ("worker_connect_timeout", "adopt_connect_timeout", "stop_grace",
                  "kill_confirm_timeout", "link_ping_timeout"):
        assert f"``{field}``" in package, field


def test_the_plugin_is_registered_by_entry_point() -> None:
    points = importlib.metadata.entry_points(group="pytest11")
    assert [p.value for p in points if p.name == "trio_agentd"] == [
        "trio_agentd.testing.pytest_plugin"]


def test_the_plugin_imports_neither_trio_nor_the_daemon() -> None:
    code = (
        "import sys, trio_agentd.testing.pytest_plugin\n"
        "heavy = sorted(m for m in sys.modules if m == 'trio' or m.startswith('trio.')"
        " or m in ('trio_agentd._supervisor', 'trio_agentd._handle', 'trio_agentd.timing',"
        " 'trio_agentd.testing._fakeops', 'trio_agentd.testing._daemon'))\n"
        "print(heavy)\n"
    )
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=60, check=True)
    assert cp.stdout.strip() == "[]"


def test_the_plugin_adds_no_autouse_fixture_option_or_ini_value() -> None:
    from trio_agentd.testing import pytest_plugin

    defined = {name for name in vars(pytest_plugin) if name.startswith("pytest_")}
    assert defined == set()  # no hooks at all: only fixtures
    fixtures = {name: value for name, value in vars(pytest_plugin).items()
                if hasattr(value, "_fixture_function_marker")
                or type(value).__name__ == "FixtureFunctionDefinition"}
    assert set(fixtures) == {"agentd_behaviours", "agentd_timing", "agentd_fake_session",
                             "agentd_fake_supervisor", "agentd_daemon"}
    source = Path(pytest_plugin.__file__).read_text()
    assert "autouse=True" not in source


def test_a_daemon_dir_must_leave_room_for_its_sockets() -> None:
    assert fits_socket_dir(Path("/tmp/ta-x"))
    # sun_path is 107 bytes: the dir, "/s/" and a worker socket's 26-byte name
    assert fits_socket_dir(Path("/" + "d" * (107 - 3 - 26 - 1)))
    assert not fits_socket_dir(Path("/" + "d" * (107 - 3 - 26)))
