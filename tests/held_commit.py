"""A group commit held in its thread until the test lets it go: for what happens to a path while
its write is being committed (a drop, a settle, a forget)."""

from __future__ import annotations

import trio

from trio_agentd import _groupwrite


class HeldCommit:
    """``GroupWriter(commit_batch=HeldCommit())``: each commit sets :attr:`started`, then waits
    for :attr:`release` before it commits for real. Made inside the test's trio run."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self._token = trio.lowlevel.current_trio_token()

    def __call__(self, batch: list[tuple[str, str]]) -> dict[str, OSError]:
        trio.from_thread.run_sync(self.started.set, trio_token=self._token)
        trio.from_thread.run(self.release.wait, trio_token=self._token)
        return _groupwrite.commit(batch)
