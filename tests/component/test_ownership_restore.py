"""Ownership on real files: acquire, conflicts, dead records, self-heal (restore) and refusals.

The registry does synchronous file I/O and polls its flocks with ``trio.sleep``, so every wait
is inside trio and ``autojump_clock`` is safe. Locks held "by someone else" are taken by the test
itself on a separate open file description, which ``flock`` treats as another holder.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._errors import AgentdError
from trio_agentd._identity import own_start_id
from trio_agentd._ownership import OwnerRecord, Phase, Scope
from trio_agentd._paths import Layout
from trio_agentd._registry import Ownership, OwnershipStatistics, Registry

SOCKET = "/tmp/x/d.sock"
LOGGER = "trio_agentd.supervisor"
FIX_HINT = ' — run "trio-agentd doctor --fix" to restart it (sessions are preserved)'


pytestmark = pytest.mark.timeout(10)

# --- helpers ---------------------------------------------------------------------------------


def make_layout(tmp_path: Path, *, home: str = "home", socket: str = SOCKET) -> Layout:
    return Layout(home=tmp_path / home, socket=socket, registry=tmp_path / "reg")


def make_ownership(
    layout: Layout,
    generation: str,
    *,
    self_heal: bool = True,
    pid: int | None = None,
    start_id: str | None = None,
) -> Ownership:
    return Ownership(
        Registry(layout.registry),
        layout,
        generation=generation,
        app_version="t",
        protocol=1,
        self_heal=self_heal,
        pid=pid,
        start_id=start_id,
    )


def on_disk(own: Ownership) -> OwnerRecord | None:
    path = own.registry.owner_json(own.generation)
    return OwnerRecord.from_json(path.read_bytes()) if path.exists() else None


def realpath(path: Path) -> str:
    return os.path.realpath(path)


def entries(layout: Layout) -> set[str]:
    return set(os.listdir(layout.registry))


def restored_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.getMessage().startswith("Restored supervisor owner record")
    ]


def hold_flock(path: Path) -> int:
    """Take an exclusive flock on ``path`` as another process would; returns the fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def release_flock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(autouse=True)
def _log_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)


def lost(generation: str, cause: str, text: str, refusal: str | None = None) -> tuple[
    str, str, dict[str, str]
]:
    """(code, message, details) of the ``ownership_lost`` error we expect."""
    extra = f" (restore refused: {refusal})" if refusal is not None else ""
    details = {"cause": cause, "generation": generation}
    if refusal is not None:
        details["refusal"] = refusal
    return (
        "ownership_lost",
        f"supervisor generation {generation} no longer owns its registry entry: {text}{extra}"
        + FIX_HINT,
        details,
    )


def as_tuple(exc: AgentdError) -> tuple[str, str, dict[str, object]]:
    return (exc.code, exc.message, exc.details)


MISSING_TEXT = "its owner record was deleted on disk"
REPLACED_TEXT = "its owner record was replaced by another owner's"


# --- acquire ---------------------------------------------------------------------------------


