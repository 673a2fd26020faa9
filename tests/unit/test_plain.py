"""The plain value classes of the ps path (trio_agentd._plain) and the record time parser."""

from __future__ import annotations

import ast
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trio_agentd
from trio_agentd._doctor import utc_epoch
from trio_agentd._doctor_plan import Hello, Status, Verdict
from trio_agentd._ownership import OwnerRecord, Phase
from trio_agentd._plain import replace

V = Verdict(status=Status.CURRENT, generation="g1", pid=7, start_id="b:1")


def test_equal_by_fields_hashable_and_frozen() -> None:
    same = Verdict(status=Status.CURRENT, generation="g1", pid=7, start_id="b:1")
    assert same == V
    assert hash(same) == hash(V)
    assert len({V, same}) == 1
    assert replace(V, pid=8) != V
    assert Hello(generation="g1", pid=7, start_id="b:1", protocol=1, app_version="x") != V
    with pytest.raises(AttributeError):
        V.pid = 9
    with pytest.raises(AttributeError):
        del V.pid
    assert repr(V) == ("Verdict(cause=None, generation='g1', pid=7, start_id='b:1',"
                       " status=<Status.CURRENT: 'current'>)")


def test_replace_refuses_an_unknown_field() -> None:
    with pytest.raises(TypeError, match="no field 'nope'"):
        replace(V, nope=1)


def test_owner_record_round_trips_and_changes_phase() -> None:
    rec = OwnerRecord(version=1, generation="g", token="t", pid=1, start_id=None, socket="/s",
                      home="/h", state_dir="/d", app_version="0.1.0", protocol=1,
                      phase=Phase.OWNER, created_at="c", updated_at="u")
    assert OwnerRecord.from_json(rec.to_json()) == rec
    later = rec.with_phase(Phase.STOPPING, "v")
    assert (later.phase, later.updated_at, later.generation) == (Phase.STOPPING, "v", "g")
    assert b'"phase": "stopping"' in later.to_json()


def test_ps_imports_no_dataclasses_pathlib_socket_signal_json_enum_or_repairs() -> None:
    """What ps and doctor load: each of these costs more than the rest of a ps (modules the
    interpreter had loaded before do not count); the repairs only with ``--fix``. ``enum``
    and ``contextlib`` (with ``collections`` and ``functools``, which they import) cost about
    a third of a ps's instructions with 20 supervisors."""
    code = ("import sys; before = set(sys.modules);"
            " from trio_agentd import _cli_look, _report, cli, _doctor, _trust; "
            "print(sorted(m for m in ('dataclasses', 'pathlib', 'socket', 'signal', 'inspect',"
            " 'datetime', 'hashlib', 'platformdirs', 'typing', 'json', 're', 'enum',"
            " 'contextlib', 'collections', 'functools',"
            " 'trio_agentd._doctor_repair') if m in set(sys.modules) - before))")
    # -S: without site (an editable install's import hook loads re)
    env = {"PYTHONPATH": str(Path(trio_agentd.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.strip() == "[]"


def test_ps_runs_without_pathlib_platformdirs_or_tempfile(tmp_path: Path) -> None:
    """A whole ``ps --json`` (not just its imports) in a private home with no supervisor: the
    default home and registry are found without ``pathlib`` or ``platformdirs`` (which
    brings ``tempfile``, ``random`` and ``shutil``)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    code = ("import sys; sys.argv = ['trio-agentd', 'ps', '--json'];"
            " from trio_agentd.cli import run; code = run(sys.argv[1:]);"
            " print(sorted(m for m in ('pathlib', 'platformdirs', 'tempfile')"
            " if m in sys.modules), file=sys.stderr); sys.exit(code)")
    env = {"PYTHONPATH": str(Path(trio_agentd.__file__).parents[1]), "HOME": str(tmp_path),
           "XDG_RUNTIME_DIR": str(run), "PATH": os.environ.get("PATH", "")}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr
    assert out.returncode == 0, out.stderr


_TIMES = st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31))


@given(_TIMES, st.sampled_from(["milliseconds", "microseconds", "seconds"]),
       st.sampled_from(["Z", "+00:00"]))
def test_utc_epoch_agrees_with_datetime(when: dt.datetime, spec: str, suffix: str) -> None:
    text = when.isoformat(timespec=spec) + suffix
    parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    expected = (parsed - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)).total_seconds()
    assert utc_epoch(text) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("text", [
    "", "garbage", "2024-01-01T00:00:00", "2024-01-01T00:00:00+02:00", "2024-02-30T00:00:00Z",
    "2024-13-01T00:00:00Z", "2024-01-01T24:00:00Z", "2024-01-01 00:00:00Z",
    "2024-01-01T00:00:00.Z", "2024-01-01T00:00:00.1x2Z", "\uff12\uff10\uff12\uff14-01-01T00:00:00Z",
    "+024-01-01T00:00:00Z",
])
def test_utc_epoch_refuses_other_shapes(text: str) -> None:
    assert utc_epoch(text) is None


@given(st.text(max_size=70) | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,66}", fullmatch=True))
def test_session_id_rule_is_the_regular_expression(value: str) -> None:
    import re

    from trio_agentd._sessionid import is_session_id

    rule = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
    assert is_session_id(value) == (rule.fullmatch(value) is not None)


def test_peer_uid_is_ours() -> None:
    import os
    import socket

    from trio_agentd._trust import peer_uid

    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_uid(a) == os.getuid()


def test_the_warm_prompt_imports_only_c_modules_beyond_the_interpreter() -> None:
    """What ``trio-agentd -p`` loads besides the package and what site loads: three C
    modules (the JSON accelerator, the socket module's C half, itertools): no ``re``, no
    ``json``, no ``enum`` (the error codes are :class:`._plain.StrEnum`). ``-S``: without
    site (an editable install's import hook loads ``re``)."""
    env = {"PYTHONPATH": str(Path(trio_agentd.__file__).parents[1])}
    code = ("import sys; before = set(sys.modules); {}; print(sorted(m for m in "
            "set(sys.modules) - before if not m.startswith('trio_agentd')))")
    warm = ("import trio_agentd.cli, trio_agentd._cli_prompt, trio_agentd._syncclient,"
            " trio_agentd._identity")
    loaded = [ast.literal_eval(subprocess.run(
        [sys.executable, "-S", "-c", code.format(imports)], capture_output=True, text=True,
        check=True, env=env).stdout) for imports in ("import __future__, os", warm)]
    assert sorted(set(loaded[1]) - set(loaded[0])) == ["_json", "_socket", "itertools"]


def test_the_process_scan_imports_no_pathlib_or_re(tmp_path: Path) -> None:
    """The scan runs whenever an unnamed socket of ours listens (another program's, often):
    it must not bring in pathlib and, with it, re, fnmatch and urllib."""
    (tmp_path / "run").mkdir(mode=0o700)
    code = ("import sys; from trio_agentd import _doctor; from trio_agentd._paths import Layout;"
            " before = set(sys.modules);"
            f" _doctor.survey(Layout(home={str(tmp_path / 'h')!r},"
            f" socket={str(tmp_path / 's' / 'd.sock')!r}, registry={str(tmp_path / 'r')!r}),"
            " scan=True);"
            " print(sorted(m for m in ('pathlib', 're', 'json')"
            " if m in set(sys.modules) - before))")
    env = {"PYTHONPATH": str(Path(trio_agentd.__file__).parents[1]),
           "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.strip() == "[]"
