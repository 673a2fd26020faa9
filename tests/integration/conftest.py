from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import DaemonEnv, daemon_env


@pytest.fixture
def denv(monkeypatch: pytest.MonkeyPatch) -> Iterator[DaemonEnv]:
    with daemon_env() as env:
        # processes this test process spawns itself (in-process autostart, embedded
        # supervisors' workers) carry the marker too, so teardown finds and kills them
        monkeypatch.setenv("TA_TEST_RUN", str(env.root))
        yield env
