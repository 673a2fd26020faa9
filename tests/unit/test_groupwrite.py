"""GroupWriter: staged atomic writes committed in groups (the supervisor's descriptors)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd import _fs, _groupwrite
from trio_agentd._groupwrite import GroupWriter

from ..held_commit import HeldCommit


def _tmps(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


async def test_a_staged_write_is_invisible_until_committed_then_whole(tmp_path: Path) -> None:
    path = tmp_path / "s1.json"
    path.write_bytes(b"old")
    w = GroupWriter()
    seq = w.stage(path, b"new")
    assert path.read_bytes() == b"old"  # not before its commit
    assert len(_tmps(tmp_path)) == 1
    await w.durable(seq, path)
    assert path.read_bytes() == b"new"
    assert _tmps(tmp_path) == []
    assert (path.stat().st_mode & 0o777) == 0o600


async def test_writes_staged_together_share_one_commit(tmp_path: Path) -> None:
    batches: list[list[str]] = []

    def counting(batch: list[tuple[str, str]]) -> dict[str, OSError]:
        batches.append(sorted(os.path.basename(p) for p, _ in batch))
        return _groupwrite.commit(batch)

    w = GroupWriter(commit_batch=counting)
    for i in range(50):
        w.stage(tmp_path / f"d{i}.json", b"%d" % i)
    w.stage(tmp_path / "d7.json", b"seven")  # a newer write of a path replaces the staged one
    await w.durable()
    assert len(batches) == 1
    assert len(batches[0]) == 50
    assert (tmp_path / "d7.json").read_bytes() == b"seven"
    assert (tmp_path / "d49.json").read_bytes() == b"49"
    assert _tmps(tmp_path) == []


async def test_concurrent_waiters_share_commits_and_later_writes_go_to_the_next(
    tmp_path: Path,
) -> None:
    batches: list[int] = []

    def counting(batch: list[tuple[str, str]]) -> dict[str, OSError]:
        batches.append(len(batch))
        return _groupwrite.commit(batch)

    w = GroupWriter(commit_batch=counting)
    first = w.stage(tmp_path / "a.json", b"a")
    returned: list[bool] = []

    async def waiter() -> None:
        await w.durable(first)
        returned.append((tmp_path / "a.json").exists())  # never before its commit is done

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()  # one commits, nine wait for it
        second = w.stage(tmp_path / "b.json", b"b")  # staged while that commit runs
        nursery.start_soon(w.durable, second)
    assert (tmp_path / "a.json").read_bytes() == b"a"
    assert (tmp_path / "b.json").read_bytes() == b"b"
    assert returned == [True] * 10
    assert batches == [1, 1]  # ten waiters, one commit; the later write, the next one


async def test_a_dropped_path_is_never_brought_back_even_mid_commit(tmp_path: Path) -> None:
    path = tmp_path / "gone.json"
    held = HeldCommit()
    w = GroupWriter(commit_batch=held)
    w.stage(path, b"v1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(w.durable)
        await held.started.wait()
        w.drop(path)  # forgotten while its write is being committed
        path.unlink(missing_ok=True)
        held.release.set()
    assert not path.exists()
    # and a staged write that is dropped before any commit never lands
    w.stage(path, b"v2")
    w.drop(path)
    await w.durable()
    assert not path.exists()
    assert _tmps(tmp_path) == []


async def test_settled_returns_only_once_a_dropped_path_mid_commit_is_gone(tmp_path: Path
                                                                           ) -> None:
    """What ``rm`` relies on: once the writer has settled after a drop, the file is gone for
    good, although a commit that held it was still running when it was dropped."""
    path = tmp_path / "gone.json"
    held = HeldCommit()
    w = GroupWriter(commit_batch=held)
    w.stage(path, b"v1")
    settled_with: list[bool] = []

    async def settle() -> None:
        await w.settled()
        settled_with.append(path.exists())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(w.durable)
        await held.started.wait()
        w.drop(path)
        path.unlink(missing_ok=True)
        nursery.start_soon(settle)
        await trio.testing.wait_all_tasks_blocked()
        assert settled_with == []  # the commit still runs: not settled yet
        held.release.set()
    assert settled_with == [False]
    await w.settled()  # nothing under way: at once


async def test_a_failed_commit_keeps_the_old_file_and_is_raised_to_its_waiter(
    tmp_path: Path,
) -> None:
    ok_path, bad_path = tmp_path / "ok.json", tmp_path / "bad.json"
    bad_path.write_bytes(b"old")

    def failing(batch: list[tuple[str, str]]) -> dict[str, OSError]:
        keep = [(p, t) for p, t in batch if p != str(bad_path)]
        failed = _groupwrite.commit(keep)
        for p, t in batch:
            if p == str(bad_path):
                os.unlink(t)
                failed[p] = OSError(errno.EIO, "I/O error")
        return failed

    w = GroupWriter(commit_batch=failing)
    w.stage(ok_path, b"ok")
    seq = w.stage(bad_path, b"new")
    with pytest.raises(OSError, match="I/O error"):
        await w.durable(seq, bad_path)
    await w.durable(seq, ok_path)  # the others of the batch are not failed with it
    assert bad_path.read_bytes() == b"old"
    assert ok_path.read_bytes() == b"ok"
    # a later write that succeeds clears it
    w2 = GroupWriter()
    w2._failed = w._failed
    seq = w2.stage(bad_path, b"newer")
    await w2.durable(seq, bad_path)
    assert bad_path.read_bytes() == b"newer"


def test_a_temp_file_that_cannot_be_written_raises_at_once_and_stages_nothing(
    tmp_path: Path,
) -> None:
    w = GroupWriter()
    with pytest.raises(FileNotFoundError):
        w.stage(tmp_path / "no-such-dir" / "x.json", b"x")
    assert w.pending == 0


async def test_the_service_task_commits_without_anyone_waiting(tmp_path: Path) -> None:
    committed = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def signalling(batch: list[tuple[str, str]]) -> dict[str, OSError]:
        failed = _groupwrite.commit(batch)
        trio.from_thread.run_sync(committed.set, trio_token=token)
        return failed

    w = GroupWriter(commit_batch=signalling)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(w.run)
        await trio.testing.wait_all_tasks_blocked()
        assert w.running
        w.stage(tmp_path / "x.json", b"x")
        with trio.fail_after(10):
            await committed.wait()
        nursery.cancel_scope.cancel()
    assert (tmp_path / "x.json").read_bytes() == b"x"
    assert not w.running


def test_commit_renames_after_the_data_is_synced(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real_sync, real_replace = _groupwrite._sync_data, os.replace

    def sync(tmps: list[str]) -> None:
        order.append("sync")
        real_sync(tmps)

    def replace(src: str, dst: str) -> None:
        order.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(_groupwrite, "_sync_data", sync)
    monkeypatch.setattr(os, "replace", replace)
    tmp = tmp_path / ".x.tmp"
    tmp.write_bytes(b"x")
    assert _groupwrite.commit([(str(tmp_path / "x"), str(tmp))]) == {}
    assert order == ["sync", "rename"]


def test_a_commit_fsyncs_each_file_it_wrote_and_flushes_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Durability comes from an fsync of each temp file (its inode), never from a flush of the
    whole filesystem: the set of inodes fsynced is exactly the temp files and the directory."""
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    batch = []
    for name in ("a", "b", "c"):
        tmp = tmp_path / f".{name}.tmp"
        tmp.write_bytes(name.encode())
        batch.append((str(tmp_path / name), str(tmp)))
    inodes = {os.stat(t).st_ino for _, t in batch}
    assert _groupwrite.commit(batch) == {}
    assert sorted(synced) == sorted([*inodes, os.stat(tmp_path).st_ino])
    assert [(tmp_path / n).read_bytes() for n in ("a", "b", "c")] == [b"a", b"b", b"c"]


