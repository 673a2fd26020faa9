"""One home per socket: a client whose home was set explicitly (``--home``, ``TRIO_AGENTD_HOME``,
``open_client(home=...)``) refuses a supervisor serving another home, naming both."""

from __future__ import annotations

import subprocess

import pytest
import trio

import trio_agentd
from trio_agentd import AgentdError

from .harness import DaemonEnv


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
        assert cp.returncode == 1, (args, cp.stderr)
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