async def test_acquire_writes_owner_and_scope(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()

    assert entries(layout) == {".guard", "g1.owner"}
    assert sorted(os.listdir(layout.registry / "g1.owner")) == ["owner.json", "scope.json"]
    rec = on_disk(own)
    assert rec == own.record
    assert rec is not None
    assert (rec.version, rec.generation, rec.token, rec.pid, rec.start_id, rec.socket) == (
        1, "g1", own.token, os.getpid(), own_start_id(), SOCKET
    )
    assert (rec.home, rec.state_dir) == (
        realpath(tmp_path / "home"),
        realpath(layout.state_dir),
    )
    assert (rec.app_version, rec.protocol, rec.phase) == ("t", 1, Phase.STARTING)
    scope = Scope.from_json((layout.registry / "g1.owner" / "scope.json").read_bytes())
    assert scope == Scope(
        version=1, generation="g1", token=own.token, socket=SOCKET, state_dir=rec.state_dir
    )
    assert own.check() is None
    assert trio.current_time() == 0.0


async def test_second_live_owner_of_the_socket_is_refused_naming_the_first(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    first = make_ownership(make_layout(tmp_path), "g1")
    await first.acquire()
    layout2 = make_layout(tmp_path, home="other-home")
    second = make_ownership(layout2, "g2")

    with pytest.raises(AgentdError) as info:
        await second.acquire()
    assert info.value.code == "already_running"
    assert info.value.message == (
        f"a supervisor is already running for {SOCKET}: pid {os.getpid()}, generation g1"
        " — use it, or stop it with `trio-agentd shutdown`"
    )
    assert info.value.details == {"pid": os.getpid(), "generation": "g1", "socket": SOCKET}
    # the loser leaves nothing behind, the incumbent is untouched
    assert entries(layout2) == {".guard", "g1.owner"}
    assert on_disk(first) == first.record


@pytest.mark.parametrize("incarnation", ["exited-pid", "reused-pid"])
async def test_record_of_a_dead_supervisor_is_moved_aside(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    dead_pid: int,
    incarnation: str,
) -> None:
    layout = make_layout(tmp_path)
    if incarnation == "exited-pid":
        ghost = make_ownership(layout, "g-dead", pid=dead_pid, start_id="boot:1")
    else:  # our pid, but another incarnation's start id
        ghost = make_ownership(layout, "g-dead", start_id=own_start_id() + "0")
    await ghost.acquire()
    assert entries(layout) == {".guard", "g-dead.owner"}

    own = make_ownership(layout, "g1")
    await own.acquire()
    assert entries(layout) == {".guard", "g1.owner"}
    assert on_disk(own) == own.record
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "Moved aside the owner record g-dead.owner of a dead supervisor"
    ]


# --- restore ---------------------------------------------------------------------------------


def _delete_files(own: Ownership) -> None:
    own.registry.owner_json(own.generation).unlink()
    own.registry.scope_json(own.generation).unlink()


def _delete_dir(own: Ownership) -> None:
    shutil.rmtree(own.registry.owner_dir(own.generation))


@pytest.mark.parametrize("delete", [_delete_files, _delete_dir], ids=["files", "directory"])
async def test_ensure_current_restores_a_deleted_record(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    delete: Callable[[Ownership], None],
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()
    before = own.record
    async with trio.open_nursery() as nursery:
        own.bind_nursery(nursery)
        await own.ensure_current()
        assert own.statistics() == OwnershipStatistics(restores=0, restore_flights=0, checks=1)

        delete(own)
        assert on_disk(own) is None
        await own.ensure_current()

    rec = on_disk(own)
    assert rec is not None
    assert (rec.generation, rec.token) == ("g1", before.token)
    assert rec == own.record
    assert rec.with_phase(before.phase, before.updated_at) == before
    scope = Scope.from_json(own.registry.scope_json("g1").read_bytes())
    assert scope == before.scope
    assert own.statistics() == OwnershipStatistics(restores=1, restore_flights=1, checks=3)
    assert restored_messages(caplog) == [
        "Restored supervisor owner record for generation g1 after external removal"
    ]
    assert own.check() is None


async def test_concurrent_callers_share_one_restore_flight(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()
    token = own.token
    _delete_dir(own)
    succeeded: list[int] = []

    async def caller(i: int) -> None:
        await own.ensure_current()
        succeeded.append(i)

    async with trio.open_nursery() as service:
        own.bind_nursery(service)
        async with trio.open_nursery() as callers:
            for i in range(20):
                callers.start_soon(caller, i)

    assert sorted(succeeded) == list(range(20))
    # every caller checked once, waited for the one flight, and checked again
    assert own.statistics() == OwnershipStatistics(restores=1, restore_flights=1, checks=40)
    assert restored_messages(caplog) == [
        "Restored supervisor owner record for generation g1 after external removal"
    ]
    rec = on_disk(own)
    assert rec is not None
    assert (rec.generation, rec.token) == ("g1", token)


async def test_cancelled_first_caller_does_not_cancel_the_flight(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()
    _delete_files(own)
    guard = hold_flock(layout.registry / ".guard")  # the flight waits for the registry guard
    first_scope = trio.CancelScope()
    second_done = trio.Event()

    async def first() -> None:
        with first_scope:
            await own.ensure_current()

    async def second() -> None:
        await own.ensure_current()
        second_done.set()

    try:
        async with trio.open_nursery() as service:
            own.bind_nursery(service)
            async with trio.open_nursery() as callers:
                callers.start_soon(first)
                await trio.testing.wait_all_tasks_blocked()
                assert own.statistics() == OwnershipStatistics(
                    restores=0, restore_flights=1, checks=1
                )
                first_scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert first_scope.cancelled_caught

                callers.start_soon(second)
                await trio.testing.wait_all_tasks_blocked()
                assert not second_done.is_set()
                assert on_disk(own) is None

                release_flock(guard)
                guard = -1
                await second_done.wait()
    finally:
        if guard >= 0:
            release_flock(guard)

    assert own.statistics() == OwnershipStatistics(restores=1, restore_flights=1, checks=3)
    assert on_disk(own) == own.record
    assert restored_messages(caplog) == [
        "Restored supervisor owner record for generation g1 after external removal"
    ]


# --- refusals --------------------------------------------------------------------------------


async def _refusal(own: Ownership) -> AgentdError:
    async with trio.open_nursery() as nursery:
        own.bind_nursery(nursery)
        with pytest.raises(AgentdError) as info:
            await own.ensure_current()
    return info.value


async def test_refused_after_release(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()
    await own.release()
    assert entries(layout) == {".guard"}

    exc = await _refusal(own)
    assert as_tuple(exc) == lost(
        "g1", "released", "this supervisor released its ownership (it is shutting down)"
    )
    assert entries(layout) == {".guard"}
    assert own.statistics().restores == 0
    assert restored_messages(caplog) == []


async def test_refused_after_revocation(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()
    own.registry.revoke("g1")
    _delete_dir(own)
    assert not own.revoked.is_set()

    exc = await _refusal(own)
    assert as_tuple(exc) == lost(
        "g1", "revoked", "its generation was revoked by doctor --fix or shutdown --force"
    )
    assert own.revoked.is_set()
    assert entries(layout) == {".guard", "g1.revoked"}
    assert own.statistics().restores == 0
    assert restored_messages(caplog) == []


async def test_refused_when_another_record_replaced_ours(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()
    other = make_ownership(make_layout(tmp_path, home="other"), "g2").record.to_json()
    own.registry.owner_json("g1").write_bytes(other)

    exc = await _refusal(own)
    assert as_tuple(exc) == lost("g1", "record-replaced", REPLACED_TEXT)
    assert own.registry.owner_json("g1").read_bytes() == other
    assert own.statistics() == OwnershipStatistics(restores=0, restore_flights=0, checks=1)
    assert restored_messages(caplog) == []


async def test_refused_when_a_live_successor_claims_the_socket(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()
    _delete_dir(own)
    successor = make_ownership(make_layout(tmp_path, home="successor"), "g2")
    await successor.acquire()
    assert successor.record.pid == os.getpid()  # alive

    exc = await _refusal(own)
    assert as_tuple(exc) == lost("g1", "record-replaced", REPLACED_TEXT, "live-conflict")
    assert entries(layout) == {".guard", "g2.owner"}
    assert on_disk(successor) == successor.record
    assert own.statistics() == OwnershipStatistics(restores=0, restore_flights=1, checks=2)
    assert restored_messages(caplog) == []


async def test_refused_while_a_shutdown_holds_the_admission(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1")
    await own.acquire()
    _delete_files(own)
    admission = hold_flock(layout.registry / "shutdown.lock")
    try:
        exc = await _refusal(own)
    finally:
        release_flock(admission)
    assert as_tuple(exc) == lost("g1", "record-missing", MISSING_TEXT, "shutdown-in-progress")
    assert on_disk(own) is None
    assert own.statistics() == OwnershipStatistics(restores=0, restore_flights=1, checks=2)
    assert restored_messages(caplog) == []


async def test_refused_when_self_heal_is_off(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = make_layout(tmp_path)
    own = make_ownership(layout, "g1", self_heal=False)
    await own.acquire()
    _delete_dir(own)

    for _ in range(2):  # it stays wedged: every command fails the same way
        exc = await _refusal(own)
        assert as_tuple(exc) == lost("g1", "record-missing", MISSING_TEXT, "self-heal-disabled")
        assert entries(layout) == {".guard"}
    assert own.statistics() == OwnershipStatistics(restores=0, restore_flights=2, checks=4)
    assert restored_messages(caplog) == []
