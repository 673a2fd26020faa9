"""The fork template's own protocol, against a real template process (no supervisor): a
request forks a worker that runs the worker's ``main()`` on the three descriptors it was
given, in the environment it was given; a malformed request is refused and the template
serves on; it exits when its socket closes, and its workers do not."""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from trio_agentd import _forkserver
from trio_agentd._forkserver import ForkServer
from trio_agentd._forktemplate import HEADER, TEMPLATE_FLAG, interpreter_env
from trio_agentd._trust import isolated_python

from .harness import wait_for


def _send(sock: socket.socket, body: object, fds: list[int]) -> None:
    data = json.dumps(body).encode()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([HEADER.pack(len(data)) + data], anc)


def _recv(sock: socket.socket) -> dict[str, object]:
    head = b""
    while len(head) < HEADER.size:
        chunk = sock.recv(HEADER.size - len(head))
        assert chunk, "the template closed its socket"
        head += chunk
    (size,) = HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        assert chunk
        body += chunk
    reply = json.loads(body)
    assert isinstance(reply, dict)
    return reply


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _rehearsal_left(sock: socket.socket) -> int:
    _send(sock, {"status": True}, [])
    left = _recv(sock)["rehearsal_left"]
    assert isinstance(left, int)
    return left


def _rehearsed(sock: socket.socket) -> None:
    """Wait until the template has rehearsed (its scratch descriptors are closed then).
    Asked less often than the quiet the rehearsal waits for: each question is a request."""
    from trio_agentd.timing import FORK_TEMPLATE_REHEARSAL_QUIET

    wait_for(lambda: _rehearsal_left(sock) == 0, timeout=30, what="the template's rehearsal",
             interval=5 * FORK_TEMPLATE_REHEARSAL_QUIET)


@pytest.fixture
def template() -> Iterator[tuple[subprocess.Popen[bytes], socket.socket]]:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([*isolated_python("trio_agentd.worker"), TEMPLATE_FLAG],
                            stdin=theirs.fileno(), stdout=subprocess.DEVNULL, cwd="/")
    theirs.close()
    ours.settimeout(30)
    try:
        assert _recv(ours) == {"ready": proc.pid}
        yield proc, ours
    finally:
        ours.close()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


def test_a_forked_worker_runs_main_on_its_descriptors_and_environment(
    template: tuple[subprocess.Popen[bytes], socket.socket],
) -> None:
    proc, sock = template
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    _send(sock, {"env": {"FS_MARK": "x"}}, [in_r, out_w, err_w])
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    reply = _recv(sock)
    pid = reply["pid"]
    assert isinstance(pid, int)
    try:
        # one fork, answered at once: the template's child, which makes its own session and
        # group as its first act
        assert _stat(pid)[1] == str(proc.pid)
        wait_for(lambda: _stat(pid)[2:4] == [str(pid), str(pid)], timeout=10,
                 what="the worker's setsid")
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        # the worker's main() reads its config from the stdin we gave: none, so it says so
        # on the stderr we gave and exits 1; nothing on stdout (our pipe sees EOF)
        os.close(in_w)
        assert os.read(out_r, 100) == b""
        err = b""
        while chunk := os.read(err_r, 4096):
            err += chunk
        assert b"no config on stdin" in err
        wait_for(lambda: not _alive(pid), timeout=10, what="the worker to exit")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for fd in (out_r, err_r):
            os.close(fd)


def test_a_malformed_request_is_refused_and_the_template_serves_on(
    template: tuple[subprocess.Popen[bytes], socket.socket],
) -> None:
    proc, sock = template
    r, w = os.pipe()
    _send(sock, {"env": {"A": 1}}, [r, w, w])
    assert _recv(sock)["errno"] == 22  # EINVAL
    _send(sock, {"nothing": True}, [])
    assert _recv(sock)["errno"] == 22
    os.close(r)
    os.close(w)
    assert proc.poll() is None


