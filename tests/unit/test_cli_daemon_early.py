"""An autostarted supervisor starts its worker fork template before it builds its argparse
parser (the first prompt waits on the template), and only once."""

from __future__ import annotations

import subprocess

import pytest

from trio_agentd import _cli_parser, _forkserver, cli


class _Stop(Exception):
    pass


def test_the_template_starts_before_the_parser_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_forkserver, "start_early", lambda: calls.append("template"))

    def build_parser() -> object:
        calls.append("parser")
        raise _Stop

    monkeypatch.setattr(_cli_parser, "build_parser", build_parser)
    with pytest.raises(_Stop):
        cli.run(["--socket", "/nonexistent/s.sock", "--home", "/nonexistent/h", "--registry",
                 "/nonexistent/r", "daemon", "--autostarted"])
    assert calls == ["template", "parser"]
    calls.clear()
    # any other command (a prompt whose text is "daemon" too) starts none
    with pytest.raises(_Stop):
        cli.run(["daemon", "--help"])
    assert calls == ["parser"]


def test_a_second_start_early_starts_no_second_template(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []

    class Popen:
        def __init__(self, argv: list[str], **kwargs: object) -> None:
            started.append(argv)

    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.setattr(_forkserver, "_early", None)
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    _forkserver.start_early()
    _forkserver.start_early()
    assert len(started) == 1
    early = _forkserver._take_early()
    assert early is not None
    early[1].close()
