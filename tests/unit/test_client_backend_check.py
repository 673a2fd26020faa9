"""The async client outside an event loop, or on one it does not run on: one clear line."""

from __future__ import annotations

import contextvars
from typing import Any

import pytest
import sniffio

import trio_agentd
from trio_agentd import AgentdError


def _enter(library: str | None) -> Any:
    """Drive ``open_client().__aenter__()`` by hand (no event loop at all), as if the running
    library were ``library`` (``None``: none)."""
    coro = trio_agentd.open_client("/nonexistent/agentd.sock", autostart=False).__aenter__()

    def step() -> Any:
        if library is not None:
            sniffio.current_async_library_cvar.set(library)
        return coro.send(None)

    try:
        return contextvars.copy_context().run(step)
    finally:
        coro.close()


def test_outside_any_event_loop_open_client_says_so_in_one_line() -> None:
    with pytest.raises(AgentdError) as info:
        _enter(None)
    assert info.value.code == "config"
    assert "\n" not in info.value.message
    assert "needs a running event loop" in info.value.message
    assert "asyncio.run()" in info.value.message
    assert "trio.run()" in info.value.message


def test_on_an_event_loop_it_does_not_run_on_open_client_names_it() -> None:
    with pytest.raises(AgentdError) as info:
        _enter("curio")
    assert info.value.code == "config"
    assert "\n" not in info.value.message
    assert "runs on asyncio or Trio, not on curio" in info.value.message
