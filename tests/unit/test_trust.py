"""The trust boundary: directory, file and peer proofs (faked stats and peers), dir creation."""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_agentd import _fs
from trio_agentd._errors import AgentdError
from trio_agentd._trust import (
    agent_environment,
    agent_import_path,
    daemon_knobs,
    dir_problem,
    file_problem,
    isolated_python,
    make_private_dirs,
    prove_peer,
    prove_socket_dir,
    session_environment,
)

ME = 1000


def _st(kind: int, mode: int, uid: int = ME) -> os.stat_result:
    """A faked stat result: only mode and uid matter to the verdicts."""
    return os.stat_result((kind | mode, 1, 1, 1, uid, uid, 0, 0, 0, 0))


# --- pure verdicts on faked stats ----------------------------------------------------------------


def test_a_private_dir_of_ours_is_trusted() -> None:
    assert dir_problem(_st(stat.S_IFDIR, 0o700), ME, private=True) is None


@pytest.mark.parametrize("mode", [0o710, 0o701, 0o750, 0o705, 0o711, 0o755, 0o777])
def test_a_socket_dir_with_any_group_or_other_bit_is_refused(mode: int) -> None:
    problem = dir_problem(_st(stat.S_IFDIR, mode), ME, private=True)
    assert problem == f"has mode {mode:04o} (group or others may use it), not 0700"


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o711, 0o700])
def test_a_state_dir_others_can_only_read_is_trusted(mode: int) -> None:
    assert dir_problem(_st(stat.S_IFDIR, mode), ME, private=False) is None


@pytest.mark.parametrize("mode", [0o720, 0o702, 0o777, 0o1777])
def test_a_state_dir_others_can_write_in_is_refused(mode: int) -> None:
    problem = dir_problem(_st(stat.S_IFDIR, mode), ME, private=False)
    assert problem is not None
    assert "may write in it" in problem


def test_a_dir_of_another_uid_is_refused_even_if_private() -> None:
    problem = dir_problem(_st(stat.S_IFDIR, 0o700, uid=ME + 1), ME, private=True)
    assert problem == f"is owned by uid {ME + 1}, not by you (uid {ME})"


def test_a_symlink_is_never_a_socket_dir() -> None:
    assert dir_problem(_st(stat.S_IFLNK, 0o777), ME, private=True) == "is a symlink"


def test_a_file_is_not_a_dir() -> None:
    assert dir_problem(_st(stat.S_IFREG, 0o700), ME, private=True) == "is not a directory"


def test_a_state_file_of_ours_is_trusted_even_if_others_read_it() -> None:
    assert file_problem(_st(stat.S_IFREG, 0o644), ME) is None


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_state_file_others_can_write_is_refused(mode: int) -> None:
    problem = file_problem(_st(stat.S_IFREG, mode), ME)
    assert problem == f"has mode {mode:04o} (group or others may write it)"


def test_a_state_file_of_another_uid_is_refused() -> None:
    assert file_problem(_st(stat.S_IFREG, 0o600, uid=0), ME) == (
        f"is owned by uid 0, not by you (uid {ME})"
    )


# --- the socket dir proof ------------------------------------------------------------------------