def test_the_template_exits_when_its_socket_closes_and_its_workers_stay(
    template: tuple[subprocess.Popen[bytes], socket.socket],
) -> None:
    proc, sock = template
    in_r, in_w = os.pipe()
    null = os.open(os.devnull, os.O_WRONLY)
    _send(sock, {"env": {}}, [in_r, null, null])
    os.close(in_r)
    os.close(null)
    pid = _recv(sock)["pid"]
    assert isinstance(pid, int)
    try:
        sock.close()
        assert proc.wait(timeout=10) == 0
        assert _alive(pid)  # waiting on its stdin for a config
    finally:
        os.close(in_w)  # EOF: it exits
        wait_for(lambda: not _alive(pid), timeout=10, what="the worker to exit")


def test_only_an_environment_the_template_can_start_like_is_forked() -> None:
    fs = ForkServer(restart_delay=0.5)
    env = {"HOME": "/h", "LANG": "C.UTF-8", "PATH": "/bin"}
    assert interpreter_env(env) == {"HOME": "/h", "LANG": "C.UTF-8", "LC_ALL": None,
                                    "LC_CTYPE": None}
    fs._env = dict(env)
    assert not fs.usable_for(env)  # not ready
    fs.ready.set()
    assert fs.usable_for({**env, "PATH": "/usr/bin", "X": "1"})
    assert not fs.usable_for({**env, "HOME": "/other"})
    assert not fs.usable_for({**env, "LC_ALL": "C"})


async def _ready_template(fs: ForkServer, old: int | None = None) -> int:
    with trio.fail_after(30):
        await fs.ready.wait()
    assert fs.pid is not None
    assert fs.pid != old
    return fs.pid


async def _fork_one(fs: ForkServer) -> int | None:
    """A fork whose worker exits at once (its stdin is closed: no config)."""
    in_r, in_w = os.pipe()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        return await fs.spawn(dict(os.environ), (in_r, null, null))
    finally:
        for fd in (in_r, in_w, null):
            os.close(fd)


async def test_a_wedged_template_is_killed_and_another_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_forkserver, "REQUEST_TIMEOUT", 0.3)
    fs = ForkServer(restart_delay=0.01)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.run)
        first = await _ready_template(fs)
        assert isinstance(await _fork_one(fs), int)
        # a template that does not answer: the spawn gives up (exec instead), it is killed
        os.kill(first, signal.SIGSTOP)
        assert await _fork_one(fs) is None
        assert not fs.ready.is_set()
        second = await _ready_template(fs, first)
        assert not _alive(first)
        pid = await _fork_one(fs)
        assert isinstance(pid, int)
        assert pid not in (first, second)
        nursery.cancel_scope.cancel()
    # cancelled (the supervisor stops): the template is killed and reaped
    assert not _alive(second)
    assert fs.pid is None


async def test_requests_are_pipelined_and_an_abandoned_one_costs_nothing() -> None:
    """Many forks at once are answered in order, each with its own worker; a caller that
    stops waiting leaves the template serving (its answer is read and dropped)."""
    fs = ForkServer(restart_delay=0.01)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.run)
        template = await _ready_template(fs)
        pids: list[int | None] = []

        async def one() -> None:
            pids.append(await _fork_one(fs))

        async with trio.open_nursery() as burst:
            for _ in range(20):
                burst.start_soon(one)
        assert len(pids) == 20
        assert all(isinstance(p, int) for p in pids)
        assert len(set(pids)) == 20
        with trio.move_on_after(0):
            await _fork_one(fs)  # abandoned at its first checkpoint
        assert isinstance(await _fork_one(fs), int)
        assert fs.pid == template
        assert fs.ready.is_set()
        nursery.cancel_scope.cancel()


def _fds(pid: int) -> dict[int, str]:
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return out


def _spare(sock: socket.socket) -> tuple[socket.socket, int]:
    """Ask the template for a spare: our end of its socket, and its pid."""
    ours, theirs = socket.socketpair()
    _send(sock, {"spare": True}, [theirs.fileno()])
    theirs.close()
    pid = _recv(sock)["pid"]
    assert isinstance(pid, int)
    return ours, pid


