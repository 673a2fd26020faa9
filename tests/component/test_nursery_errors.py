"""Errors raised inside a nursery reach the ``except`` meant for them (trio wraps them in an
``ExceptionGroup``): fault injection of EMFILE and ENOSPC inside the nurseries on the
daemon's paths."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_agentd._errors import ErrorCode
from trio_agentd._forkserver import ForkServer
from trio_agentd._protocol import ErrorBody, Request
from trio_agentd._supervisorops import Dispatcher

from .conftest import supervisor_world


def _group(code: int) -> ExceptionGroup[OSError]:
    """What a nursery raises when one of its tasks fails with ``code``."""
    return ExceptionGroup("from a nursery", [OSError(code, "injected")])


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENOSPC])
async def test_the_fork_template_keeps_running_after_an_error_in_its_nursery(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, code: int,
) -> None:
    fs = ForkServer(restart_delay=0.5)
    runs: list[float] = []
    again = trio.Event()

    async def run_once() -> bool:
        runs.append(trio.current_time())
        if len(runs) == 1:
            raise _group(code)  # a spare fork (or the reply reader) ran out of descriptors
        again.set()
        await trio.sleep_forever()
        return True

    monkeypatch.setattr(fs, "_run_once", run_once)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.run)
            await again.wait()  # restarted, not ended: the supervisor's nursery lives on
            nursery.cancel_scope.cancel()
    assert runs == [0.0, 1.0]  # the failure doubles the restart delay
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert lines == [f"the worker fork template failed: [Errno {code}] injected"]


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENOSPC])
async def test_an_op_failing_inside_its_nursery_is_answered_as_its_error(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path,
    monkeypatch: pytest.MonkeyPatch, code: int,
) -> None:
    async def run_op(self: Dispatcher, ms: object, req: Request) -> object:
        await trio.lowlevel.checkpoint()  # a stand-in for an async op
        raise _group(code)  # e.g. a task of a batch op could not open a file

    async with supervisor_world(tmp_path, run_dir) as world:
        monkeypatch.setattr(Dispatcher, "run_op", run_op)
        c = await world.client()
        response = await c.request("sessions")
        await c.aclose()
    assert isinstance(response.error, ErrorBody)
    # EMFILE is the capacity the operator can raise; ENOSPC is an OSError of the op: either
    # way its own error, never "several errors" or the group's repr
    expected = ErrorCode.RESOURCE_EXHAUSTED if code == errno.EMFILE else ErrorCode.INTERNAL
    assert response.error.code == expected
    assert ("too many open files" if code == errno.EMFILE else "injected") in (
        response.error.message)
    assert "ExceptionGroup" not in response.error.message
    assert "from a nursery" not in response.error.message


async def test_a_client_failing_inside_its_nursery_is_one_rate_limited_line(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, run_dir: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    async def read_requests(self: Dispatcher, *args: object) -> None:
        await trio.lowlevel.checkpoint()  # a stand-in for the async reader
        raise OSError(errno.EMFILE, "injected")  # in the body of the requests nursery

    async with supervisor_world(tmp_path, run_dir) as world:
        monkeypatch.setattr(Dispatcher, "read_requests", read_requests)
        for _ in range(3):
            c = await world.client()
            await world.sup.inflight.wait_value(0)
            await trio.testing.wait_all_tasks_blocked()
            await c.aclose()
    lines = [r for r in caplog.records if "client connection failed" in r.getMessage()]
    assert [r.getMessage() for r in lines] == [
        "client connection failed: [Errno 24] injected"]  # rate-limited: once, not per client
    assert not lines[0].exc_info  # no traceback: it is the machine's limit, not a bug
