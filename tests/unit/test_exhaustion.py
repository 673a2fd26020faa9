"""The pure parts of resource exhaustion: the rate-limited logger, the errors that name the
limit, raising RLIMIT_NOFILE, and an owner record that cannot be read counting as unknown."""

from __future__ import annotations

import errno
import logging
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from trio_agentd._errors import AgentdError, ErrorCode
from trio_agentd._exhaustion import (
    ACCEPT_CAPACITY_ERRNOS,
    RateLimitedLog,
    exhaustion_error,
    is_exhaustion,
)
from trio_agentd._paths import Layout
from trio_agentd._registry import Ownership, OwnershipUnknown, Registry
from trio_agentd.timing import (
    ACCEPT_BACKOFF,
    LOG_RATE_INTERVAL,
    MAX_CLIENT_CONNECTIONS,
    MAX_SESSIONS,
)

LOGGER = "test.exhaustion"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_rate_limited_log_writes_one_line_per_cause_per_interval_with_the_count_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    rl = RateLimitedLog(logging.getLogger(LOGGER), 10.0, clock=clock)
    assert rl.error("emfile", "accept failed: %s", "EMFILE") is True
    for _ in range(5):
        clock.now += 1.0
        assert rl.error("emfile", "accept failed: %s", "EMFILE") is False
    clock.now = 109.999
    assert rl.error("emfile", "accept failed: %s", "EMFILE") is False
    clock.now = 110.0  # one interval after the last line written
    assert rl.error("emfile", "accept failed: %s", "EMFILE") is True
    clock.now = 120.0
    assert rl.error("emfile", "accept failed: %s", "EMFILE") is True  # nothing held back
    assert messages(caplog) == [
        "accept failed: EMFILE",
        "accept failed: EMFILE (6 similar lines suppressed in the last 10s)",
        "accept failed: EMFILE",
    ]
    assert [r.levelno for r in caplog.records] == [logging.ERROR] * 3


def test_rate_limited_log_keeps_causes_apart_and_clear_reports_how_often(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    rl = RateLimitedLog(logging.getLogger(LOGGER), 10.0, clock=clock)
    assert rl.error(("accept", errno.EMFILE), "a")
    assert rl.warning(("self-check", "x"), "b")
    assert not rl.error(("accept", errno.EMFILE), "a")
    assert rl.log(logging.INFO, ("accept", errno.ENFILE), "c")
    assert rl.active(("accept", errno.EMFILE))
    assert rl.clear(("accept", errno.EMFILE)) == 2
    assert not rl.active(("accept", errno.EMFILE))
    assert rl.clear(("accept", errno.EMFILE)) == 0
    assert rl.error(("accept", errno.EMFILE), "a")  # a new episode: written at once
    assert messages(caplog) == ["a", "b", "c", "a"]


def test_exhaustion_error_names_the_limit_and_its_value() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    err = exhaustion_error(OSError(errno.EMFILE, "Too many open files"), "could not start x")
    assert err.code == ErrorCode.RESOURCE_EXHAUSTED
    assert err.code == "resource_exhausted"
    assert err.message == (
        f"could not start x: too many open files (RLIMIT_NOFILE {soft}) — raise `ulimit -n`"
        " or close idle clients"
    )
    assert err.details == {"errno": "EMFILE", "limit": "RLIMIT_NOFILE", "value": soft}
    assert "ENFILE" in exhaustion_error(OSError(errno.ENFILE, "x")).message
    assert "RLIMIT_NPROC" in exhaustion_error(OSError(errno.EAGAIN, "x")).message
    assert "\n" not in err.message


def test_which_errors_are_exhaustion() -> None:
    for e in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN):
        assert is_exhaustion(OSError(e, "x"))
    for e in (errno.EIO, errno.ENOENT, errno.EACCES, errno.ENOSPC):
        assert not is_exhaustion(OSError(e, "x"))
    assert not is_exhaustion(ValueError("x"))
    # the capacity errnos trio.serve_listeners backs off on
    from trio._highlevel_serve_listeners import ACCEPT_CAPACITY_ERRNOS as TRIOS

    assert set(TRIOS) == ACCEPT_CAPACITY_ERRNOS


def test_documented_defaults() -> None:
    assert ACCEPT_BACKOFF == 0.1  # trio.serve_listeners' SLEEP_TIME
    assert LOG_RATE_INTERVAL == 10.0
    assert MAX_CLIENT_CONNECTIONS == 1024
    assert MAX_SESSIONS == 1000


@pytest.mark.parametrize("report", [True, False])
def test_raise_nofile_limit_raises_the_soft_limit_to_the_hard_one_and_logs_both(
    report: bool,
) -> None:
    """The supervisor logs the limits it runs with; a worker (``report=False``) only a
    failure to raise them (its first log line would cost it pages it shares)."""
    code = (
        "import logging, resource, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from trio_agentd._exhaustion import raise_nofile_limit\n"
        f"print(raise_nofile_limit(logging.getLogger('x'), report={report}))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    cp = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 256)),
    )
    assert cp.returncode == 0, cp.stderr
    logged = ["RLIMIT_NOFILE: raised the soft limit from 64 to 256 (hard 256)"] if report else []
    assert cp.stdout.splitlines() == [*logged, "(256, 256)", "(256, 256)"]


# --- the ownership check: unreadable is unknown, never lost ---------------------------------


def _ownership(tmp_path: Path) -> Ownership:
    layout = Layout(home=tmp_path / "home", socket="/tmp/x/d.sock", registry=tmp_path / "reg")
    return Ownership(Registry(layout.registry), layout, generation="g1", app_version="t",
                     protocol=1)


@pytest.mark.parametrize(
    ("errnum", "code"),
    [(errno.EMFILE, "resource_exhausted"), (errno.ENFILE, "resource_exhausted"),
     (errno.EIO, "storage_error")],
)
async def test_an_owner_record_that_cannot_be_read_is_unknown_not_lost_nor_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errnum: int, code: str
) -> None:
    own = _ownership(tmp_path)
    await own.acquire()
    async with trio.open_nursery() as nursery:
        own.bind_nursery(nursery)
        before = own.registry.owner_json("g1").read_bytes()

        def unreadable(generation: str) -> bytes | None:
            raise OSError(errnum, "nope")

        monkeypatch.setattr(own.registry, "read_owner_bytes", unreadable)
        for _ in range(3):
            with pytest.raises(OwnershipUnknown) as info:
                await own.ensure_current()
            assert isinstance(info.value, AgentdError)
            assert info.value.code == code
            assert "cannot read the owner record of generation g1" in info.value.message
        stats = own.statistics()
        assert (stats.restores, stats.restore_flights) == (0, 0)
        assert not own.revoked.is_set()
        assert own.registry.owner_json("g1").read_bytes() == before
        monkeypatch.undo()
        await own.ensure_current()  # readable again: still ours


async def test_a_restore_that_cannot_read_is_unknown_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = _ownership(tmp_path)
    await own.acquire()
    async with trio.open_nursery() as nursery:
        own.bind_nursery(nursery)
        own.registry.remove("g1")  # a cleaner deleted it: the check says missing
        real = own.registry.scan

        def emfile() -> list[object]:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(own.registry, "scan", emfile)
        with pytest.raises(OwnershipUnknown) as info:
            await own.ensure_current()
        assert info.value.code == "resource_exhausted"
        assert own.statistics().restores == 0
        monkeypatch.setattr(own.registry, "scan", real)
        await own.ensure_current()  # the next check restores it
        assert own.statistics().restores == 1