def test_a_spare_holds_only_dev_null_and_its_socket_and_takes_one_start(
    template: tuple[subprocess.Popen[bytes], socket.socket],
) -> None:
    proc, sock = template
    ours, pid = _spare(sock)
    try:
        assert _stat(pid)[1] == str(proc.pid)

        def parked() -> dict[int, str]:
            fds = _fds(pid)
            return fds if len(fds) == 4 and _stat(pid)[2] == str(pid) else {}

        # nothing of the template's: its socket, descriptors and log are closed
        fds: dict[int, str] = wait_for(parked, timeout=10, what="the spare to park")
        assert fds[0] == fds[1] == fds[2] == "/dev/null", fds
        assert fds[3].startswith("socket:")
        tsocks = {t for t in _fds(proc.pid).values() if t.startswith("socket:")}
        assert fds[3] not in tsocks
        # one start: it becomes a worker on these descriptors (no config: it says so, exits)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        _send(ours, {"env": {"FS_MARK": "spare"}}, [in_r, out_w, err_w])
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        # ... and never a second: its end of the socket is closed once the first came
        assert ours.recv(1) == b""
        os.close(in_w)
        err = b""
        while chunk := os.read(err_r, 4096):
            err += chunk
        assert b"no config on stdin" in err
        assert os.read(out_r, 100) == b""
        os.close(out_r)
        os.close(err_r)
        wait_for(lambda: not _alive(pid), timeout=10, what="the worker to exit")
    finally:
        ours.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_spare_exits_when_its_socket_closes(
    template: tuple[subprocess.Popen[bytes], socket.socket],
) -> None:
    _proc, sock = template
    ours, pid = _spare(sock)
    try:
        assert _alive(pid)
        ours.close()  # dropped, or its supervisor died
        wait_for(lambda: not _alive(pid), timeout=10, what="the spare to exit")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_the_pool_keeps_spares_by_demand_and_hands_each_out_once() -> None:
    fs = ForkServer(restart_delay=0.01, max_spares=3, demand_window=0.5)
    assert fs.spare_target(0.0) == 1
    for t in (0.0, 0.1, 0.2, 0.3):
        fs.note_spawn(t)
    assert fs.spare_target(0.3) == 3  # capped
    assert fs.spare_target(0.65) == 2  # 0.0 and 0.1 aged out
    assert fs.spare_target(0.75) == 1
    assert fs.spare_target(5.0) == 1  # no demand: still one
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.run)
        await _ready_template(fs)
        with trio.fail_after(30):
            await fs.parked.wait_value(lambda n: n > 0)
        env = dict(os.environ)
        first = fs.take_spare(env)
        assert first is not None
        assert first not in fs.spares
        assert fs.take_spare({**env, "LANG": "xx_XX.nope"}) is None  # another interpreter
        # the pool forks another in its place, never the same one again
        with trio.fail_after(30):
            await fs.parked.wait_value(lambda n: n > 0)
        assert all(s.pid != first.pid for s in fs.spares)
        first.sock.close()
        wait_for(lambda: not _alive(first.pid), timeout=10, what="the dropped spare to exit")
        kept = [s.pid for s in fs.spares]
        nursery.cancel_scope.cancel()
    # the supervisor stops: every spare's socket closes and each exits
    wait_for(lambda: not any(_alive(p) for p in kept), timeout=10, what="the spares to exit")


