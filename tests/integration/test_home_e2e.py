"""One home per socket: a client whose home was set explicitly (``--home``, ``TRIO_AGENTD_HOME``,
``open_client(home=...)``) refuses a supervisor serving another home, naming both."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

import trio_agentd
from trio_agentd import AgentdError

from .harness import DaemonEnv, failure_status


def test_cli_with_another_home_is_refused_naming_both(denv: DaemonEnv) -> None:
    assert denv.prompt("hi") == "[echo turn 1] hi"  # a supervisor of home A (the env's)
    other = denv.root / "other-home"
    for args, env, source in (
        (["--home", str(other), "-p", "x"], {}, "--home"),
        (["-p", "x", "--home", str(other)], {}, "--home"),
        (["--home", str(other), "sessions"], {}, "--home"),
        (["-p", "x"], {"TRIO_AGENTD_HOME": str(other)}, "TRIO_AGENTD_HOME"),
    ):
        cp = denv.run(*args, env=env)
        assert cp.returncode == failure_status(cp), (args, cp.stderr)
        assert cp.stdout == ""
        err = cp.stderr
        assert err.count("\n") == 1, err
        assert f"serves home {denv.home}, not {other} (set by {source})" in err, err
        assert denv.socket in err
    assert not other.exists()  # nothing was written for home B
    # the same home, spelled differently (trailing slash, a symlink), is that home
    link = denv.root / "link-home"
    link.symlink_to(denv.home)
    assert denv.run("--home", f"{denv.home}/", "-p", "y").returncode == 0
    cp = denv.run("-p", "z", env={"TRIO_AGENTD_HOME": str(link)})
    assert cp.returncode == 0, cp.stderr

    # no home set at all: the client takes the supervisor's, as before
    env = {k: v for k, v in denv.env.items() if k != "TRIO_AGENTD_HOME"}
    cp = subprocess.run(denv.argv("-p", "again"), env=env, capture_output=True, text=True,
                        timeout=60, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == "[echo turn 4] again\n"


async def test_open_client_with_another_home_is_refused(denv: DaemonEnv) -> None:
    other = denv.root / "other-home"
    with trio.fail_after(60):
        async with trio_agentd.open_client(
            denv.socket, home=str(denv.home), registry=str(denv.registry)
        ) as client:
            assert client.hello.home == str(denv.home)
            with pytest.raises(AgentdError) as info:
                async with trio_agentd.open_client(denv.socket, home=str(other), autostart=False):
                    pass  # pragma: no cover
    assert info.value.code == "config"
    assert f"serves home {denv.home}, not {other} (set by home=)" in info.value.message
    assert not await trio.Path(other).exists()


# --- an unusable home: one line naming the cause and what to set ---------------------------

_NO_PASSWD = (  # the CLI as run by a uid without a passwd entry: "~" does not expand
    "import pwd, sys\n"
    "def _none(uid): raise KeyError(uid)\n"
    "pwd.getpwuid = _none\n"
    "from trio_agentd.cli import main\n"
    "sys.argv[0] = 'trio-agentd'\n"
    "main()\n"
)


def _run_bare(env: DaemonEnv, *args: str, home: str | None, no_passwd: bool = False,
              extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI with no TRIO_AGENTD_HOME / REGISTRY_DIR / XDG_STATE_HOME: HOME decides."""
    bare = {k: v for k, v in env.env.items()
            if k not in ("TRIO_AGENTD_HOME", "TRIO_AGENTD_REGISTRY_DIR", "XDG_STATE_HOME", "HOME")}
    if home is not None:
        bare["HOME"] = home
    bare.update(extra or {})
    argv = ([sys.executable, "-c", _NO_PASSWD, *args] if no_passwd else env.argv(*args))
    return subprocess.run(argv, env=bare, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, cwd=env.root)


def _one_line_error(cp: subprocess.CompletedProcess[str]) -> str:
    assert cp.returncode == failure_status(cp), (cp.returncode, cp.stdout, cp.stderr)
    assert cp.stdout == ""
    assert cp.stderr.count("\n") == 1, cp.stderr
    assert cp.stderr.startswith("trio-agentd: error: ")
    return cp.stderr


@pytest.mark.parametrize("command", [["-p", "hi"], ["sessions"], ["ps"], ["doctor"]])
def test_a_home_that_cannot_be_created_is_named_with_what_to_set(
    denv: DaemonEnv, command: list[str]
) -> None:
    blocker = denv.root / "a-file"
    blocker.write_text("")
    home = f"{blocker}/home"
    err = _one_line_error(_run_bare(denv, *command, home=home))
    assert f"{blocker} is not a directory" in err, err
    assert f"the home comes from HOME={home}" in err, err
    assert "set --home or TRIO_AGENTD_HOME to a directory you can write, or fix HOME" in err
    assert not os.path.exists(denv.socket)  # nothing was started
    # a flag names itself
    err = _one_line_error(denv.run("--home", f"{blocker}/h", *command))
    assert f"{blocker} is not a directory — set --home to a directory you can write" in err, err


@pytest.mark.parametrize("command", [["-p", "hi"], ["ps"], ["doctor"]])
@pytest.mark.parametrize(("home", "cause"), [
    (None, "HOME is unset and uid"), ("", "HOME='' is not an absolute path"),
])
def test_no_home_at_all_is_named_with_what_to_set(
    denv: DaemonEnv, command: list[str], home: str | None, cause: str
) -> None:
    err = _one_line_error(_run_bare(denv, *command, home=home, no_passwd=True))
    assert f"no directory to keep state in: {cause}" in err, err
    assert "set --home or TRIO_AGENTD_HOME to a directory you can write, or fix HOME" in err
    assert not os.path.exists(denv.socket)
