"""Both sides' liveness clocks (the client's, in ``_aio``, and the supervisor's, in
``_liveness``) at the edge of a ping's deadline, on MockClock."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from tests.run_order import fixed_order
from trio_agentd import _aio, _liveness

SIDES: dict[str, Callable[[], _aio.Silence | _liveness.Silence]] = {
    "client": lambda: _aio.Silence(trio.current_time),
    "supervisor": _liveness.Silence,
}


@pytest.mark.parametrize("side", sorted(SIDES))
@pytest.mark.parametrize("attempt", range(8))
async def test_an_answer_in_the_pass_of_the_ping_deadline_answers_the_ping(
    side: str, attempt: int, autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answer to a ping arrives at its deadline, in the same pass as the deadline's
    cancellation. If the answer's task runs first, the wait for the answer must say it came
    (``False``), not that the peer stayed silent: a live worker is not unresponsive. Which
    task runs first: the batch's order (fixed, each way in turn) and, within it, the order
    of the two deadlines (by address: a coin toss per attempt)."""
    fixed_order(monkeypatch, reverse=attempt % 2 == 1)
    silence = SIDES[side]()
    silence.waiting()
    results: list[bool] = []
    answered_before_the_verdict: list[bool] = []

    async def answer() -> None:
        await trio.sleep_until(5)
        answered_before_the_verdict.append(not results)
        silence.arrived()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        results.append(await silence.wait_silent(5, since=0, baseline=0))
    assert trio.current_time() == 5
    assert results == [not answered_before_the_verdict[0]]