def test_the_early_template_holds_only_its_socket_and_stdio_and_runs_in_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object,
) -> None:
    """The template an autostarted daemon starts first thing (``posix_spawn``, no
    ``close_fds``) inherits none of the daemon's inheritable descriptors (an autostarted
    daemon's readiness pipe is one: held by the template, its client would not see the
    daemon exit) and leaves the daemon's working directory."""
    from trio_agentd import _earlytemplate

    monkeypatch.setattr(_earlytemplate, "_early", None)
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    ready_r, ready_w = os.pipe()
    os.set_inheritable(ready_w, True)
    monkeypatch.chdir(str(tmp_path))
    try:
        _earlytemplate.start()
    finally:
        os.close(ready_w)
    early = _earlytemplate.take()
    assert early is not None
    sock = socket.socket(fileno=early.sock_fd)
    sock.settimeout(30)
    try:
        assert _recv(sock) == {"ready": early.pid}
        _rehearsed(sock)
        fds = {int(n): os.readlink(f"/proc/{early.pid}/fd/{n}")
               for n in os.listdir(f"/proc/{early.pid}/fd")}
        pipe = os.readlink(f"/proc/self/fd/{ready_r}")  # the read end: same pipe inode
        assert pipe not in fds.values(), fds
        assert fds[1] == os.devnull
        assert len([t for t in fds.values() if t.startswith("socket:")]) == 1, fds
        assert os.readlink(f"/proc/{early.pid}/cwd") == "/"
        # nobody else holds the readiness pipe's write end: its reader sees end of file
        assert os.read(ready_r, 10) == b""
    finally:
        sock.close()
        os.close(ready_r)
        wait_for(lambda: not _alive(early.pid), timeout=10, what="the template to exit")
        os.waitpid(early.pid, 0)


def test_the_template_rehearses_between_requests_and_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    """Ready after the rehearsal's first run, before the rest: a request already waiting
    when it is ready is answered first, with the runs before ready done and no other; once
    the rest are done, the template holds only its socket and stdio, its scratch directories
    are gone (and a killed template's left before it started), and it forks as before."""
    from trio_agentd._rehearsal import RUNS, RUNS_BEFORE_READY
    from trio_agentd._scratch import SCRATCH_PREFIX

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now: its scratch is a killed template's leftover
    (tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-old" / "session").mkdir(parents=True)
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([*isolated_python("trio_agentd.worker"), TEMPLATE_FLAG],
                            stdin=theirs.fileno(), stdout=subprocess.DEVNULL, cwd="/",
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    theirs.close()
    ours.settimeout(30)
    try:
        _send(ours, {"status": True}, [])  # waiting before the template is even ready
        assert _recv(ours) == {"ready": proc.pid}
        assert _recv(ours) == {"rehearsal_left": RUNS - RUNS_BEFORE_READY}
        assert 0 < RUNS_BEFORE_READY < RUNS
        _rehearsed(ours)
        fds = _fds(proc.pid)
        # stdin, stdout on /dev/null; stderr ours (inherited); one socket, its own
        assert {fd: fds[fd] for fd in (0, 1, 2)} == {
            0: os.devnull, 1: os.devnull, 2: os.readlink("/proc/self/fd/2")}, fds
        assert len(fds) == 4, fds
        assert sum(t.startswith("socket:") for t in fds.values()) == 1, fds
        assert os.listdir(str(tmp_path)) == []
        spare, pid = _spare(ours)
        spare.close()  # dropped: it exits
        wait_for(lambda: not _alive(pid), timeout=10, what="the spare to exit")
    finally:
        ours.close()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


async def test_a_stopped_supervisor_clears_what_its_killed_template_was_rehearsing_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The template is killed when the supervisor stops, maybe in the middle of a rehearsal
    run: no later template starts to clear that run's scratch directory, so the supervisor
    does, once the template is reaped. Another live process's is left alone."""
    from trio_agentd._scratch import SCRATCH_PREFIX

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    fs = ForkServer(restart_delay=0.5)
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-rehearsing"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.run)
        template = await _ready_template(fs)
        # what a run in flight holds when the template is killed
        (tmp_path / f"{SCRATCH_PREFIX}{template}-mid-run" / "session").mkdir(parents=True)
        (tmp_path / f"{SCRATCH_PREFIX}{template}-mid-run" / "w.sock").touch()
        live.mkdir()
        nursery.cancel_scope.cancel()
    assert not _alive(template)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
