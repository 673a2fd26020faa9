"""The ``shell`` agent: each prompt is a ``/bin/sh`` script run in the session's directory.

It is ``exec`` with the prompt as the script instead of on stdin; stderr comes as
:class:`Stderr` pieces, apart from the reply, and the script's exit status ends the turn. The
runner, its process-group rules and its cancellation live in :mod:`._exec`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ._base import Chunk, TurnContext
from ._exec import KILL_GRACE, run_command

SHELL = "/bin/sh"


class ShellAgent:
    """Runs each prompt with ``/bin/sh -c``; streams stdout and stderr, each on its own.

    Not replayable: a script that ran once (``rm``, ``git push``) must not run again by itself
    after a worker restart.
    """

    replayable = False

    def __init__(self, *, kill_grace: float = KILL_GRACE) -> None:
        self.kill_grace = kill_grace

    def turn(self, prompt: str, ctx: TurnContext) -> AsyncIterator[Chunk]:
        """Run ``prompt`` as a shell script in ``ctx.cwd``, yielding its output as it comes.

        The script's stdin is ``/dev/null`` (the prompt is the script, and nobody is there to
        type); its environment is the worker's plus ``TRIO_AGENTD_SESSION`` and
        ``TRIO_AGENTD_TURN``. The script's exit status comes last. The turn
        ends when the script has exited and nothing it started still holds its output; what it
        left running in the background with its output redirected is killed then.

        Cancellation: the script's whole process group gets SIGTERM, then SIGKILL after
        ``kill_grace`` seconds, and is reaped before the cancellation propagates; nothing of
        the turn keeps running.
        """
        return run_command(
            [SHELL, "-c", prompt], ctx, stdin=None, merge_stderr=False,
            kill_grace=self.kill_grace,
        )
