"""The fork template's rehearsal: one session served start to end, in the template itself.

A worker's first run of a function writes to its code object (the call counter, then the
specialised bytecode), and its first use of a lazy cache fills it; in a forked worker each such
write copies a page it shares with the template. The template's warm-up loop (trio's own paths)
covers the event loop; this covers the worker's: its own main loop (:func:`._worker.run_worker`,
the echo agent) in a private scratch directory, bound to its socket there, with a registry
there that names this process as the supervisor; a supervisor that connects, authenticates
and relays prompts, then a client on a direct route with a grant, each prompt journalled and
made durable as a real one; the worker's log through its own handler, format and limits; then
a ``stop``. Run ``RUNS`` times, so that what a worker runs at its start, per connection and
per prompt is specialised before the template forks. It starts no thread (every prompt is
alone, so its journal flush is inline) and leaves no descriptor, file, log handler, signal
disposition or event loop behind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import trio

from ._grant import make_grant
from ._identity import own_start_id
from ._ownership import RECORD_VERSION, OwnerRecord, Phase
from ._protocol import Attach, Auth, AuthOk, Message, Request, Response, WorkerHello
from ._scratch import SCRATCH_PREFIX, scratch_root
from ._stream import MessageStream
from ._worker import _rotating_log, run_worker
from ._workerconfig import WorkerConfig
from .timing import DEFAULT_TIMING, timing_from_env

# a function is specialised for what it meets after its eighth call (Python 3.11)
RUNS = 10
# runs before the template says it is ready: the first run does what a worker would otherwise do
# first in every worker forked before the rest (imports inside functions, lazy caches, code
# objects quickened); a burst of workers forked at once after a cold start would each pay it.
# One run costs a cold start no time it can measure; ten cost it about 30 ms
RUNS_BEFORE_READY = 1
PROMPTS = 3  # per route and run: a turn's second and later prompts take the warm paths
_TOKEN = "rehearsal-token"
_GENERATION = "rehearsal"
_SESSION = "rehearsal"
_SOCKET = "/nonexistent/rehearsal.sock"


class RehearsalFailed(Exception):
    """The rehearsed session answered what a real one would not."""


def _record(pid: int, start_id: str) -> bytes:
    return OwnerRecord(
        version=RECORD_VERSION, generation=_GENERATION, token="t", pid=pid, start_id=start_id,
        socket=_SOCKET, home="/nonexistent", state_dir="/nonexistent", app_version="rehearsal",
        protocol=1, phase=Phase.OWNER, created_at="2026-01-01T00:00:00Z",
        updated_at="2026-01-01T00:00:00Z",
    ).to_json()


async def _expect(ms: MessageStream, kind: type[Message]) -> None:
    msg = await ms.receive()
    if not isinstance(msg, kind):
        raise RehearsalFailed(f"the rehearsed worker answered {msg!r}, not {kind.__name__}")


async def _answer(ms: MessageStream, rid: int) -> Response:
    while True:
        msg = await ms.receive()
        if msg is None:
            raise RehearsalFailed("the rehearsed worker closed the connection")
        if isinstance(msg, Response) and msg.id == rid:
            if not msg.ok:
                raise RehearsalFailed(f"the rehearsed worker refused: {msg.error}")
            return msg


async def _session(scratch: Path) -> None:
    """The worker's own main loop (:func:`._worker.run_worker`) on its socket in ``scratch``,
    with a registry there holding this process as the supervisor; served, then stopped."""
    pid, start_id = os.getpid(), own_start_id()
    registry = scratch / "registry"
    (registry / f"{_GENERATION}.owner").mkdir(parents=True)
    (registry / f"{_GENERATION}.owner" / "owner.json").write_bytes(_record(pid, start_id))
    config = WorkerConfig(
        session_id=_SESSION, agent="echo", token=_TOKEN, supervisor_socket=_SOCKET,
        registry=str(registry), worker_socket=str(scratch / "w.sock"),
        journal=str(scratch / "journal.jsonl"), session_dir=str(scratch / "session"),
        cwd="/",
    )
    config = WorkerConfig.from_json(config.to_json())
    async with contextlib.AsyncExitStack() as opened, trio.open_nursery() as nursery:
        ready = trio.Event()
        nursery.start_soon(partial(run_worker, config, timing_from_env(), ready.set))
        await ready.wait()
        # closed however the run ends (a run past its deadline is cancelled anywhere)
        sup = MessageStream(await trio.open_unix_socket(config.worker_socket))
        opened.push_async_callback(sup.aclose)
        await _expect(sup, WorkerHello)
        await sup.send(Auth(token=_TOKEN, generation=_GENERATION, pid=pid,
                            start_id=start_id, socket=_SOCKET))
        await _expect(sup, AuthOk)
        for i in range(PROMPTS):
            await sup.send(Request(id=i + 1, op="prompt", client_id="sup",
                                   args={"text": "hi", "command_id": i + 1}))
            await _answer(sup, i + 1)
        client = MessageStream(await trio.open_unix_socket(config.worker_socket))
        opened.push_async_callback(client.aclose)
        await _expect(client, WorkerHello)
        grant = make_grant(_TOKEN, _SESSION, _GENERATION,
                           time.time() + DEFAULT_TIMING.grant_ttl)
        await client.send(Attach(grant=grant))
        await _expect(client, AuthOk)
        for i in range(PROMPTS):
            # as the clients ask: output bytes raw after each chunk's frame
            await client.send(Request(id=i + 1, op="prompt", client_id="direct",
                                      args={"text": "hi", "stream": True, "raw": True}))
            await _answer(client, i + 1)
        await client.aclose()
        await sup.send(Request(id=PROMPTS + 1, op="stop", client_id="sup", args={}))
        await _answer(sup, PROMPTS + 1)
        await sup.aclose()


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """Every signal's disposition as it was before (a worker's main loop takes its signals,
    and leaves its stop signals and ``SIGIO`` ignored)."""
    saved = {}
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.getsignal(signum)
        if handler is not None:
            saved[signum] = handler
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _worker_logging(path: Path) -> Iterator[None]:
    """The root logger as a worker's (level INFO; its handler, format and limits: the
    worker's own :func:`._worker._rotating_log`), to ``path``; then as it was."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    root.setLevel(logging.INFO)  # as the worker's basicConfig
    _rotating_log(path)
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            if handler not in handlers:
                handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