def test_a_commits_fsyncs_wait_side_by_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal makes fsyncs that wait together durable in one flush: a batch's fsyncs are
    in flight at the same time (each here waits until SYNC_THREADS of them are), not one after
    another, and the renames come only once every one of them has ended."""
    import threading

    n = _groupwrite.SYNC_THREADS
    together = threading.Barrier(n, timeout=5)
    real = _groupwrite._fsync_file
    synced: list[str] = []

    def fsync_file(path: str) -> None:
        together.wait()  # broken (an error) unless n fsyncs wait at once
        real(path)
        synced.append(path)

    monkeypatch.setattr(_groupwrite, "_fsync_file", fsync_file)
    batch = []
    for i in range(2 * n):
        tmp = tmp_path / f".f{i}.tmp"
        tmp.write_bytes(b"%d" % i)
        batch.append((str(tmp_path / f"f{i}"), str(tmp)))
    assert _groupwrite.commit(batch) == {}
    assert sorted(synced) == sorted(t for _, t in batch)
    assert [(tmp_path / f"f{i}").read_bytes() for i in range(2 * n)] == [
        b"%d" % i for i in range(2 * n)]


def test_a_commits_directory_fsyncs_wait_side_by_side_and_fail_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch commits one session directory per session: their fsyncs are in flight at the
    same time too (each here waits until all of them are), and a directory whose fsync fails
    fails only the writes in it."""
    import threading

    dirs = [tmp_path / f"d{i}" for i in range(4)]
    for d in dirs:
        d.mkdir()
    together = threading.Barrier(len(dirs), timeout=5)
    real = _fs.fsync_dir

    def fsync_dir(path: str) -> None:
        together.wait()  # broken (an error) unless every directory's fsync waits at once
        if path == str(dirs[1]):
            raise OSError(errno.EIO, "I/O error")
        real(path)

    monkeypatch.setattr(_fs, "fsync_dir", fsync_dir)
    batch = []
    for i, d in enumerate(dirs):
        tmp = d / ".f.tmp"
        tmp.write_bytes(b"%d" % i)
        batch.append((str(d / "f"), str(tmp)))
    failed = _groupwrite.commit(batch)
    assert set(failed) == {str(dirs[1] / "f")}
    assert [(d / "f").read_bytes() for d in dirs] == [b"%d" % i for i in range(len(dirs))]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_commits_own_thread_takes_its_share_of_the_fsyncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """A respawn's commit holds two files: one fsync runs in the commit's own thread, so it
    starts one helper thread, not two (none for a single file), the fsyncs still side by side
    (each here waits until all n are in flight)."""
    import threading

    together = threading.Barrier(n, timeout=5)
    real = _groupwrite._fsync_file
    threads: list[int] = []

    def fsync_file(path: str) -> None:
        together.wait()  # broken (an error) unless all n fsyncs wait at once
        threads.append(threading.get_ident())
        real(path)

    monkeypatch.setattr(_groupwrite, "_fsync_file", fsync_file)
    batch = []
    for i in range(n):
        tmp = tmp_path / f".f{i}.tmp"
        tmp.write_bytes(b"%d" % i)
        batch.append((str(tmp_path / f"f{i}"), str(tmp)))
    assert _groupwrite.commit(batch) == {}
    assert threading.get_ident() in threads
    assert len(set(threads)) == n
