"""``DaemonEnv``'s process readers, on a fake ``/proc`` (trio_agentd.testing._daemon reads
through ``trio_agentd._identity``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trio_agentd import _identity
from trio_agentd.testing._daemon import DaemonEnv

TEMPLATE_ARGV = b"/usr/bin/python3\0-m\0trio_agentd.worker\0--template\0"


def _process(
    proc: Path, pid: int, *, parent: int, session: int, cmdline: bytes, environ: bytes
) -> None:
    (proc / str(pid)).mkdir()
    # comm with spaces and a ')': the fields are counted after the last ')'
    fields = ["S", str(parent), str(session), str(session)] + ["0"] * 26
    (proc / str(pid) / "stat").write_text(f"{pid} (py (x) y) {' '.join(fields)}\n")
    (proc / str(pid) / "cmdline").write_bytes(cmdline)
    (proc / str(pid) / "environ").write_bytes(environ)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DaemonEnv:
    proc = tmp_path / "proc"
    proc.mkdir()
    denv = DaemonEnv(tmp_path / "root")
    marker = denv.marker + b"\0"
    _process(proc, 100, parent=103, session=50, cmdline=TEMPLATE_ARGV,
             environ=marker)  # a template
    _process(proc, 101, parent=100, session=101, cmdline=TEMPLATE_ARGV,
             environ=marker)  # a spare
    _process(proc, 102, parent=1, session=102, cmdline=TEMPLATE_ARGV,
             environ=marker)  # a worker (its template gone)
    _process(proc, 103, parent=1, session=50, cmdline=b"python3\0-m\0trio_agentd\0daemon\0",
             environ=marker)  # the supervisor
    _process(proc, 105, parent=100, session=50, cmdline=TEMPLATE_ARGV,
             environ=marker)  # a spare forked a moment ago: no session of its own yet
    monkeypatch.setattr(_identity, "_PROC", str(proc))
    # 104: gone between the listing and the reads
    monkeypatch.setattr(DaemonEnv, "our_pids", lambda self: [100, 101, 102, 103, 104, 105])
    descriptors: list[dict[str, Any]] = [{"pid": 102}]
    monkeypatch.setattr(DaemonEnv, "descriptors", lambda self: descriptors)
    return denv


def test_fork_templates_are_the_template_processes_in_their_supervisors_session(
    env: DaemonEnv,
) -> None:
    assert env.fork_templates() == [100]


def test_spare_workers_are_forked_by_a_template_and_have_no_descriptor(env: DaemonEnv) -> None:
    """A spare leads its own session once it has called ``setsid``; one forked a moment ago
    has not, and its parent, a template, says what it is."""
    assert env.spare_workers() == [101, 105]


def test_the_proc_readers_split_the_entries_and_say_none_for_a_gone_process(
    env: DaemonEnv,
) -> None:
    assert _identity.proc_cmdline(100) == [
        b"/usr/bin/python3", b"-m", b"trio_agentd.worker", b"--template"]
    assert env.marker in _identity.proc_environ(100)
    fields = _identity.proc_stat_fields(100)
    assert fields is not None
    assert fields[:4] == [b"S", b"103", b"50", b"50"]
    assert _identity.proc_cmdline(104) is None
    assert _identity.proc_environ(104) == []
    assert _identity.proc_stat_fields(104) is None
