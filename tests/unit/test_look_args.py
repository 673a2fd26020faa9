"""``ps``, ``status``, ``doctor`` and ``shutdown`` are parsed without argparse (building the
parser cost more than their own work): the namespace is the one argparse makes, and anything
unusual still goes to argparse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trio_agentd import _cli_args, _cli_parser

SAME = [
    ["ps"],
    ["ps", "--json"],
    ["status", "--json"],
    ["doctor"],
    ["doctor", "--fix"],
    ["doctor", "--dry-run", "--json"],
    ["doctor", "--json", "--fix", "--dry-run"],
    ["--socket", "/s/d.sock", "ps"],
    ["--socket=/s/d.sock", "--home", "/h", "--registry", "/r", "-v", "doctor", "--fix"],
    ["--daemon-socket", "/s/d.sock", "--verbose", "ps", "--json"],
    ["-v", "-v", "status"],
    ["shutdown"],
    ["shutdown", "--json"],
    ["--socket", "/s/d.sock", "shutdown", "--all", "--force", "--json"],
]

TO_ARGPARSE = [
    ["ps", "-h"],
    ["ps", "--js"],  # an abbreviation argparse accepts
    ["doctor", "--force"],
    ["shutdown", "--al"],
    ["shutdown", "--fix"],
    ["ps", "extra"],
    ["--home", "/a", "--home", "/b", "ps"],  # argparse: the last wins
    ["--socket", "/a", "--daemon-socket", "/b", "ps"],
    ["--hom", "/a", "ps"],
    ["sessions"],
    ["prompt", "hi"],
    [],
]


@pytest.mark.parametrize("argv", SAME)
def test_the_namespace_is_argparses(argv: list[str]) -> None:
    at = _cli_args.command_index(argv)
    look = _cli_args.look_args(argv, at)
    assert look is not None
    assert vars(look) == vars(_cli_parser.build_parser().parse_args(argv))


@pytest.mark.parametrize("argv", TO_ARGPARSE)
def test_anything_else_goes_to_argparse(argv: list[str]) -> None:
    assert _cli_args.look_args(argv, _cli_args.command_index(argv)) is None


def _run_alone(tmp_path: Path, argv: list[str]) -> list[str]:
    """``cli.run(argv)`` in a fresh interpreter with no daemon; what it printed, then its exit
    status and whether argparse was imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRIO_AGENTD_", "XDG_"))}
    env.update(HOME=str(tmp_path), TRIO_AGENTD_HOME=str(tmp_path / "h"),
               TRIO_AGENTD_REGISTRY_DIR=str(tmp_path / "r"),
               TRIO_AGENTD_SOCKET=str(tmp_path / "s" / "d.sock"),
               XDG_RUNTIME_DIR=str(tmp_path))
    code = (f"import sys; from trio_agentd import cli; rc = cli.run({argv!r});"
            " print(rc, 'argparse' in sys.modules)")
    cp = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=60, check=True)
    return cp.stdout.splitlines()


def test_ps_imports_no_argparse(tmp_path: Path) -> None:
    assert _run_alone(tmp_path, ["ps", "--json"])[-1] == "0 False"


def test_shutdown_imports_no_argparse(tmp_path: Path) -> None:
    """``shutdown`` is timed from its start to everything gone: no parser is built first."""
    assert _run_alone(tmp_path, ["shutdown", "--json"]) == ["[]", "0 False"]
