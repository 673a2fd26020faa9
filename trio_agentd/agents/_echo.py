"""The default agent: offline, deterministic, replayable. Its reply is one line of text."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ._base import TurnContext


class EchoAgent:
    replayable = True
    immediate = True  # its turn awaits nothing: the worker runs it without a task of its own

    async def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[str]:
        yield f"[echo turn {ctx.turn}] {prompt}\n"