def test_prove_socket_dir_accepts_our_0700_dir(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    prove_socket_dir(str(d))


def test_prove_socket_dir_of_a_missing_dir_means_nobody_listens(tmp_path: Path) -> None:
    with pytest.raises(AgentdError) as info:
        prove_socket_dir(str(tmp_path / "nope"))
    assert info.value.code == "daemon_unavailable"


def test_prove_socket_dir_refuses_0755_naming_path_mode_and_fix(tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    os.chmod(d, 0o755)
    with pytest.raises(AgentdError) as info:
        prove_socket_dir(str(d))
    assert info.value.code == "permission_denied"
    assert info.value.message == (
        f"socket directory {d} has mode 0755 (group or others may use it), not 0700 (owner uid"
        f" {os.getuid()}, mode 0755) — not trusted, nothing was sent; remove it (rm -r {d}) or"
        f" run: chmod 700 {d}"
    )
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o755  # refused, never changed


def test_prove_socket_dir_refuses_a_symlink_to_a_private_dir(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "s"
    link.symlink_to(real)
    with pytest.raises(AgentdError, match=r"is a symlink \(owner uid \d+, mode 0777\) — not"):
        prove_socket_dir(str(link))


def test_prove_socket_dir_of_another_uid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.lstat(d).st_uid + 1)  # we are someone else
    with pytest.raises(AgentdError) as info:
        prove_socket_dir(str(d))
    assert f"is owned by uid {os.lstat(d).st_uid}" in info.value.message
    assert "use another --socket" in info.value.message


# --- the peer proof ------------------------------------------------------------------------------


class _FakePeer:
    def __init__(self, uid: int) -> None:
        self.uid = uid

    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes:
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_PEERCRED)
        return struct.pack("3i", 4242, self.uid, self.uid)


def test_prove_peer_accepts_our_uid() -> None:
    prove_peer(_FakePeer(os.getuid()), "/run/x.sock")


def test_prove_peer_refuses_another_uid_naming_socket_and_uid() -> None:
    with pytest.raises(AgentdError) as info:
        prove_peer(_FakePeer(os.getuid() + 7), "/run/x.sock")
    assert info.value.code == "permission_denied"
    assert info.value.message.startswith(
        f"socket /run/x.sock is served by a process of uid {os.getuid() + 7}, not yours"
    )


def test_prove_peer_on_a_real_socketpair_is_us() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        prove_peer(a, "pair")


# --- making dirs ---------------------------------------------------------------------------------


@pytest.fixture
def umask_000() -> Iterator[None]:
    """The worst umask a client can start us with."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_every_created_dir_is_0700_parents_included(tmp_path: Path, umask_000: None) -> None:
    target = tmp_path / "a" / "b" / "c"
    make_private_dirs(target)
    for d in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert _mode(d) == 0o700, d


def test_a_created_socket_dir_is_0700_with_trailing_slash(tmp_path: Path, umask_000: None) -> None:
    target = tmp_path / "sock"
    make_private_dirs(f"{target}/", private=True)
    assert _mode(target) == 0o700


def test_existing_parents_are_left_as_they_are(tmp_path: Path) -> None:
    parent = tmp_path / "p"
    parent.mkdir()
    os.chmod(parent, 0o755)
    make_private_dirs(parent / "child")
    assert _mode(parent) == 0o755
    assert _mode(parent / "child") == 0o700


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o777])
def test_an_existing_socket_dir_that_fails_is_refused_not_chmodded(
    tmp_path: Path, mode: int
) -> None:
    target = tmp_path / "sock"
    target.mkdir()
    os.chmod(target, mode)
    with pytest.raises(AgentdError) as info:
        make_private_dirs(target, private=True)
    assert info.value.code == "permission_denied"
    assert f"socket directory {target} has mode {mode:04o}" in info.value.message
    assert _mode(target) == mode


def test_an_existing_state_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "sessions"
    target.mkdir()
    os.chmod(target, 0o777)
    with pytest.raises(AgentdError, match=r"directory .*sessions has mode 0777"):
        make_private_dirs(target)


def test_a_symlinked_state_dir_is_proven_by_its_target(tmp_path: Path) -> None:
    real = tmp_path / "disk"
    real.mkdir(mode=0o700)
    link = tmp_path / "home"
    link.symlink_to(real)
    make_private_dirs(link)  # a home moved to another disk
    os.chmod(real, 0o777)
    with pytest.raises(AgentdError):
        make_private_dirs(link)


def test_a_symlink_is_never_a_socket_dir_even_to_a_private_one(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "sock"
    link.symlink_to(real)
    with pytest.raises(AgentdError, match="is a symlink"):
        make_private_dirs(link, private=True)


def test_a_dangling_symlink_is_not_followed_to_create_a_dir(tmp_path: Path) -> None:
    # mkdir never follows a symlink: an attacker's link to a dir they will create is refused
    link = tmp_path / "sock"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(AgentdError):
        make_private_dirs(link, private=True)
    assert not (tmp_path / "elsewhere").exists()


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "sock"
    target.write_bytes(b"")
    with pytest.raises(AgentdError, match="is not a directory"):
        make_private_dirs(target, private=True)


# --- trusted reads -------------------------------------------------------------------------------


def test_read_bytes_reads_our_file(tmp_path: Path) -> None:
    f = tmp_path / "owner.json"
    f.write_bytes(b"{}")
    os.chmod(f, 0o600)
    assert _fs.read_bytes(f) == b"{}"
    assert _fs.read_bytes(tmp_path / "missing") is None


def test_read_bytes_refuses_a_file_others_can_write(tmp_path: Path) -> None:
    f = tmp_path / "session.json"
    f.write_bytes(b'{"agent": "exec:/tmp/evil.sh"}')
    os.chmod(f, 0o666)
    with pytest.raises(_fs.UntrustedFile, match=r"has mode 0666 .* not trusted"):
        _fs.read_bytes(f)


def test_read_bytes_refuses_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_bytes(b"{}")
    os.chmod(real, 0o600)
    link = tmp_path / "owner.json"
    link.symlink_to(real)
    with pytest.raises(_fs.UntrustedFile, match="is a symlink"):
        _fs.read_bytes(link)


def test_read_bytes_refuses_a_file_of_another_uid(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    f = tmp_path / "d.json"
    f.write_bytes(b"{}")
    os.chmod(f, 0o600)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(f).st_uid + 1)
    with pytest.raises(_fs.UntrustedFile, match="is owned by uid"):
        _fs.read_bytes(f)


def test_an_untrusted_file_counts_as_corrupt_for_readers() -> None:
    # readers that refuse corrupt files (ValueError) refuse untrusted ones the same way
    assert issubclass(_fs.UntrustedFile, ValueError)


# --- what reaches an agent -----------------------------------------------------------------------


def test_agent_environment_drops_every_daemon_variable() -> None:
    env = {"PATH": "/bin", "TRIO_AGENTD_ADMISSION_TICKET": "t", "TRIO_AGENTD_HOME": "/h",
           "TRIO_AGENTD_TIMING": "{}", "MY": "1"}
    assert agent_environment(env) == {"PATH": "/bin", "MY": "1"}


def test_session_environment_is_the_recorded_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONLY_IN_DAEMON", "1")
    meta: dict[str, object] = {"env": {"A": "1", "TRIO_AGENTD_SOCKET": "/s"}}
    assert session_environment(meta) == {"A": "1"}


@pytest.mark.parametrize("bad", [None, "PATH=/bin", {"A": 1}, [["A", "1"]]])
def test_session_environment_falls_back_to_the_daemons_own(
    monkeypatch: pytest.MonkeyPatch, bad: object
) -> None:
    monkeypatch.setenv("ONLY_IN_DAEMON", "1")
    monkeypatch.setenv("TRIO_AGENTD_ADMISSION_TICKET", "secret")
    env = session_environment({"env": bad})
    assert env["ONLY_IN_DAEMON"] == "1"
    assert "TRIO_AGENTD_ADMISSION_TICKET" not in env


def test_daemon_knobs_are_only_the_workers_own() -> None:
    env = {"TRIO_AGENTD_TIMING": "{}", "TRIO_AGENTD_ADMISSION_TICKET": "t", "X": "1"}
    assert daemon_knobs(env) == {"TRIO_AGENTD_TIMING": "{}"}


def test_agent_import_path_is_cwd_then_pythonpath_relative_to_cwd() -> None:
    env = {"PYTHONPATH": f"lib{os.pathsep}/abs{os.pathsep}{os.pathsep}/proj"}
    assert agent_import_path("/proj", env) == ("/proj", "/proj/lib", "/abs")


def test_isolated_python_never_imports_from_the_cwd_or_python_variables() -> None:
    argv = isolated_python("trio_agentd.worker")
    assert argv[1:] == ["-E", "-P", "-m", "trio_agentd.worker"]
