"""The registry watcher wakes on changes in watched dirs, and only then (real clock, real dir)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._inotify import Watcher

# the same check the watcher makes: inotify is a Linux interface
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify: Linux")


async def test_wakes_on_create_replace_and_delete_but_not_on_reads(tmp_path: Path) -> None:
    w = Watcher()
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
        await w.wait()
        (owner / "x").read_bytes()
        with trio.move_on_after(0.2) as scope:
            await w.wait()
        assert scope.cancelled_caught
    finally:
        w.close()
