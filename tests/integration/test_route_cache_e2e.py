"""The CLI's cached route: a warm ``trio-agentd -p`` goes straight to the session's worker on
the route it was last granted, kept in a private file next to the socket. A cache that is not
provably ours, not well formed, or of a supervisor that no longer runs is ignored (and
replaced); a route that fails sends the prompt to the supervisor, with the same command id,
exactly as a stale route always has."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from trio_agentd import AgentdError
from trio_agentd._paths import Layout
from trio_agentd._syncclient import SyncClient, route_cache_path

from .harness import DaemonEnv, wait_for

pytestmark = pytest.mark.timeout(120)


def _layout(denv: DaemonEnv) -> Layout:
    return Layout.resolve(socket=denv.socket, home=denv.home, registry=denv.registry)


def _cache(denv: DaemonEnv, session: str = "default") -> Path:
    return Path(route_cache_path(_layout(denv), session))


def _cached(denv: DaemonEnv, session: str = "default") -> dict[str, Any]:
    return dict(json.loads(_cache(denv, session).read_bytes()))


def _would_use_cache(denv: DaemonEnv, session: str = "default") -> bool:
    """Whether a CLI prompt to ``session`` would skip the supervisor now."""
    client = SyncClient(_layout(denv), autostart=False)
    try:
        client.connect_for_prompt(session, None, cwd_given=False)
        return not client.hello  # the cache was used: no supervisor was contacted
    except AgentdError as exc:
        if exc.code != "daemon_unavailable":
            raise
        return False  # it went to the socket: nobody there
    finally:
        client.close()


def test_a_warm_prompt_needs_no_supervisor(denv: DaemonEnv) -> None:
    assert denv.prompt("one") == "[echo turn 1] one"
    cache = _cache(denv)
    assert cache.stat().st_mode & 0o777 == 0o600
    assert _cached(denv)["supervisor"]["generation"] == denv.owner()["generation"]
    sup = int(denv.owner()["pid"])
    # a stopped supervisor answers nothing: a prompt that asked it for a route would wait
    # for its hello, then for its patience, and fail naming doctor --fix
    os.kill(sup, signal.SIGSTOP)
    try:
        cp = denv.run("-p", "two", timeout=60)
    finally:
        os.kill(sup, signal.SIGCONT)
    assert (cp.returncode, cp.stdout, cp.stderr) == (0, "[echo turn 2] two\n", "")


def test_the_cache_is_bypassed_after_a_restart(denv: DaemonEnv) -> None:
    assert denv.prompt("one") == "[echo turn 1] one"
    old = denv.owner()["generation"]
    assert _would_use_cache(denv)
    cp = denv.run("restart")
    assert cp.returncode == 0, cp.stderr
    new = denv.owner()["generation"]
    assert new != old
    assert not _would_use_cache(denv)  # its supervisor is gone: not even tried
    assert denv.prompt("two") == "[echo turn 2] two"
    assert _cached(denv)["supervisor"]["generation"] == new
    assert _would_use_cache(denv)


def _valid(denv: DaemonEnv) -> bytes:
    assert denv.prompt("one") == "[echo turn 1] one"
    return _cache(denv).read_bytes()


@pytest.mark.parametrize("kind", ["garbage", "not-an-object", "other-version", "other-session",
                                  "group-readable", "world-writable", "symlink", "expired",
                                  "other-app-version"])
def test_a_cache_that_is_not_ours_or_not_right_is_ignored_and_replaced(
    denv: DaemonEnv, kind: str
) -> None:
    good = _valid(denv)
    cache = _cache(denv)
    obj = json.loads(good)
    target = denv.root / "elsewhere.json"
    cache.unlink()
    match kind:
        case "garbage":
            cache.write_bytes(b"\x00{not json")
        case "not-an-object":
            cache.write_bytes(b"[1, 2]")
        case "other-version":
            cache.write_bytes(json.dumps({**obj, "v": 99}).encode())
        case "other-session":
            obj["route"]["session"] = "other"
            cache.write_bytes(json.dumps(obj).encode())
        case "expired":
            obj["route"]["expires"] = 1.0
            cache.write_bytes(json.dumps(obj).encode())
        case "other-app-version":
            obj["supervisor"]["app_version"] = "0.0.1"
            cache.write_bytes(json.dumps(obj).encode())
        case "group-readable" | "world-writable":
            cache.write_bytes(good)
            cache.chmod(0o640 if kind == "group-readable" else 0o606)
        case "symlink":
            target.write_bytes(good)
            target.chmod(0o600)
            cache.symlink_to(target)
    if kind not in ("group-readable", "world-writable", "symlink"):
        cache.chmod(0o600)  # only its content is wrong
    assert not _would_use_cache(denv)
    assert denv.prompt("two") == "[echo turn 2] two"  # through the supervisor, as without one
    assert not cache.is_symlink()
    assert cache.stat().st_mode & 0o777 == 0o600
    assert _cached(denv)["route"]["session"] == "default"
    assert _would_use_cache(denv)
    if kind == "symlink":
        assert target.read_bytes() == good  # what it pointed to is never written


def test_a_refused_grant_falls_back_to_the_supervisor_and_runs_once(denv: DaemonEnv) -> None:
    obj = json.loads(_valid(denv))
    gen, expires, mac = obj["route"]["grant"].split(".")
    obj["route"]["grant"] = f"{gen}.{expires}.{'0' * len(mac)}"  # the worker refuses it
    _cache(denv).write_bytes(json.dumps(obj).encode())
    assert _would_use_cache(denv)  # the file is fine: only the worker can tell
    assert denv.prompt("two") == "[echo turn 2] two"
    assert denv.prompt("three") == "[echo turn 3] three"  # the replaced route


def test_a_dead_worker_on_the_cached_route_is_respawned_by_the_supervisor(
    denv: DaemonEnv,
) -> None:
    _valid(denv)
    worker = int(_cached(denv)["route"]["worker_pid"])
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: worker not in denv.our_pids(), timeout=10, what="the worker to die")
    assert denv.prompt("two") == "[echo turn 2] two"
    assert _cached(denv)["route"]["worker_pid"] != worker


def test_a_prompt_after_kill_creates_the_session_anew(denv: DaemonEnv) -> None:
    """The cached route's worker is gone and the prompt never reached it: it is a first
    send (not a resend of a command the kill ended), so the session is created anew, not
    refused with ``session_killed``."""
    _valid(denv)
    cp = denv.run("kill", "default")
    assert cp.returncode == 0, cp.stderr
    assert _would_use_cache(denv)  # its supervisor still runs: the worker will refuse
    assert denv.prompt("again") == "[echo turn 2] again"  # its transcript is kept


def test_cwd_always_asks_the_supervisor(denv: DaemonEnv, tmp_path: Path) -> None:
    _valid(denv)
    other = tmp_path / "x"
    other.mkdir()
    cp = denv.run("-p", "--cwd", str(other), "two")
    assert cp.returncode != 0
    assert "cwd" in cp.stderr  # the supervisor's check: an existing session keeps its cwd


def test_the_cache_is_bypassed_once_its_supervisor_is_killed(denv: DaemonEnv) -> None:
    """Even before the dead supervisor is reaped (a zombie still has its start id), the next
    prompt goes to the socket, which autostarts a new supervisor that adopts the worker."""
    _valid(denv)
    sup = int(denv.owner()["pid"])
    worker = int(_cached(denv)["route"]["worker_pid"])
    os.kill(sup, signal.SIGKILL)
    wait_for(lambda: sup not in denv.our_pids(), timeout=10, what="the supervisor to die")
    assert not _would_use_cache(denv)
    assert denv.prompt("two") == "[echo turn 2] two"
    assert int(denv.owner()["pid"]) != sup
    assert _cached(denv)["route"]["worker_pid"] == worker  # adopted, not respawned