async def _session_within(scratch: Path, deadline: float) -> None:
    with trio.fail_after(deadline):
        await _session(scratch)


def rehearse(runs: int = RUNS, deadline: float = math.inf, *,
             clock: trio.abc.Clock | None = None) -> None:
    """Serve one rehearsed session ``runs`` times, each in its own event loop and scratch
    directory (private, under :func:`scratch_root`, removed after); a run still going after
    ``deadline`` seconds is cancelled (a stuck scratch filesystem, a worker that waits on
    something forever), so that a request, or the template's readiness, never waits on it
    longer. ``clock``: the event loop's (tests).

    Raises:
        OSError: no scratch directory or socket pair (out of descriptors, a full disk), or
            the scratch directory could not be removed.
        RehearsalFailed: the session did not answer as a real one does (inside the event
            loop's exception group), or a run went past ``deadline``.
    """
    root = scratch_root()
    for _ in range(runs):
        scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root))
        try:
            with _worker_logging(scratch / "worker.log"), _signals_kept():
                try:
                    trio.run(_session_within, scratch, deadline, clock=clock)
                except trio.TooSlowError:
                    raise RehearsalFailed(
                        f"a run went on past {deadline:g} s (a loaded machine or a slow scratch"
                        " directory) and was cancelled") from None
        finally:
            shutil.rmtree(scratch)
