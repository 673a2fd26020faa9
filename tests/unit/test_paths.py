"""Locations and the socket-directory checks (trio_agentd._paths)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agentd._errors import AgentdError
from trio_agentd._paths import (
    SUN_PATH_MAX,
    Layout,
    check_socket_path,
    default_home,
    default_registry_dir,
    default_socket,
    default_socket_dir,
    normalize_socket_path,
    socket_key,
)

ENV_VARS = (
    "TRIO_AGENTD_HOME",
    "TRIO_AGENTD_SOCKET",
    "TRIO_AGENTD_REGISTRY_DIR",
    "XDG_RUNTIME_DIR",
    "XDG_STATE_HOME",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- normalize_socket_path --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spelling", "normal"),
    [
        ("/run/user/1000/trio-agentd/daemon.sock", "/run/user/1000/trio-agentd/daemon.sock"),
        ("//run//user/1000///trio-agentd/daemon.sock", "/run/user/1000/trio-agentd/daemon.sock"),
        ("/run/user/x/../1000/./trio-agentd/daemon.sock", "/run/user/1000/trio-agentd/daemon.sock"),
        ("//a", "/a"),
        ("///a", "/a"),
        ("/../../a", "/a"),
        ("/a/b/", "/a/b"),
        ("/", "/"),
        ("//", "/"),
    ],
)
def test_normalize_socket_path(spelling: str, normal: str) -> None:
    assert normalize_socket_path(spelling) == normal


def test_normalize_socket_path_makes_relative_paths_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    real = str(tmp_path)
    assert normalize_socket_path("d.sock") == f"{real}/d.sock"
    assert normalize_socket_path("./x/../d.sock") == f"{real}/d.sock"
    assert normalize_socket_path(Path("sub") / "d.sock") == f"{real}/sub/d.sock"


def test_normalize_socket_path_does_not_resolve_symlinks(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert normalize_socket_path(tmp_path / "link" / "d.sock") == f"{tmp_path}/link/d.sock"


segments = st.text(
    alphabet=st.characters(exclude_characters="/\x00", exclude_categories=["Cs"]),
    min_size=1,
    max_size=8,
).filter(lambda s: s not in {".", ".."})


@given(
    parts=st.lists(segments, min_size=1, max_size=6),
    slashes=st.lists(st.integers(min_value=1, max_value=3), min_size=7, max_size=7),
    detours=st.lists(st.booleans() | segments, min_size=6, max_size=6),
)
def test_normalize_socket_path_equal_for_spellings_with_dotdot_and_double_slash(
    parts: list[str], slashes: list[int], detours: list[bool | str]
) -> None:
    canonical = "/" + "/".join(parts)
    spelled = ""
    for i, part in enumerate(parts):
        spelled += "/" * slashes[i]
        detour = detours[i]
        if isinstance(detour, str):
            spelled += detour + "/" * slashes[i + 1] + ".." + "/"
        elif detour:
            spelled += "./"
        spelled += part
    assert normalize_socket_path(spelled) == canonical
    assert normalize_socket_path(canonical) == canonical


@given(st.text(alphabet="/.ab", max_size=24))
def test_normalize_socket_path_is_idempotent(path: str) -> None:
    once = normalize_socket_path("/" + path)
    assert normalize_socket_path(once) == once
    assert once.startswith("/")
    assert "//" not in once
    assert ".." not in once.split("/")
    assert "." not in once.split("/")


# --- socket_key and Layout --------------------------------------------------------------------


def test_socket_key_is_12_hex_of_sha256() -> None:
    assert socket_key("/run/user/1000/trio-agentd/daemon.sock") == "51a6f2933dc0"
    assert socket_key("/tmp/a.sock") == hashlib.sha256(b"/tmp/a.sock").hexdigest()[:12]
    assert socket_key("/tmp/a.sock") != socket_key("/tmp/b.sock")


def test_layout_paths(tmp_path: Path) -> None:
    L = Layout.resolve(
        socket="/run/user/1000/trio-agentd//daemon.sock", home="/h/state", registry="/h/reg"
    )
    assert L.socket == "/run/user/1000/trio-agentd/daemon.sock"
    assert L.home == Path("/h/state")
    assert L.registry == Path("/h/reg")
    assert L.key == "51a6f2933dc0"
    assert L.socket_dir == "/run/user/1000/trio-agentd"
    assert L.lease_path == "/run/user/1000/trio-agentd/daemon.sock.lock"
    assert L.state_dir == Path("/h/state/daemons/51a6f2933dc0")
    assert L.workers_dir == Path("/h/state/daemons/51a6f2933dc0/workers")
    assert L.journal_dir == Path("/h/state/daemons/51a6f2933dc0/journal")
    assert L.generations_dir == Path("/h/state/daemons/51a6f2933dc0/generations")
    assert L.log_path == Path("/h/state/daemons/51a6f2933dc0/daemon.log")
    assert L.sessions_dir == Path("/h/state/sessions")
    assert L.session_dir("s1") == Path("/h/state/sessions/s1")
    assert L.descriptor_path("s1") == Path("/h/state/daemons/51a6f2933dc0/workers/s1.json")
    assert L.token_path("s1") == Path("/h/state/daemons/51a6f2933dc0/workers/s1.token")
    assert L.journal_path("s1") == Path("/h/state/daemons/51a6f2933dc0/journal/s1.jsonl")
    digest = hashlib.sha256(b"s1").hexdigest()[:10]
    assert L.worker_socket("s1") == f"/run/user/1000/trio-agentd/w-51a6f293-{digest}.sock"


def test_layout_worker_sockets_differ_per_session_and_stay_short() -> None:
    L = Layout.resolve(socket="/s/d.sock", home="/h", registry="/r")
    assert L.worker_socket("a") != L.worker_socket("b")
    assert len(os.path.basename(L.worker_socket("x" * 500))) == len("w-12345678-1234567890.sock")


def test_layout_resolves_relative_home_and_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    L = Layout.resolve(socket="d.sock", home="home", registry="reg/../reg2")
    assert L.socket == f"{tmp_path}/d.sock"
    assert L.home == tmp_path / "home"
    assert L.registry == tmp_path / "reg2"


def test_layout_defaults_from_environment(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("TRIO_AGENTD_HOME", "/env/home")
    clean_env.setenv("TRIO_AGENTD_SOCKET", "/env//sock/../d.sock")
    clean_env.setenv("TRIO_AGENTD_REGISTRY_DIR", "/env/registry")
    L = Layout.resolve()
    assert (L.home, L.socket, L.registry) == (
        Path("/env/home"),
        "/env/d.sock",
        Path("/env/registry"),
    )


def test_flags_win_over_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TRIO_AGENTD_HOME", "/env/home")
    clean_env.setenv("TRIO_AGENTD_SOCKET", "/env/d.sock")
    clean_env.setenv("TRIO_AGENTD_REGISTRY_DIR", "/env/registry")
    L = Layout.resolve(socket="/flag/d.sock", home="/flag/home", registry="/flag/reg")
    assert (L.home, L.socket, L.registry) == (
        Path("/flag/home"),
        "/flag/d.sock",
        Path("/flag/reg"),
    )


def test_default_home_and_registry_are_per_user_state(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    assert default_home() == tmp_path / "xdg-state" / "trio-agentd"
    assert default_registry_dir() == tmp_path / "xdg-state" / "trio-agentd" / "supervisor-owners"


@pytest.mark.parametrize("xdg", [None, "", "relative/state", "/abs/state"])
@pytest.mark.parametrize("home", ["/home/someone", "/home/other/"])
def test_the_state_dir_is_where_platformdirs_puts_it(
    clean_env: pytest.MonkeyPatch, xdg: str | None, home: str
) -> None:
    """Written out (the import of platformdirs cost ps more than finding the home), the XDG
    rule gives what platformdirs gives: a relative XDG_STATE_HOME is ignored."""
    import platformdirs

    clean_env.setenv("HOME", home)
    if xdg is not None:
        clean_env.setenv("XDG_STATE_HOME", xdg)
    expected = Path(platformdirs.user_state_dir("trio-agentd"))
    assert default_home() == expected
    assert default_registry_dir() == expected / "supervisor-owners"


def test_registry_does_not_follow_home(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    clean_env.setenv("TRIO_AGENTD_HOME", "/custom/home")
    assert default_home() == Path("/custom/home")
    assert default_registry_dir() == tmp_path / "xdg-state" / "trio-agentd" / "supervisor-owners"


def test_default_registry_is_not_under_the_temp_dir(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("HOME", "/home/someone")
    registry = default_registry_dir()
    assert registry == Path("/home/someone/.local/state/trio-agentd/supervisor-owners")
    assert not registry.is_relative_to(tempfile.gettempdir())


def test_default_socket_in_xdg_runtime_dir(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_dir() == f"{tmp_path}/trio-agentd"
    assert default_socket() == f"{tmp_path}/trio-agentd/daemon.sock"


def test_default_socket_in_tempdir_without_runtime_dir(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setattr(tempfile, "tempdir", "/short-tmp")
    uid = os.getuid()
    assert default_socket_dir() == f"/short-tmp/trio-agentd-{uid}"
    assert default_socket() == f"/short-tmp/trio-agentd-{uid}/daemon.sock"
    # A runtime dir that does not exist is not used.
    clean_env.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert default_socket_dir() == f"/short-tmp/trio-agentd-{uid}"


# --- check_socket_path ------------------------------------------------------------------------


def test_sun_path_max_is_107() -> None:
    assert SUN_PATH_MAX == 107


def _path_of(size: int, *, tail: str = "") -> str:
    filler = size - 1 - len(os.fsencode(tail))
    return "/" + "a" * filler + tail


def test_check_socket_path_accepts_107_bytes() -> None:
    path = _path_of(107)
    assert len(path) == 107
    check_socket_path(path)


@pytest.mark.parametrize("size", [108, 109, 200, 4096])
def test_check_socket_path_refuses_108_bytes_and_more_naming_107(size: int) -> None:
    path = _path_of(size)
    with pytest.raises(AgentdError) as info:
        check_socket_path(path)
    err = info.value
    assert err.code == "config"
    assert "107-byte sun_path limit" in err.message
    assert f"socket path is {size} bytes" in err.message
    assert err.details == {"limit": 107, "length": size}


def test_check_socket_path_counts_bytes_not_characters() -> None:
    path = _path_of(108, tail="é")  # 107 characters, 108 bytes
    assert len(path) == 107
    with pytest.raises(AgentdError, match="108 bytes"):
        check_socket_path(path)
