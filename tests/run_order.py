"""Trio's order of the tasks that run in one pass of its run loop, fixed for a test.

Trio runs each pass's batch of ready tasks in the order they became ready or reversed, at
random (and pytest-trio makes even that deterministic by default). A test that needs two
tasks ready in the same pass to run one way round, then the other, fixes the choice here.
Within a batch, tasks woken by deadlines that fall at the same instant come in the order of
their cancel scopes' addresses: no test can choose that, only repeat itself.
"""

from __future__ import annotations

import random

import pytest
import trio


class _Fixed(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def fixed_order(monkeypatch: pytest.MonkeyPatch, *, reverse: bool) -> None:
    """From now on in this test, each pass runs its batch reversed (``reverse``) or in the
    order the tasks became ready."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)
    # trio reverses a batch when its generator's random() < 0.5
    monkeypatch.setattr(trio._core._run, "_r", _Fixed(0.0 if reverse else 0.9))
