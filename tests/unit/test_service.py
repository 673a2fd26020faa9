"""``trio-agentd service install|uninstall|status`` through its argv, with a temporary
XDG_CONFIG_HOME (systemctl is never run unless a test puts a fake one on PATH)."""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

from trio_agentd._paths import Layout
from trio_agentd._service import (
    add_service_parser,
    exec_quote,
    installed_python,
    render_service,
    run_service,
    unit_dir,
)
from trio_agentd.timing import SERVICE_WATCHDOG_SEC


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trio-agentd")
    p.add_argument("--socket")
    sub = p.add_subparsers(dest="command")
    add_service_parser(sub)
    return p


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(home=tmp_path / "home", socket=str(tmp_path / "run" / "daemon.sock"),
                  registry=tmp_path / "reg")


@pytest.fixture
def units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no systemctl unless a test adds one
    return tmp_path / "cfg" / "systemd" / "user"


def service(layout: Layout, *argv: str) -> int:
    args = _parser().parse_args(["service", *argv])
    return run_service(args, layout)


def _unit_lines(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v
    return out


def test_install_writes_the_unit_and_says_what_to_run_next(
    layout: Layout, units: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert service(layout, "install") == 0
    out = capsys.readouterr().out
    unit = units / "trio-agentd.service"
    assert f"wrote {unit}" in out
    assert "systemctl --user daemon-reload && systemctl --user enable --now trio-agentd" in out
    assert "loginctl enable-linger $USER" in out
    assert not (units / "trio-agentd.socket").exists()
    v = _unit_lines(unit)
    assert v["Type"] == "notify"
    assert v["KillMode"] == "process"
    assert v["Restart"] == "on-failure"
    assert v["WatchdogSec"] == str(SERVICE_WATCHDOG_SEC)
    argv = shlex.split(v["ExecStart"])
    assert argv[0] == sys.executable
    assert os.path.isabs(argv[0])
    assert argv[1:] == ["-E", "-P", "-m", "trio_agentd", "--socket", layout.socket,
                        "--home", str(layout.home), "--registry", str(layout.registry),
                        "daemon"]
    assert "Requires" not in v


def test_status_says_missing_current_and_differs(
    layout: Layout, units: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert service(layout, "status") == 1
    assert "not installed" in capsys.readouterr().out
    assert service(layout, "install") == 0
    capsys.readouterr()
    assert service(layout, "status") == 0
    assert f"service unit {units / 'trio-agentd.service'}: current" in capsys.readouterr().out
    # another socket (or home, or Python): the unit installed is not this one's
    other = Layout(home=layout.home, socket=str(tmp_path / "other.sock"),
                   registry=layout.registry)
    assert service(other, "status") == 1
    out = capsys.readouterr().out
    assert "differs from what this installation writes" in out
    assert f"it runs:       {sys.executable} -E -P -m trio_agentd --socket {layout.socket}" in out
    assert f"this would run: {sys.executable} -E -P -m trio_agentd --socket {other.socket}" in out
    assert "run `trio-agentd service install`" in out
    # edited by hand
    unit = units / "trio-agentd.service"
    unit.write_text(unit.read_text().replace("RestartSec=1", "RestartSec=5"))
    assert service(layout, "status") == 1
    assert "differs" in capsys.readouterr().out
    assert service(layout, "install") == 0
    assert f"rewrote {unit}" in capsys.readouterr().out
    assert service(layout, "install") == 0
    assert f"unchanged {unit}" in capsys.readouterr().out


def test_install_with_socket_activation_writes_a_matching_socket_unit(
    layout: Layout, units: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert service(layout, "install", "--socket-activation") == 0
    out = capsys.readouterr().out
    assert "systemctl --user enable --now trio-agentd.socket" in out
    s = _unit_lines(units / "trio-agentd.socket")
    assert s["ListenStream"] == layout.socket
    assert (s["SocketMode"], s["DirectoryMode"]) == ("0600", "0700")
    v = _unit_lines(units / "trio-agentd.service")
    assert (v["Requires"], v["After"]) == ("trio-agentd.socket", "trio-agentd.socket")
    assert service(layout, "status") == 0
    out = capsys.readouterr().out
    assert "socket unit" in out
    assert ": current" in out
    # installing again without it removes the socket unit: no stale activation left
    assert service(layout, "install") == 0
    assert not (units / "trio-agentd.socket").exists()
    assert "Requires" not in _unit_lines(units / "trio-agentd.service")


def test_uninstall_removes_both_and_is_quiet_when_nothing_is_there(
    layout: Layout, units: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert service(layout, "install", "--socket-activation") == 0
    capsys.readouterr()
    assert service(layout, "uninstall") == 0
    out = capsys.readouterr().out
    assert f"removed {units / 'trio-agentd.service'}" in out
    assert f"removed {units / 'trio-agentd.socket'}" in out
    # both units: an enabled socket unit would go on listening
    assert "systemctl --user disable --now trio-agentd.socket trio-agentd &&" in out
    assert list(units.iterdir()) == []
    assert service(layout, "uninstall") == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_uninstall_of_nothing_on_a_read_only_dir_says_nothing_to_remove(
    layout: Layout, units: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))  # what Linux says

    monkeypatch.setattr(Path, "unlink", read_only)
    assert service(layout, "uninstall") == 0
    assert capsys.readouterr().out == f"no trio-agentd unit in {units}: nothing to remove\n"


def test_unit_dir_honours_an_absolute_xdg_config_home_only() -> None:
    assert unit_dir({"XDG_CONFIG_HOME": "/c", "HOME": "/h"}) == Path("/c/systemd/user")
    assert unit_dir({"XDG_CONFIG_HOME": "rel", "HOME": "/h"}) == Path(
        "/h/.config/systemd/user")
    assert unit_dir({"HOME": "/h"}) == Path("/h/.config/systemd/user")


def test_exec_quote_survives_systemd_word_splitting_and_specifiers() -> None:
    assert exec_quote("/usr/bin/python3") == "/usr/bin/python3"
    assert exec_quote("/a b/py") == '"/a b/py"'
    assert exec_quote("/50%/$HOME") == "/50%%/$$HOME"
    assert exec_quote('/x"y\\z') == '"/x\\"y\\\\z"'


def test_a_path_with_a_newline_is_one_clear_line(
    tmp_path: Path, units: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = Layout(home=tmp_path / "h\nx", socket=str(tmp_path / "d.sock"), registry=tmp_path)
    assert service(bad, "install") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("trio-agentd: error: cannot write")
    assert "control character" in err
    assert not (units / "trio-agentd.service").exists()


def test_an_unwritable_config_dir_is_one_clear_line(
    layout: Layout, units: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    units.parent.parent.mkdir(parents=True)
    units.parent.write_text("a file where a dir should be")
    assert service(layout, "install") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("trio-agentd: error: cannot write")


def _fake_systemctl(tmp_path: Path, status: int = 0) -> Path:
    log = tmp_path / "systemctl.log"
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    script = b / "systemctl"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit {status}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return log


def test_systemctl_runs_only_when_asked(
    layout: Layout, units: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _fake_systemctl(tmp_path)
    assert service(layout, "install") == 0
    assert not log.exists()
    assert service(layout, "install", "--systemctl") == 0
    assert log.read_text().splitlines() == ["--user daemon-reload",
                                            "--user enable --now trio-agentd"]
    log.unlink()
    assert service(layout, "uninstall", "--systemctl") == 0
    assert log.read_text().splitlines() == ["--user disable --now trio-agentd",
                                            "--user daemon-reload"]


def test_systemctl_missing_or_failing_is_one_clear_line(
    layout: Layout, units: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert service(layout, "install", "--systemctl") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "systemctl is not found on PATH" in err
    assert (units / "trio-agentd.service").exists()  # the file is written all the same
    _fake_systemctl(tmp_path, status=4)
    assert service(layout, "install", "--systemctl") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "exited 4" in err


def test_render_is_deterministic_for_a_layout(layout: Layout) -> None:
    a = render_service(layout, socket_activation=False)
    assert a == render_service(layout, socket_activation=False)
    assert a != render_service(layout, socket_activation=True)


def test_installed_python_reads_back_what_exec_quote_wrote() -> None:
    for python in ("/usr/bin/python3", "/opt/my env/bin/python", '/x"y\\z/50%/$v/python'):
        text = render_service(Layout(home="/h", socket="/s.sock", registry="/r"),
                              socket_activation=False, python=python)
        assert installed_python(text) == python
    assert installed_python("[Service]\nType=notify\n") is None


def test_a_unit_written_by_another_name_of_this_python_is_current(
    layout: Layout, units: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a venv's python and python3: one interpreter, two names (the console script runs one,
    # `python -m` the other)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").symlink_to(sys.executable)
    (venv / "python").symlink_to("python3")
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    assert service(layout, "install") == 0
    monkeypatch.setattr(sys, "executable", str(venv / "python3"))
    capsys.readouterr()
    assert service(layout, "status") == 0
    assert service(layout, "install") == 0
    assert "unchanged" in capsys.readouterr().out
    # the same interpreter in another environment is another installation
    other = tmp_path / "other" / "bin"
    other.mkdir(parents=True)
    (other / "python3").symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(other / "python3"))
    assert service(layout, "status") == 1
