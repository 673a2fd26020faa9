"""The registry watchers (dnotify, and inotify where dnotify is missing) wake on changes in
watched dirs, and only then (real clock, real dirs)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._dnotify import DirNotify
from trio_agentd._inotify import Watcher

# the same check the watchers make: dnotify and inotify are Linux interfaces
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

WATCHERS = [pytest.param(DirNotify, id="dnotify"), pytest.param(Watcher, id="inotify")]


@pytest.mark.parametrize("make", WATCHERS)
async def test_wakes_on_create_replace_and_delete_but_not_on_reads(
    tmp_path: Path, make: Callable[[], DirNotify | Watcher],
) -> None:
    w = make()
    try:
        owner = tmp_path / "g.owner"
        owner.mkdir()
        assert w.watch(tmp_path)
        assert w.watch(owner)
        assert w.watch(tmp_path / "missing") is False
        with trio.fail_after(5):
            (owner / "owner.json").write_bytes(b"{}")
            await w.wait()
            tmp = owner / ".tmp"
            tmp.write_bytes(b"{}")
            await w.wait()
            os.replace(tmp, owner / "owner.json")  # an atomic rewrite
            await w.wait()
            (owner / "owner.json").unlink()
            await w.wait()
        assert w.wakeups == 4
        # reading does not wake it: nothing is pending
        (owner / "x").write_bytes(b"1")
        assert w.pending()
        await w.wait()
        assert not w.pending()
        (owner / "x").read_bytes()
        assert not w.pending()
        with trio.move_on_after(0.2) as scope:
            await w.wait()
        assert scope.cancelled_caught
    finally:
        w.close()


def _fds() -> set[str]:
    return {os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{n}")}


async def test_dnotify_watches_a_dir_made_again_and_lets_go_of_removed_ones(
    tmp_path: Path,
) -> None:
    w = DirNotify()
    try:
        owner = tmp_path / "g.owner"
        owner.mkdir()
        assert w.watch(tmp_path)
        assert w.watch(owner)
        assert str(owner) in _fds()
        with trio.fail_after(5):
            owner.rmdir()  # a cleaner takes the record dir: the parent's watch sees it
            await w.wait()
        # the removed dir's descriptor is closed (no descriptor per generation ever watched)
        assert not any(p.startswith(str(owner)) for p in _fds())
        owner.mkdir()
        with trio.fail_after(5):
            await w.wait()
        assert w.watch(owner)  # the new dir, not the removed one
        with trio.fail_after(5):
            (owner / "owner.json").write_bytes(b"{}")
            await w.wait()
        assert w.wakeups == 3
    finally:
        w.close()


async def test_dnotify_closed_leaves_sigio_ignored_not_fatal(tmp_path: Path) -> None:
    w = DirNotify()
    assert w.watch(tmp_path)
    assert signal.getsignal(signal.SIGIO) not in (signal.SIG_DFL, signal.SIG_IGN)
    w.close()
    assert str(tmp_path) not in _fds()
    # a SIGIO still on its way (or anyone's) must not take the default action: ending the worker
    assert signal.getsignal(signal.SIGIO) == signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGIO)
    await trio.lowlevel.checkpoint()
