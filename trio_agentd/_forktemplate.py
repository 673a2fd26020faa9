"""The fork template: a pre-imported process that forks new workers (never while a Trio
loop or a thread runs).

Starting a worker by exec pays a Python start and the import of trio and of the worker's
modules (≈ 100 ms of CPU, ≈ 16 MB of private memory each). The template pays it once: it is
started (``python -E -P -m trio_agentd.worker --template``, the same interpreter and flags as
a worker) by the supervisor, imports everything a worker imports with the collector off,
freezes what they made, runs a warm-up loop to its end (:func:`_warm_up`), collects the
warm-up's garbage, fills the free blocks of its allocator's pools (:func:`_fill_free_blocks`),
freezes its heap (``gc.freeze()``, so the children's collector never writes to the objects
they share) and then waits on a private socketpair (its stdin) for requests. It rehearses a
worker's session (:mod:`._rehearsal`, :class:`_Rehearsal`), each run a whole event loop: one
run before it says it is ready, the rest in its idle moments, between two requests. It never
forks while a loop or a thread runs, so a fork of it is safe.

A request carries three descriptors (``SCM_RIGHTS``: the worker's stdin and stdout pipes and
its log) and the worker's environment. The template forks once and answers with the child's
pid at once; the child calls ``setsid`` (its own session and process group, as an exec'd
worker's), takes the three descriptors as 0, 1, 2, closes every other descriptor, takes the
environment (``os.environ``, so also what its agents inherit; only the variables that differ
are touched), ``cd /``, the signal dispositions of a fresh interpreter, and runs the worker's
``main()``: from there on it is an exec'd worker (config on stdin, the ``go`` gate, ``ready``
on stdout). The template ignores ``SIGCHLD``, so the kernel reaps a worker that exits; a
worker survives the template, and the supervisor waits for it like an adopted worker (a
pidfd).

The supervisor's side, which starts the template, restarts it and sends it requests, is
:mod:`._forkserver`; the wire both speak (a length-prefixed JSON message, descriptors
passed with it) is defined here.
"""

from __future__ import annotations

import array
import contextlib
import errno as _errno
import gc
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._earlytemplate import TEMPLATE_FLAG as TEMPLATE_FLAG

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    import trio

    class IdleWork(Protocol):
        """What the template does in its idle moments, a step at a time (:class:`_Rehearsal`)."""

        left: int  # steps left
        quiet: float  # seconds without a request before a step

        def step(self) -> None: ...

HEADER = struct.Struct("!I")
# the most a request or a reply may be (the environment is the big part): bounded buffers
MAX_MESSAGE = 4 * 1024 * 1024
# environment variables an interpreter reads at its start even under -E (the user site dir
# under HOME; the locale: the filesystem and stdio encodings, UTF-8 mode): a worker whose
# environment differs here from the template's is exec'd, so it starts as it always did
INTERPRETER_ENV = ("HOME", "LANG", "LC_ALL", "LC_CTYPE")


def interpreter_env(env: Mapping[str, str]) -> dict[str, str | None]:
    return {k: env.get(k) for k in INTERPRETER_ENV}


@dataclass(frozen=True, slots=True)
class _WorkerStart:
    """What a freshly forked worker takes over: its three descriptors and its environment."""

    fds: tuple[int, int, int]
    env: dict[str, str]


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _receive_request(sock: socket.socket) -> tuple[list[int], bytes] | None:
    """One request: (its descriptors, its JSON body); ``None`` on EOF (the supervisor is gone)."""
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(
        HEADER.size, socket.CMSG_SPACE(16 * fds.itemsize)
    )
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    received = list(fds)
    if not msg:
        _close_all(received)
        return None
    rest = _recv_exactly(sock, HEADER.size - len(msg))
    if rest is None:
        _close_all(received)
        return None
    (size,) = HEADER.unpack(msg + rest)
    body = _recv_exactly(sock, size) if size <= MAX_MESSAGE else None
    if body is None:
        _close_all(received)
        return None
    return received, body


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _reply(sock: socket.socket, obj: object) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(HEADER.pack(len(body)) + body)


