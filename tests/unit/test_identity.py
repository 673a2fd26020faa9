"""Start ids are the same whatever time namespace the observer is in (trio_agentd._identity)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trio_agentd import _identity

BOOT = "0b1e2c3d-aaaa-bbbb-cccc-000000000001"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _fake_proc(root: Path, *, starttime: int, offsets: str | None) -> Path:
    (root / "sys" / "kernel" / "random").mkdir(parents=True)
    (root / "sys" / "kernel" / "random" / "boot_id").write_text(BOOT + "\n")
    (root / "4242").mkdir()
    # comm with spaces and a ')': the fields are counted after the last ')'
    fields = ["S"] + ["0"] * 18 + [str(starttime)] + ["0"] * 10
    (root / "4242" / "stat").write_text(f"4242 (we ird) name) {' '.join(fields)}\n")
    (root / "self").mkdir()
    if offsets is not None:
        (root / "self" / "timens_offsets").write_text(offsets)
    return root


@pytest.fixture
def fake_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc start ids are Linux's")
    monkeypatch.setattr(_identity, "_boot_id", None)
    monkeypatch.setattr(_identity, "_boottime_offset_ticks", None)


@pytest.mark.usefixtures("fake_proc")
@pytest.mark.parametrize(("offsets", "shown"), [
    (None, 650557),  # a kernel without time namespaces
    ("monotonic           0         0\nboottime            0         0\n", 650557),
    ("monotonic           0         0\nboottime         1000         0\n", 650557 + 1000 * CLK_TCK),
    ("monotonic          50         0\nboottime          -20         0\n", 650557 - 20 * CLK_TCK),
    ("boottime            3 500000000\n", 650557 + 3 * CLK_TCK + CLK_TCK // 2),
])
def test_the_start_id_takes_off_the_observers_boottime_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offsets: str | None, shown: int
) -> None:
    # the kernel shows starttime plus the reader's boottime offset: every observer, in a time
    # namespace or not, must name the process alike
    monkeypatch.setattr(_identity, "_PROC", str(_fake_proc(tmp_path, starttime=shown,
                                                            offsets=offsets)))
    assert _identity.read_start_id(4242) == f"{BOOT}:650557"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1)")
def test_an_observer_in_a_time_namespace_reads_the_same_start_id() -> None:
    # a real time namespace with boottime 1000 s ahead (needs CAP_SYS_ADMIN: root here)
    probe = subprocess.run(["unshare", "--time", "--fork", "--boottime", "1000", "true"],
                           capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare --time is not permitted here: {probe.stderr.decode().strip()}")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        code = (f"from trio_agentd._identity import read_start_id, own_start_id\n"
                f"print(read_start_id({child.pid}))\nprint(read_start_id({os.getpid()}))")
        inside = subprocess.run(
            ["unshare", "--time", "--fork", "--boottime", "1000", sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.split()
        assert inside == [_identity.read_start_id(child.pid), _identity.own_start_id()]
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd on this platform")
def test_wait_gone_returns_when_the_process_exits_not_at_its_next_look() -> None:
    """``shutdown`` waits on its supervisor with a pidfd: the wait ends with the exit, however
    long the period between looks."""
    import time

    look_every = 30.0
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        start_id = _identity.read_start_id(child.pid)
        assert _identity.is_alive(child.pid, start_id)
        assert child.stdin is not None
        child.stdin.close()  # it exits now; the wait below began before that or just after
        t0 = time.monotonic()
        assert _identity.wait_gone(child.pid, start_id, 2 * look_every, poll=look_every)
        assert time.monotonic() - t0 < look_every / 2
    finally:
        child.kill()
        child.wait()
