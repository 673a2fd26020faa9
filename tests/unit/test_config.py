"""The config file: parsing and checking (pure), precedence, what a supervisor is handed, and
the Configuration table of docs/operations.md against the code's keys."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from trio_agentd import _config
from trio_agentd._config import ConfigError, Setting
from trio_agentd.timing import DEFAULT_TIMING, Timing

WHERE = "/home/u/.config/trio-agentd/config.toml"
DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_a_good_file_gives_every_key_it_sets_checked() -> None:
    got = _config.loads(
        'default_agent = "exec:my-agent --model x"\nself_heal = false\n'
        "[limits]\nmax_clients = 8\nmax_sessions = 3\n"
        "[logs]\nmax_bytes = 0\nbackups = 2\n"
        "[timing]\nidle_eviction = 0\nstop_grace = 1\nworker_retry_delays = [0, 0.5]\n"
        "restart_intensity = 7\n",
        WHERE,
    )
    assert got == {
        "default_agent": "exec:my-agent --model x", "self_heal": False,
        "limits.max_clients": 8, "limits.max_sessions": 3,
        "logs.max_bytes": 0, "logs.backups": 2,
        "timing.idle_eviction": 0.0, "timing.stop_grace": 1.0,
        "timing.worker_retry_delays": (0.0, 0.5), "timing.restart_intensity": 7,
    }


@pytest.mark.parametrize(("text", "message"), [
    ("[timing\n", f"{WHERE}: not valid TOML: "),
    ("colour = 1\n", f"{WHERE}: unknown key 'colour'; see `trio-agentd config` for every key"),
    ("[limits]\nmax_session = 3\n",
     f"{WHERE}: unknown key 'limits.max_session'; limits has: max_clients, max_sessions"),
    ("[timing]\nidle_evict = 3\n", f"{WHERE}: unknown key 'timing.idle_evict'; timing has: "),
    ("[limits]\nmax_sessions = 0\n",
     f"{WHERE}: limits.max_sessions must be a whole number >= 1 (got 0)"),
    ("[limits]\nmax_sessions = 2.5\n",
     f"{WHERE}: limits.max_sessions must be a whole number >= 1 (got 2.5)"),
    ("[limits]\nmax_sessions = true\n",
     f"{WHERE}: limits.max_sessions must be a whole number >= 1 (got true)"),
    ("[logs]\nbackups = 0\n", f"{WHERE}: logs.backups must be a whole number >= 1 (got 0)"),
    ("self_heal = 1\n", f"{WHERE}: self_heal must be true or false (got 1)"),
    ("default_agent = 3\n", f"{WHERE}: default_agent must be an agent spec: echo, shell,"
     " exec:COMMAND or module:attr (got 3)"),
    ('default_agent = "bogus"\n', f"{WHERE}: default_agent: unknown agent 'bogus'"),
    ("[timing]\nidle_eviction = nan\n", f"{WHERE}: timing.idle_eviction must be a finite number"
     " of seconds >= 0.01 (or 0: off) (got NaN)"),
    ("[timing]\ngrant_ttl = inf\n", f"{WHERE}: timing.grant_ttl must be a finite number of"
     " seconds >= 0.01 (got Infinity)"),
    ("[timing]\nself_check_interval = 0.001\n", f"{WHERE}: timing.self_check_interval must be"
     " a finite number of seconds >= 0.01 (got 0.001)"),
    ('[timing]\nstop_grace = "5"\n', f"{WHERE}: timing.stop_grace must be a finite number of"
     ' seconds >= 0 (got "5")'),
    ("[timing]\nworker_retry_delays = [1, -1]\n", f"{WHERE}: timing.worker_retry_delays must"
     " be a list of finite seconds, each >= 0 (got [1, -1])"),
    ("[timing]\nrestart_intensity = 1.5\n", f"{WHERE}: timing.restart_intensity must be a"
     " whole number >= 0 (got 1.5)"),
    ("[timing.deep]\nx = 1\n", f"{WHERE}: unknown key 'timing.deep'"),
])
def test_a_bad_file_is_one_line_naming_file_key_and_fault(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config.loads(text, WHERE)
    assert info.value.message.startswith(message)
    assert "\n" not in info.value.message


def test_read_file_none_when_missing_and_one_line_when_not_utf8(tmp_path: Path) -> None:
    assert _config.read_file(str(tmp_path / "none.toml")) is None
    bad = tmp_path / "config.toml"
    bad.write_bytes(b'default_agent = "\xff"\n')
    with pytest.raises(ConfigError, match=r"config\.toml: not UTF-8 \(byte 17\)"):
        _config.read_file(str(bad))


@pytest.mark.timeout(10)  # a FIFO that hangs the read fails here, not at the suite's limit
def test_read_file_refuses_what_is_no_regular_file_without_hanging(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    os.mkfifo(path)  # a plain open() waits for a writer forever: the daemon would never start
    with pytest.raises(ConfigError, match=r"config\.toml: a FIFO \(named pipe\), not a regular"
                       " file — put the settings in a file there, or remove it"):
        _config.read_file(str(path))
    path.unlink()
    path.mkdir()
    with pytest.raises(ConfigError, match=r"config\.toml: a directory, not a regular file"):
        _config.read_file(str(path))
    path.rmdir()
    path.symlink_to("/dev/zero")  # endless: never read past the cap, whatever it is
    with pytest.raises(ConfigError, match=r"config\.toml: a character device, not a regular"):
        _config.read_file(str(path))
    path.unlink()
    path.write_bytes(b"#" * (_config.MAX_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match=r"config\.toml: 1048577 bytes, more than a config"
                       r" file may be \(1048576 bytes\)"):
        _config.read_file(str(path))
    path.write_bytes(b"#" * _config.MAX_FILE_BYTES)
    assert _config.read_file(str(path)) == {}


def test_config_path_follows_xdg_config_home_when_absolute() -> None:
    assert _config.config_path({"XDG_CONFIG_HOME": "/x/cfg"}) == "/x/cfg/trio-agentd/config.toml"
    for env in ({}, {"XDG_CONFIG_HOME": ""}, {"XDG_CONFIG_HOME": "rel/dir"}):
        assert _config.config_path(env).endswith("/.config/trio-agentd/config.toml")


def test_environment_beats_file_beats_default() -> None:
    file_values = {"logs.backups": 4, "logs.max_bytes": 100, "timing.idle_eviction": 60.0,
                   "timing.stop_grace": 1.0, "limits.max_sessions": 9}
    env = {"TRIO_AGENTD_LOG_BACKUPS": "7", "TRIO_AGENTD_TIMING": '{"stop_grace": 2}',
           "TRIO_AGENTD_SELF_HEAL": "0"}
    got = _config.resolve(file_values, WHERE, env)
    assert got["logs.backups"] == Setting("logs.backups", 7, "env TRIO_AGENTD_LOG_BACKUPS")
    assert got["logs.max_bytes"] == Setting("logs.max_bytes", 100, WHERE)
    assert got["timing.stop_grace"] == Setting("timing.stop_grace", 2.0,
                                               "env TRIO_AGENTD_TIMING")
    assert got["timing.idle_eviction"] == Setting("timing.idle_eviction", 60.0, WHERE)
    assert got["self_heal"] == Setting("self_heal", False, "env TRIO_AGENTD_SELF_HEAL")
    assert got["limits.max_sessions"] == Setting("limits.max_sessions", 9, WHERE)
    assert got["default_agent"] == Setting("default_agent", "echo", "default")
    assert set(got) == {k.name for k in _config.KEYS}


@pytest.mark.parametrize(("env", "message"), [
    ({"TRIO_AGENTD_TIMING": "{"}, "TRIO_AGENTD_TIMING is not JSON"),
    ({"TRIO_AGENTD_TIMING": '{"nope": 1}'}, "TRIO_AGENTD_TIMING has unknown fields: ['nope']"),
    ({"TRIO_AGENTD_TIMING": '{"default_agent": 1}'}, "unknown fields: ['default_agent']"),
    ({"TRIO_AGENTD_TIMING": '{"stop_grace": NaN}'},
     "TRIO_AGENTD_TIMING: stop_grace must be a finite number of seconds >= 0 (got NaN)"),
    ({"TRIO_AGENTD_LOG_BACKUPS": "0"}, "TRIO_AGENTD_LOG_BACKUPS must be a whole number >= 1"),
    ({"TRIO_AGENTD_LOG_MAX_BYTES": "1e6"}, "TRIO_AGENTD_LOG_MAX_BYTES must be a whole number"),
    # the supervisor would read "off" as on: refused, not silently inverted
    ({"TRIO_AGENTD_SELF_HEAL": "off"}, "TRIO_AGENTD_SELF_HEAL must be 0, false or no (off), or"
     " 1, true or yes (on) (got 'off')"),
    ({"TRIO_AGENTD_SELF_HEAL": "maybe"}, "TRIO_AGENTD_SELF_HEAL must be 0, false or no"),
])
def test_a_bad_variable_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config.resolve({}, WHERE, env)
    assert message in info.value.message


def test_self_heal_words_the_supervisor_knows() -> None:
    for word, on in (("0", False), (" No ", False), ("FALSE", False), ("1", True),
                     ("yes", True), ("True", True)):
        got = _config.resolve({}, WHERE, {"TRIO_AGENTD_SELF_HEAL": word})
        assert got["self_heal"] == Setting("self_heal", on, "env TRIO_AGENTD_SELF_HEAL"), word
    # set but empty: as unset
    assert _config.resolve({}, WHERE, {"TRIO_AGENTD_SELF_HEAL": ""})["self_heal"].source == (
        "default")


def test_the_daemon_hands_the_files_values_on_through_the_variables_workers_read() -> None:
    file_values = {"logs.backups": 4, "logs.max_bytes": 100, "timing.idle_eviction": 60.0,
                   "timing.stop_grace": 1.0, "self_heal": False, "limits.max_clients": 5}
    env = {"TRIO_AGENTD_LOG_BACKUPS": "7", "TRIO_AGENTD_TIMING": '{"stop_grace": 2}'}
    settings = _config.resolve(file_values, WHERE, env)
    out = _config.daemon_environment(settings, env)
    # the environment's own values are kept; the file fills in the rest
    assert out == {
        "TRIO_AGENTD_LOG_MAX_BYTES": "100", "TRIO_AGENTD_SELF_HEAL": "0",
        "TRIO_AGENTD_TIMING": json.dumps({"idle_eviction": 60.0, "stop_grace": 2.0},
                                         sort_keys=True),
    }
    assert _config.supervisor_options(settings) == {
        "default_agent": "echo", "max_clients": 5, "max_sessions": 1000}
    # nothing from a file: nothing to set
    assert _config.daemon_environment(_config.resolve({}, WHERE, env), env) == {}


def test_effective_timing_merges_file_and_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "trio-agentd" / "config.toml"
    cfg.parent.mkdir()
    cfg.write_text("[timing]\nhandover_wait = 3\nupgrade_idle = 4\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path), "TRIO_AGENTD_TIMING": '{"upgrade_idle": 5}'}
    got = _config.effective_timing(env)
    assert (got.handover_wait, got.upgrade_idle) == (3.0, 5.0)
    assert got.stop_grace == DEFAULT_TIMING.stop_grace


def test_every_timing_field_has_a_key() -> None:
    import dataclasses

    assert {f"timing.{f.name}" for f in dataclasses.fields(Timing)} == {
        k.name for k in _config.KEYS if k.name.startswith("timing.")}


def _doc_table() -> dict[str, tuple[str, str]]:
    """The Configuration section's table: ``{key: (variable, default)}``."""
    text = (DOCS / "operations.md").read_text()
    section = text[text.index("## Configuration"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        m = re.match(r"\| `([a-z_.]+)` \| ([^|]*) \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows


def test_the_docs_list_every_key_with_its_variable_and_default() -> None:
    rows = _doc_table()
    assert set(rows) == {k.name for k in _config.KEYS}
    for key in _config.KEYS:
        env, default = rows[key.name]
        assert env == (f"`{key.env}`" if key.env else "—"), key.name
        assert default == f"`{json.dumps(key.default)}`", key.name


def test_read_file_names_a_dangling_symlink_in_place_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.symlink_to(tmp_path / "moved" / "config.toml")
    with pytest.raises(_config.ConfigError) as err:
        _config.read_file(str(path))
    assert str(err.value) == (
        f"{path}: a symlink to {str(tmp_path / 'moved' / 'config.toml')!r}, which does not"
        " exist — point it at the config file, or remove it")