def _fork_worker(sock: socket.socket, fds: list[int], env: dict[str, str]) -> _WorkerStart | None:
    """Fork a worker; in the worker return what it takes over, in the template ``None``
    (after answering the supervisor with the worker's pid or the errno of the failure).

    One fork, and the answer at once: the template waits for no other process to be
    scheduled, so a burst of requests is served back to back (a worker that exits is reaped
    by the kernel: the template ignores SIGCHLD)."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # what the loop allocated since, too: the children share it untouched
    try:
        pid = os.fork()
    except OSError as exc:
        _close_all(fds)
        _reply(sock, {"errno": exc.errno, "error": str(exc)})
        return None
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a worker waits for its own children
        os.setsid()  # its own session and group, before it does anything else
        in_fd, out_fd, err_fd = fds
        return _WorkerStart((in_fd, out_fd, err_fd), env)
    _close_all(fds)  # the worker's alone before anyone hears of it
    _reply(sock, {"pid": pid})
    return None


def _fork_spare(sock: socket.socket, ctrl: int) -> _WorkerStart | None:
    """Fork a *spare*: a worker forked ahead of need, parked on ``ctrl`` (its end of a
    socketpair the supervisor made) until the supervisor sends it one start request (the
    template's format: three descriptors and an environment). In the spare this returns
    that request; it exits when ``ctrl`` closes first (the supervisor dropped it, or died)."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(ctrl)
        _reply(sock, {"errno": exc.errno, "error": str(exc)})
        return None
    if pid != 0:
        os.close(ctrl)  # the spare's alone before anyone hears of it
        _reply(sock, {"pid": pid})
        return None
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    sock.detach()  # closed below by number: the template's loop must not close it again
    # nothing of the template's: only 0, 1, 2 on /dev/null and the control socket
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    os.dup2(ctrl, 3)
    os.closerange(4, _max_fd())
    parked = socket.socket(fileno=3)
    try:
        got = _receive_request(parked)
    except OSError:
        got = None
    parked.close()
    start = _parse_start(got)
    if start is None:
        os._exit(0)  # dropped (EOF), or a request it cannot run: nothing to clean up
    return start


def _parse_start(got: tuple[list[int], bytes] | None) -> _WorkerStart | None:
    if got is None:
        return None
    fds, body = got
    try:
        env = json.loads(body)["env"]
        ok = len(fds) == 3 and isinstance(env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        _close_all(fds)
        return None
    return _WorkerStart((fds[0], fds[1], fds[2]), env)


def _waiting(sock: socket.socket, within: float) -> bool:
    """Whether a request (or the supervisor's EOF) is there to be read within ``within``
    seconds."""
    return bool(select.select([sock], [], [], within)[0])


def _serve(sock: socket.socket, rehearsal: IdleWork | None = None) -> _WorkerStart | None:
    """The template's loop: one request at a time until EOF. Returns in a forked worker.

    ``rehearsal``: run a step at a time once no request has come for its ``quiet`` seconds
    (a waiting request always first), until it has no more to do. A ``status`` request (no
    descriptors) is answered with how many of its runs are left."""
    while True:
        quiet = rehearsal.quiet if rehearsal is not None else 0.0  # since the last request
        while rehearsal is not None and rehearsal.left > 0 and not _waiting(sock, quiet):
            rehearsal.step()
            quiet = 0.0  # still none: the next run at once
        got = _receive_request(sock)
        if got is None:
            return None
        fds, body = got
        try:
            request = json.loads(body)
            spare = request.get("spare") is True
            status = request.get("status") is True
        except (ValueError, AttributeError):
            spare = status = False
        if status:
            _close_all(fds)
            _reply(sock, {"rehearsal_left": rehearsal.left if rehearsal is not None else 0})
            continue
        if spare:
            if len(fds) != 1:
                _close_all(fds)
                _reply(sock, {"errno": _errno.EINVAL, "error": "malformed request"})
                continue
            start = _fork_spare(sock, fds[0])
        else:
            parsed = _parse_start(got)
            if parsed is None:
                _reply(sock, {"errno": _errno.EINVAL, "error": "malformed request"})
                continue
            start = _fork_worker(sock, list(parsed.fds), parsed.env)
        if start is not None:
            sock.close()
            return start


def _preload() -> None:
    """Import what a worker imports, so its forks need not."""
    import resource  # noqa: F401  (the worker raises its descriptor limit)

    import trio  # noqa: F401
    import trio_util  # noqa: F401

    from . import _dnotify, _exhaustion, _fs, _inotify, _trust, _worker, timing  # noqa: F401
    from .agents import _echo, _exec, _shell  # noqa: F401

    # the level a worker logs at, set once here (see _worker.main: setting it clears every
    # logger's cache; the template logs nothing through it, having no handler)
    logging.getLogger().setLevel(logging.INFO)


# the template's filler objects (see :func:`_fill_free_blocks`): alive as long as it is
_fillers: list[object] = []


def _free_blocks() -> dict[int, int]:
    """The free blocks in the object allocator's pools in use, by block size (what
    ``sys._debugmallocstats()`` prints on the C level ``stderr``: read through a memfd).

    Raises:
        OSError: no descriptor for the memfd (or for a copy of ``stderr``).
    """
    out = os.memfd_create("mallocstats")
    with open(out, "rb") as f:
        saved = os.dup(2)
        try:
            os.dup2(out, 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read(1 << 16).decode("ascii", "replace")
    free: dict[int, int] = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) == 5 and all(c.isdigit() for c in cols):
            free[int(cols[1])] = int(cols[4])
    return free


def _fill_free_blocks() -> None:
    """Fill every free block of the object allocator's pools in use with a filler object
    the template keeps. A worker's first objects otherwise go to these blocks, scattered
    over the pages it shares with the template: each one copies a page (and the pool's
    header page). Filled, its objects go to pools of their own, packed.

    Raises:
        OSError: as :func:`_free_blocks`.
    """
    for size, count in sorted(_free_blocks().items()):
        if size <= 16:
            _fillers.extend(object() for _ in range(count))
        elif size <= 32:
            _fillers.extend(float(i) for i in range(count))  # 24 bytes
        else:
            # a bytes object of n bytes takes 33 + n: exactly this block size
            _fillers.extend(bytes(size - 33) for _ in range(count))


# how often the warm-up runs its loop: a function is specialised for what it meets after
# its eighth call (Python 3.11), so ten runs leave the warm-up's code specialised
WARM_UP_RUNS = 10


def _warm_up() -> None:
    """Run, ``WARM_UP_RUNS`` times and to its end, a small event loop with what every worker's
    loop does (tasks in a nursery, cancel scopes, events, a memory channel, a socket stream
    sending and receiving, JSON both ways). A worker's first run of code initialises caches,
    lazy module state, type version tags and its specialised bytecode: each a write to a page
    it shares with the template, copied into each worker. Done once here, the workers share
    the result. The loop is over (its epoll descriptor closed, the signal wake-up descriptor
    restored) before the template forks anything, and it starts no thread.

    Raises:
        OSError: no socket pair for it (out of descriptors).
    """
    import trio

    from ._protocol import Request, Response, ok
    from ._stream import MessageStream

    async def echo(stream: MessageStream, send: trio.MemorySendChannel[object]) -> None:
        request = await stream.receive()
        await send.send(request)
        if isinstance(request, Request):
            await stream.send(ok(request.id, {"text": "up"}))

    async def once() -> None:
        a, b = trio.socket.socketpair()
        left = MessageStream(trio.SocketStream(a))
        right = MessageStream(trio.SocketStream(b))
        send, receive = trio.open_memory_channel[object](1)
        event = trio.Event()
        async with send, receive, trio.open_nursery() as nursery:
            nursery.start_soon(echo, right, send)
            await left.send(Request(id=1, op="prompt", client_id="c", args={"text": "warm"}))
            await receive.receive()
            if not isinstance(await left.receive(), Response):
                raise ValueError("the warm-up's echo answered no response")
            with trio.move_on_after(0):
                await trio.sleep_forever()
            nursery.start_soon(event.wait)
            await trio.lowlevel.checkpoint()
            event.set()
        await left.aclose()
        await right.aclose()

    for _ in range(WARM_UP_RUNS):
        trio.run(once)


class _Rehearsal:
    """The template's rehearsal (:mod:`._rehearsal`): its first run before the template is
    ready (:data:`._rehearsal.RUNS_BEFORE_READY`), then a run per idle moment (``quiet``
    seconds without a request): a request waits for one run at most (a few milliseconds).
    Once the runs are done the rehearsal's garbage is collected and the free blocks it left
    filled, as after the warm-up. A run that fails, or takes longer than ``run_max`` seconds
    (a loaded machine, a slow scratch directory: requests would wait behind the next), ends
    it: the template forks on without the rest (its workers are as good, only less of their
    memory is shared), and one line says why. A run still going at ``run_max`` is cancelled
    then (one that hangs: nobody waits on it longer)."""

    def __init__(self, runs: int, *, run_max: float | None = None,
                 run: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None) -> None:
        from .timing import FORK_TEMPLATE_REHEARSAL_QUIET, FORK_TEMPLATE_REHEARSAL_RUN_MAX

        self.left = runs
        self.quiet = FORK_TEMPLATE_REHEARSAL_QUIET
        self.run_max = FORK_TEMPLATE_REHEARSAL_RUN_MAX if run_max is None else run_max
        self._run = run
        self._clock = clock
        self._say = say if say is not None else _say

    def run_one(self) -> None:
        """One run, and whether to go on (:attr:`left`)."""
        if self._run is None:  # the first run: what killed templates left goes first
            from ._rehearsal import rehearse
            from ._scratch import clear_stale, root_of

            clear_stale(root_of())
            self._run = lambda: rehearse(1, self.run_max)
        t0 = self._clock()
        try:
            self._run()
        except Exception as exc:  # never the template's end: its workers do not need it
            where = ""
            if isinstance(_first(exc), OSError):
                where = ("; its scratch directory goes under $TMPDIR, else /dev/shm: point"
                         " TMPDIR at a private directory with room to fix it")
            self._say(f"rehearsal failed ({_cause(exc)}); forking without the rest of it (the"
                      " workers are as good, they only share less memory with the template)"
                      f"{where}")
            self.left = 0
            return
        took = self._clock() - t0
        self.left -= 1
        if took > self.run_max and self.left > 0:
            self._say(f"a rehearsal run took {took:.3f} s (more than {self.run_max:g} s: a"
                      " loaded machine or a slow scratch directory); forking without the rest")
            self.left = 0

    def step(self) -> None:
        """:meth:`run_one`, its garbage collected; after the last, the free blocks filled."""
        self.run_one()
        gc.collect()
        _no_thread()
        if self.left == 0:
            try:
                _fill_free_blocks()
            except OSError as exc:
                self._say(f"free blocks not filled ({exc})")


def _cause(exc: BaseException) -> str:
    """``exc`` in one line: its type and message; for an event loop's exception group, its
    first exception's."""
    exc = _first(exc)
    return f"{type(exc).__name__}: {exc}"


def _first(exc: BaseException) -> BaseException:
    """``exc``, or for an exception group (an event loop's) its first exception."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _say(line: str) -> None:
    print(f"trio-agentd worker fork template: {line}", file=sys.stderr, flush=True)


def _no_thread() -> None:
    """Exit unless this process runs one thread: never fork a process with threads (the
    supervisor then starts workers by exec)."""
    import threading

    if threading.active_count() != 1:
        sys.exit("trio-agentd worker fork template: an import, the warm-up or the rehearsal"
                 " started a thread; not serving (workers are started by exec)")


def _become_worker(start: _WorkerStart) -> None:
    """In the forked worker: take the descriptors, environment, cwd and signal dispositions
    an exec'd worker starts with."""
    for target, fd in enumerate(start.fds):
        os.dup2(fd, target)
    os.closerange(3, _max_fd())
    take_environ(start.env)
    time.tzset()
    gc.enable()  # as in any interpreter; the template's objects stay frozen, never scanned
    os.chdir("/")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    del sys.argv[1:]  # as ``python -m trio_agentd.worker`` has it: the module's path
    # (the import system's caches are the template's: a user's agent module may be newer,
    # so loading one invalidates them first; see agents._load)


def take_environ(env: Mapping[str, str]) -> None:
    """Make ``os.environ`` (and so the C environment) exactly ``env``, touching only the
    variables that differ. Clearing it and setting it all again frees and remakes every
    string and entry of the template's: a write to each page they sit on, copied into each
    worker (about 0.35 MB). A session created with the daemon's own environment differs in
    few variables, if any. The variables are the same as an exec'd worker's, not always in
    the same order (those the template had keep its order; new ones come last)."""
    for name in [k for k in os.environ if k not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _max_fd() -> int:
    try:
        return max(int(os.sysconf("SC_OPEN_MAX")), 256)
    except (ValueError, OSError):
        return 65536


def serve_template() -> None:
    """``python -m trio_agentd.worker --template``: the template's main. Returns in a forked
    worker, ready for the worker's ``main()``; in the template exits when the supervisor's
    end of the socket closes."""
    # Ctrl-C on a foreground supervisor reaches its process group: the template ends with
    # the supervisor (its socket closes), never with a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # started by posix_spawn (see _earlytemplate), which cannot set a working directory: the
    # template never holds the daemon's (a foreground daemon's is the user's) busy
    with contextlib.suppress(OSError):
        os.chdir("/")
    # the workers and spares it forks are its children: the kernel reaps them (no zombies,
    # no wait for one); each sets SIGCHLD back to the default at once
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    # no collection while it imports: one, after the warm-up, then the holes it leaves filled
    gc.disable()
    # 0, 1, 2 always open (so neither our socket nor a received descriptor is one of them)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(null, fd)
    sock = socket.socket(fileno=os.dup(0))
    os.dup2(null, 0)
    if null > 2:
        os.close(null)
    try:
        _preload()
        # what the imports made is frozen at once: the one collection below then scans only
        # the warm-up's objects (0.3 ms here, against 32-35 ms for all 26,000 of the imports'
        # objects, on the first worker's path), and the children's memory is the same
        gc.freeze()
        try:
            _warm_up()
        except (OSError, ValueError) as exc:
            # a template without it still forks good workers (each pays its first run itself)
            _say(f"warm-up failed ({exc}); serving without it")
        from ._rehearsal import RUNS, RUNS_BEFORE_READY

        rehearsal = _Rehearsal(RUNS)
        for _ in range(RUNS_BEFORE_READY):
            if rehearsal.left:
                rehearsal.run_one()
        _no_thread()
        # the warm-up's garbage (cycles: tasks, frames) collected, then every free block in
        # the pools filled (see _fill_free_blocks), then what is new since frozen too
        gc.collect()
        try:
            _fill_free_blocks()
        except OSError as exc:
            _say(f"free blocks not filled ({exc})")
        gc.freeze()
        _reply(sock, {"ready": os.getpid()})
        start = _serve(sock, rehearsal)
    except (BrokenPipeError, ConnectionResetError):
        start = None  # the supervisor is gone
    if start is None:
        sys.exit(0)
    _become_worker(start)
