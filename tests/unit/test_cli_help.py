"""The CLI explains itself: --version, the overview of a bare ``trio-agentd``, a description and
examples in every subcommand's help, the agent forms, shell completion scripts."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from trio_agentd import _cli_exit, _cli_parser, cli
from trio_agentd._version import PROTOCOL_VERSION


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    found = _choices(_cli_parser.build_parser())
    assert found, "no subcommands"
    return found


SUBPARSERS = _subparsers()
# a command's own actions (``service install``) are subcommands too, each with its own help
NESTED = {f"{name} {action}": sub for name, parser in SUBPARSERS.items()
          for action, sub in _choices(parser).items()}


def test_version_names_the_installed_package_and_the_protocol(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.run(["--version"]) == _cli_exit.EXIT_OK
    assert capsys.readouterr().out == (
        f"trio-agentd {version('trio-agentd')} (protocol {PROTOCOL_VERSION})\n")
    # after global options too, and argparse's way gives the same
    assert cli.run(["--home", "/tmp/x", "--version"]) == _cli_exit.EXIT_OK
    assert cli.run(["-v", "--version", "ps"]) == _cli_exit.EXIT_OK
    assert capsys.readouterr().out.count("(protocol ") == 2


def test_version_and_ps_import_neither_trio_nor_the_parser_nor_the_config_reader(
    tmp_path: Path,
) -> None:
    code = (
        "import sys\nfrom trio_agentd import cli\n"
        "assert cli.run(['--version']) == 0\n"
        "assert cli.run(['ps', '--json']) == 0\n"
        "heavy = {'trio', 'argparse', 'tomllib', 'shtab', 'trio_agentd._config'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    env = {**os.environ, "TRIO_AGENTD_HOME": str(tmp_path / "h"),
           "TRIO_AGENTD_SOCKET": str(tmp_path / "s" / "d.sock"),
           "TRIO_AGENTD_REGISTRY_DIR": str(tmp_path / "r"),
           "XDG_RUNTIME_DIR": str(tmp_path / "run"), "XDG_CONFIG_HOME": str(tmp_path / "c")}
    (tmp_path / "c" / "trio-agentd").mkdir(parents=True)
    (tmp_path / "c" / "trio-agentd" / "config.toml").write_text("[timing]\nstop_grace = 1\n")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert got.stdout.splitlines()[-1] == "[]"


def test_a_bare_command_prints_the_overview_and_exits_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.run([]) == _cli_exit.EXIT_OK
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in SUBPARSERS:
        if name == "prompt":
            continue  # shown as -p
        assert any(line.split()[:1] == [name] for line in lines), name
    assert any(line.strip().startswith("-p TEXT") for line in lines)
    examples = lines[lines.index("examples:") + 1 :]
    assert examples[0].strip().startswith("trio-agentd -p hello")
    assert examples[1].strip().startswith("trio-agentd -p -s build --agent shell")


@pytest.mark.parametrize("name", sorted({**SUBPARSERS, **NESTED}))
def test_every_subcommand_has_a_description_and_an_example(name: str) -> None:
    sub = {**SUBPARSERS, **NESTED}[name]
    assert len(sub.description or "") > 40, name
    epilog = sub.epilog or ""
    examples = epilog.split("examples:\n", 1)[1].split("\n\n", 1)[0]
    assert f"trio-agentd {'-p' if name == 'prompt' else name}" in examples
    assert isinstance(sub.formatter_class, type)
    assert issubclass(sub.formatter_class, argparse.RawDescriptionHelpFormatter)


def test_help_exits_0_and_shows_the_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["logs", "--help"]) == _cli_exit.EXIT_OK
    out = capsys.readouterr().out
    assert "examples:\n  trio-agentd logs build -n 3\n" in out
    assert cli.run(["-p", "--help"]) == _cli_exit.EXIT_OK
    assert "examples:\n  trio-agentd -p hello\n" in capsys.readouterr().out


def test_agent_help_lists_every_form(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["-p", "--help"]) == _cli_exit.EXIT_OK
    out = capsys.readouterr().out
    agent_help = out[out.index("  --agent AGENT") : out.index("  --cwd DIR")]
    for form in ("echo", "shell", "exec:COMMAND", "module:attr"):
        assert form in agent_help
    forms = out[out.index("agents (--agent") :].splitlines()
    for form in ("echo", "shell", "exec:COMMAND", "module:attr"):
        assert any(line.split()[:1] == [form] for line in forms), form


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts_know_every_subcommand(
    shell: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(["completion", shell]) == _cli_exit.EXIT_OK
    script = capsys.readouterr().out
    for name in SUBPARSERS:
        assert name in script, name
    assert "dry-run" in script


def test_bash_completion_completes_a_subcommand_and_its_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.fail("bash is needed to check the bash completion script")
    assert cli.run(["completion", "bash"]) == _cli_exit.EXIT_OK
    script = tmp_path / "trio-agentd.bash"
    script.write_text(capsys.readouterr().out)
    check = (
        f"source {script}\n"
        "complete_words() { COMP_WORDS=(\"$@\"); COMP_CWORD=$(($# - 1)); COMPREPLY=();"
        " _shtab_trio_agentd; echo \"${COMPREPLY[*]}\"; }\n"
        "complete_words trio-agentd doc\n"
        "complete_words trio-agentd doctor --d\n"
        "complete_words trio-agentd completion ''\n"
    )
    got = subprocess.run([bash, "-c", check], capture_output=True, text=True, timeout=30,
                         check=True)
    assert got.stdout.splitlines() == ["doctor", "--dry-run", "bash zsh fish"]


def test_completion_without_shtab_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "shtab", None)  # import shtab raises ImportError
    assert cli.run(["completion", "bash"]) == _cli_exit.EXIT_FAIL
    assert capsys.readouterr().err == (
        "trio-agentd: error: shell completion needs the shtab package — install it"
        " (pip install shtab) next to trio-agentd\n")


def test_config_prints_every_key_and_its_source(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    from trio_agentd import _config

    path = tmp_path / "trio-agentd" / "config.toml"
    path.parent.mkdir()
    path.write_text('default_agent = "shell"\n[timing]\nidle_eviction = 0\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("TRIO_AGENTD_LOG_BACKUPS", "3")
    monkeypatch.delenv("TRIO_AGENTD_TIMING", raising=False)
    assert cli.run(["config", "--json"]) == _cli_exit.EXIT_OK
    got = json.loads(capsys.readouterr().out)
    assert (got["file"], got["file_exists"]) == (str(path), True)
    assert set(got["settings"]) == {k.name for k in _config.KEYS}
    assert got["settings"]["default_agent"] == {"value": "shell", "source": str(path)}
    assert got["settings"]["timing.idle_eviction"] == {"value": 0.0, "source": str(path)}
    assert got["settings"]["logs.backups"] == {"value": 3,
                                               "source": "env TRIO_AGENTD_LOG_BACKUPS"}
    assert got["settings"]["limits.max_sessions"] == {"value": 1000, "source": "default"}
    assert cli.run(["config"]) == _cli_exit.EXIT_OK
    table = capsys.readouterr().out.splitlines()
    assert table[0] == f"config file: {path}"
    assert table[1].split() == ["KEY", "VALUE", "FROM"]
    assert ["default_agent", '"shell"', str(path)] in [row.split() for row in table]

    path.write_text("[limits]\nmax_sessions = 0\n")
    assert cli.run(["config"]) == _cli_exit.EXIT_FAIL
    err = capsys.readouterr().err
    assert err == (f"trio-agentd: error: {path}: limits.max_sessions must be a whole number"
                   " >= 1 (got 0)\n")
