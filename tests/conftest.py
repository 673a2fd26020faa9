from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis's per-example deadline and its "generation is slow" check time examples on the
# wall clock: on a loaded 2-core machine a 200 ms deadline fails tests whose properties hold.
# No property test here is about speed (figures live in benchmarks/), so neither applies.
settings.register_profile(
    "wall-clock-free", deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("wall-clock-free")

# Tests send SIGINT (Ctrl-C) to the processes they start. A test run started in the background
# by a non-interactive shell (`.ci/run &`) inherits SIGINT ignored, and every process it starts
# would inherit that too, so a CLI under test could not be interrupted: give the run, and so
# its children, the default disposition.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# --- two async plugins -----------------------------------------------------------------------
# pytest-trio runs in trio mode (every async test is a Trio test). The async client runs on
# asyncio and Trio alike, so its tests are anyio's: a test marked ``@pytest.mark.anyio`` runs
# once per backend of ``anyio_backend`` below, and pytest-trio's mark is taken off it (its
# async fixtures are anyio's too: anyio's plugin runs them, pytest-trio leaves them alone).

ANYIO_BACKENDS = ("asyncio", "trio")


@pytest.fixture(params=ANYIO_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.hookimpl(trylast=True)  # after pytest-trio's trio-mode marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("anyio") is not None:
            item.own_markers[:] = [m for m in item.own_markers if m.name != "trio"]



@pytest.fixture(scope="session", autouse=True)
def _signals_as_a_worker_leaves_them() -> Iterator[None]:
    """Processes the tests start get the stop signals at their defaults, as a worker's agents
    do (a serving worker catches HUP, INT, QUIT and TERM, and a caught signal is back at its
    default in a child after ``exec``), even when the suite itself runs with them ignored:
    under ``nohup`` (HUP), or as a script's background job (INT, QUIT). An agent started
    straight from a test would otherwise inherit the ignored ones, and its shell's background
    jobs would outlive their hang-up. Caught here by a handler that does nothing: ignored
    they were, ignored they stay for this process."""
    ignored = [sig for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM)
               if signal.getsignal(sig) == signal.SIG_IGN]
    for sig in ignored:
        signal.signal(sig, _still_ignored)
    try:
        yield
    finally:
        for sig in ignored:
            signal.signal(sig, signal.SIG_IGN)


def _still_ignored(_signum: int, _frame: object) -> None:
    """A stop signal this process ignored when it started (see above)."""


@pytest.fixture(scope="session", autouse=True)
def _private_tmpdir() -> Iterator[None]:
    """Every process the tests start keeps its temporary files (a fork template's rehearsal
    scratch, which killing the template leaves behind) in one private dir, removed at the end:
    never in /dev/shm or /tmp. (This process's own ``tempfile`` keeps its directory.)"""
    root = tempfile.mkdtemp(prefix="ta-tmpdir-")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = root
    try:
        yield
    finally:
        if old is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old
        shutil.rmtree(root, ignore_errors=True)
