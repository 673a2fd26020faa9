"""An autostarted supervisor starts its worker fork template before it builds its argparse
parser (the first prompt waits on the template), and only once."""

from __future__ import annotations

import os
from typing import Any

import pytest

from trio_agentd import _cli_daemon, _cli_parser, _earlytemplate, cli
from trio_agentd._paths import Layout


class _Stop(Exception):
    pass


AUTOSTARTED = ["--socket", "/nonexistent/s.sock", "--home", "/nonexistent/h", "--registry",
               "/nonexistent/r", "daemon", "--autostarted"]


def test_the_template_starts_before_the_parser_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_earlytemplate, "start", lambda: calls.append("template"))

    def build_parser() -> object:
        calls.append("parser")
        raise _Stop

    monkeypatch.setattr(_cli_parser, "build_parser", build_parser)
    # the autostart's form with -v in it: argparse reads it, after the template started
    with pytest.raises(_Stop):
        cli.run(["-v", *AUTOSTARTED])
    assert calls == ["template", "parser"]
    calls.clear()
    # any other command (a prompt whose text is "daemon" too) starts none
    with pytest.raises(_Stop):
        cli.run(["daemon", "--help"])
    assert calls == ["parser"]


def test_the_autostarted_daemon_builds_no_parser_and_gets_what_argparse_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one form the autostart writes runs the daemon without argparse, with the same
    arguments argparse reads from it."""
    calls: list[str] = []
    got: list[Any] = []
    monkeypatch.setattr(_earlytemplate, "start", lambda: calls.append("template"))
    monkeypatch.setattr(_cli_parser, "build_parser", lambda: calls.append("parser"))
    monkeypatch.setattr(_cli_daemon, "daemon_settings", lambda: {})

    def cmd_daemon(layout: Layout, args: Any) -> int:
        got.append((layout, args))
        return 0

    monkeypatch.setattr(_cli_daemon, "cmd_daemon", cmd_daemon)
    monkeypatch.setattr(os, "chdir", lambda path: calls.append(f"chdir {path}"))
    assert cli.run(list(AUTOSTARTED)) == 0
    assert calls == ["chdir /", "template"]
    layout, fast = got[0]
    assert layout == Layout.resolve(socket="/nonexistent/s.sock", home="/nonexistent/h",
                                    registry="/nonexistent/r")
    monkeypatch.undo()
    parsed = vars(_cli_parser.build_parser().parse_args(AUTOSTARTED))
    mine = vars(fast)
    mine.pop("supervisor_options", None)
    assert {k: parsed[k] for k in mine} == mine
    assert {k for k, v in parsed.items() if v not in (None, False)} <= set(mine)
    # anything else is argparse's to read
    for other in (AUTOSTARTED[:-1], ["--home", *AUTOSTARTED[3:4], *AUTOSTARTED[:2],
                                     *AUTOSTARTED[4:]], [*AUTOSTARTED[:1], "-v", *AUTOSTARTED[2:]]):
        assert cli.autostarted_args(other) is None


def test_a_second_start_starts_no_second_template(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []

    def posix_spawn(path: str, argv: list[str], env: dict[str, str], **kwargs: object) -> int:
        started.append(argv)
        return 999_999_999

    monkeypatch.setattr(os, "posix_spawn", posix_spawn)
    monkeypatch.setattr(_earlytemplate, "_early", None)
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    _earlytemplate.start()
    _earlytemplate.start()
    assert len(started) == 1
    assert started[0][-2:] == ["trio_agentd.worker", _earlytemplate.TEMPLATE_FLAG]
    early = _earlytemplate.take()
    assert early is not None
    assert early.pid == 999_999_999
    os.close(early.sock_fd)
    assert _earlytemplate.take() is None


def test_no_template_under_socket_activation(monkeypatch: pytest.MonkeyPatch) -> None:
    def posix_spawn(*args: object, **kwargs: object) -> int:
        raise AssertionError("started a template")

    monkeypatch.setattr(os, "posix_spawn", posix_spawn)
    monkeypatch.setattr(_earlytemplate, "_early", None)
    monkeypatch.setenv("LISTEN_FDS", "1")
    _earlytemplate.start()
    assert _earlytemplate.take() is None


def test_a_failed_spawn_leaves_nothing_open(monkeypatch: pytest.MonkeyPatch) -> None:
    def posix_spawn(*args: object, **kwargs: object) -> int:
        raise OSError(11, "Resource temporarily unavailable")

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "posix_spawn", posix_spawn)
    monkeypatch.setattr(_earlytemplate, "_early", None)
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    _earlytemplate.start()
    assert _earlytemplate.take() is None
    assert set(os.listdir("/proc/self/fd")) == before


def _wait_exit(pid: int) -> None:
    """Until ``pid`` (our child) has exited, without reaping it (a pidfd turns readable)."""
    import select

    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], 30)[0], "the child did not exit in 30 s"
    finally:
        os.close(fd)


def test_a_spawned_child_reports_its_status_once_reaped() -> None:
    """:class:`_earlytemplate.Child` (what ``posix_spawn`` gives the autostart and the fork
    server in place of a ``Popen``): ``None`` while it runs, then its status, as
    ``Popen.poll`` gives it (a signal as its negative number), reaped once."""
    import signal
    import sys

    slow = os.posix_spawn(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"],
                          dict(os.environ))
    child = _earlytemplate.Child(slow)
    assert child.poll() is None
    os.kill(slow, signal.SIGKILL)
    _wait_exit(slow)
    assert child.poll() == -signal.SIGKILL
    assert child.poll() == -signal.SIGKILL  # (reaped: asked again, the same answer)
    with pytest.raises(ChildProcessError):
        os.waitpid(slow, os.WNOHANG)
    done = os.posix_spawn(sys.executable, [sys.executable, "-c", "raise SystemExit(3)"],
                          dict(os.environ))
    _wait_exit(done)
    assert _earlytemplate.Child(done).poll() == 3
