"""pytest fixtures for testing code that runs on trio-agentd (the ``trio_agentd`` plugin).

Installing trio-agentd registers this module through the ``pytest11`` entry point, so the
fixtures are there in every project with no conftest line. It only defines fixtures: nothing
is autouse, no option or ini value is added or changed, and importing it imports neither trio
nor trio-agentd's daemon code (each fixture imports what it needs when a test uses it).

Fixtures:

``agentd_fake_session`` (async)
    a :class:`~trio_agentd.testing.FakeSession`: one session's ``WorkerHandle`` on fake
    worker processes, nothing spawned until its first command.
``agentd_fake_supervisor`` (async)
    a :class:`~trio_agentd.testing.FakeSupervisor`: the real supervisor on fake workers, its
    files in ``tmp_path``, clients in memory.
``agentd_behaviours``, ``agentd_timing``
    what the two above use: the fake workers' :class:`~trio_agentd.testing.Behaviour` per
    spawn (the last repeats; default ``[Behaviour.ANSWERS]``) and the
    :class:`~trio_agentd.timing.Timing` (default ``DEFAULT_TIMING``). Override either in a
    test module, or per test with ``@pytest.mark.parametrize("agentd_behaviours", [...])``.
``agentd_daemon`` (sync)
    a :class:`~trio_agentd.testing.DaemonEnv`: a private home, registry and socket under
    ``tmp_path`` (or a short dir in ``/tmp`` if that path is too long for a socket), with the
    CLI (``run``, ``prompt``) and ``open_client()`` bound to them; ``TRIO_AGENTD_HOME``,
    ``TRIO_AGENTD_REGISTRY_DIR``, ``TRIO_AGENTD_SOCKET`` and the ``TA_TEST_RUN`` marker are
    set in this process for the test. Teardown runs ``trio-agentd shutdown``, then SIGKILLs
    every process left that carries the marker, by pid.

The async fixtures are pytest-trio fixtures: the test must run under pytest-trio
(``pip install pytest-trio``), either marked ``@pytest.mark.trio`` or in a project with
``trio_mode = true``. For exact virtual times the test itself must take ``autojump_clock``
(pytest-trio uses a clock only when the test function asks for it).
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ..timing import Timing
    from ._daemon import DaemonEnv
    from ._fakeops import Behaviour
    from ._fakesession import FakeSession
    from ._fakesupervisor import FakeSupervisor


@pytest.fixture
def agentd_behaviours() -> list[Behaviour]:
    """Each successive fake worker spawn's behaviour; the last one repeats."""
    from ._fakeops import Behaviour

    return [Behaviour.ANSWERS]


@pytest.fixture
def agentd_timing() -> Timing:
    """The schedule of the fake session or supervisor (``trio_agentd.timing.Timing``)."""
    from ..timing import DEFAULT_TIMING

    return DEFAULT_TIMING


@pytest.fixture
async def agentd_fake_session(
    agentd_behaviours: list[Behaviour], agentd_timing: Timing
) -> AsyncIterator[FakeSession]:
    """Session ``s1`` (echo agent) supervised on fake workers; no worker until its first
    command. See :func:`trio_agentd.testing.open_fake_session`."""
    from ._fakesession import open_fake_session

    async with open_fake_session(behaviours=agentd_behaviours, timing=agentd_timing) as s:
        yield s


@pytest.fixture
async def agentd_fake_supervisor(
    tmp_path: Path, agentd_behaviours: list[Behaviour], agentd_timing: Timing
) -> AsyncIterator[FakeSupervisor]:
    """A serving supervisor on fake workers, its files under ``tmp_path``. See
    :func:`trio_agentd.testing.open_fake_supervisor`."""
    from ._fakesupervisor import open_fake_supervisor

    async with open_fake_supervisor(
        tmp_path / "agentd", behaviours=agentd_behaviours, timing=agentd_timing
    ) as fake:
        yield fake


@pytest.fixture
def agentd_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DaemonEnv]:
    """A private real daemon (started by the first command); see the module docstring."""
    from ._daemon import MARKER_VARIABLE, daemon_env, fits_socket_dir

    root = tmp_path / "agentd"
    if fits_socket_dir(root):
        root.mkdir(mode=0o700)
        made = None
    else:
        made = tempfile.TemporaryDirectory(prefix="ta-", dir="/tmp")
        root = Path(made.name)
    try:
        with daemon_env(root=root, shutdown=True) as env:
            # what this process starts itself (an autostart by open_client, an embedded
            # supervisor's workers) talks to this daemon and carries the marker too
            monkeypatch.setenv(MARKER_VARIABLE, str(env.root))
            monkeypatch.setenv("TRIO_AGENTD_HOME", str(env.home))
            monkeypatch.setenv("TRIO_AGENTD_REGISTRY_DIR", str(env.registry))
            monkeypatch.setenv("TRIO_AGENTD_SOCKET", env.socket)
            yield env
    finally:
        if made is not None:
            made.cleanup()
