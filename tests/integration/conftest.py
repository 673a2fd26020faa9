from __future__ import annotations

from collections.abc import Iterator

import pytest

from .harness import DaemonEnv, daemon_env


@pytest.fixture
def denv() -> Iterator[DaemonEnv]:
    with daemon_env() as env:
        yield env
