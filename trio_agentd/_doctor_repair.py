"""Executing ``doctor --fix``'s repair plan, step by step, through hooks (real ones here; tests
pass their own), and stopping the workers a dead supervisor left behind.
"""

from __future__ import annotations

import contextlib
import os
import time

from . import _fs
from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._defaults import (
    ADMISSION_POLL_INTERVAL,
    ADMISSION_WAIT,
    KILL_POLL_INTERVAL,
    ORPHAN_EXIT_POLL_INTERVAL,
)
from ._doctor_discover import read_descriptors
from ._doctor_plan import (
    Repair,
    Status,
    Step,
    Verdict,
    classify,
)
from ._doctor_probe import Untrusted, observe, probe_hello
from ._identity import (
    liveness,
    read_start_id,
    signal_group_identity_checked,
    signal_identity_checked,
)
from ._paths import Layout
from ._plain import Plain
from ._procstate import Liveness
from ._registryfiles import (
    GUARD_FILE,
    SHUTDOWN_LOCK_FILE,
    move_aside,
    owner_dir_name,
    write_tombstone,
)
from ._version import APP_VERSION, PROTOCOL_VERSION

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .timing import Timing


class Hooks(Plain):
    """The side effects of a repair, injectable for tests of the executor."""

    __slots__ = (
        "kill",
        "launch",
        "release_admission",
        "remove_socket",
        "reprobe",
        "revoke",
        "take_admission",
        "wait_hello",
    )
    reprobe: Callable[[str], Verdict | None]
    kill: Callable[[int, str | None], bool]  # True once the process is confirmed gone
    launch: Callable[[str, str], None]  # (socket, admission ticket)
    wait_hello: Callable[[str, str], dict[str, Any] | None]  # (socket, old gen) → new hello
    revoke: Callable[[str], None]
    remove_socket: Callable[[str], None]
    take_admission: Callable[[], str | None]  # ticket, or None if someone else holds it
    release_admission: Callable[[], None]

    def __init__(
        self, reprobe: Callable[[str], Verdict | None], kill: Callable[[int, str | None], bool],
        launch: Callable[[str, str], None],
        wait_hello: Callable[[str, str], dict[str, Any] | None], revoke: Callable[[str], None],
        remove_socket: Callable[[str], None], take_admission: Callable[[], str | None],
        release_admission: Callable[[], None],
    ) -> None:
        self.reprobe = reprobe
        self.kill = kill
        self.launch = launch
        self.wait_hello = wait_hello
        self.revoke = revoke
        self.remove_socket = remove_socket
        self.take_admission = take_admission
        self.release_admission = release_admission


class Outcome(Plain):
    __slots__ = ("done", "failed", "new_generation", "new_pid", "repair")
    repair: Repair
    done: list[tuple[Step, str]]
    failed: tuple[Step, str] | None
    new_pid: int | None
    new_generation: str | None

    def __init__(
        self, repair: Repair, done: list[tuple[Step, str]] | None = None,
        failed: tuple[Step, str] | None = None, new_pid: int | None = None,
        new_generation: str | None = None,
    ) -> None:
        self.repair = repair
        self.done = [] if done is None else done
        self.failed = failed
        self.new_pid = new_pid
        self.new_generation = new_generation

    @property
    def ok(self) -> bool:
        return self.repair.declined is None and self.failed is None

    def as_json(self) -> dict[str, Any]:
        return {
            "steps": [{"step": str(s), "result": r} for s, r in self.done],
            "failed": None if self.failed is None
            else {"step": str(self.failed[0]), "result": self.failed[1]},
            "declined": self.repair.declined,
            "new_pid": self.new_pid,
            "new_generation": self.new_generation,
        }


def execute(repair: Repair, hooks: Hooks, *, on_step: Callable[[Step, str], None]) -> Outcome:
    """Run a repair's steps in order; stop at the first that fails (never make things worse).

    The admission, once taken, is released whatever happens.
    """
    out = Outcome(repair)
    if repair.declined:
        return out
    ticket: str | None = None
    try:
        for step in repair.steps:
            ok, text = _run_step(step, repair, hooks, ticket, out)
            if step is Step.TAKE_ADMISSION and ok:
                ticket = text.split()[-1]
                text = "held"
            if not ok:
                out.failed = (step, text)
                on_step(step, f"FAILED: {text}")
                return out
            out.done.append((step, text))
            on_step(step, text)
        return out
    finally:
        if ticket is not None and Step.RELEASE_ADMISSION not in [s for s, _ in out.done]:
            hooks.release_admission()


def _run_step(
    step: Step, repair: Repair, hooks: Hooks, ticket: str | None, out: Outcome
) -> tuple[bool, str]:
    v, sock = repair.verdict, repair.socket
    match step:
        case Step.PROVE_HOME:
            return True, f"generation {v.generation} belongs to this home"
        case Step.TAKE_ADMISSION:
            got = hooks.take_admission()
            if got is None:
                return False, "another shutdown or doctor --fix holds the admission"
            return True, f"ticket {got}"
        case Step.REPROBE_SAME | Step.REPROBE_DEAD:
            again = hooks.reprobe(sock)
            if step is Step.REPROBE_DEAD:
                if again is not None and again.status is not Status.ORPHAN_FILE:
                    return False, f"now {again.status}: left alone"
                return True, "still nobody listening"
            if again is None or again.status not in (Status.OWNERSHIP_LOST, Status.UNREACHABLE):
                status = again.status if again else "gone"
                return False, f"no longer wedged ({status}): left alone"
            if (again.generation, again.pid) != (v.generation, v.pid):
                return False, (f"a different supervisor is there now (generation"
                               f" {again.generation}): never kill a successor")
            return True, f"generation {v.generation} still {again.status}"
        case Step.REVOKE:
            assert v.generation is not None
            hooks.revoke(v.generation)
            return True, f"tombstone written for generation {v.generation}"
        case Step.KILL:
            assert v.pid is not None
            if not hooks.kill(v.pid, v.start_id):
                return False, f"pid {v.pid} survived SIGKILL: socket and workers left as they are"
            return True, f"killed pid {v.pid}, exit confirmed"
        case Step.REMOVE_SOCKET:
            hooks.remove_socket(sock)
            return True, "socket file removed"
        case Step.RELAUNCH:
            assert ticket is not None
            hooks.launch(sock, ticket)
            return True, "new supervisor launched on the same socket"
        case Step.WAIT_HELLO:
            hello = hooks.wait_hello(sock, str(v.generation))
            if hello is None:
                return False, "the new supervisor did not answer (see its daemon.log)"
            out.new_pid = int(hello.get("pid", 0))
            out.new_generation = str(hello.get("generation"))
            return True, f"new supervisor pid {out.new_pid} answers (sessions are re-adopted)"
        case Step.RELEASE_ADMISSION:
            hooks.release_admission()
            return True, "released"


class RealHooks:
    """Hooks that act on this machine."""

    def __init__(self, layout: Layout, timing: Timing | None = None) -> None:
        from .timing import DEFAULT_TIMING

        self.layout = layout
        self.timing = timing or DEFAULT_TIMING
        self._admission_fd: int | None = None

    def hooks(self) -> Hooks:
        return Hooks(
            reprobe=self.reprobe, kill=self.kill, launch=self.launch, wait_hello=self.wait_hello,
            revoke=self.revoke, remove_socket=self.remove_socket,
            take_admission=self.take_admission, release_admission=self.release_admission,
        )

    def _layout_for(self, sock: str) -> Layout:
        return Layout(home=self.layout.home, socket=sock, registry=self.layout.registry)

    def reprobe(self, sock: str) -> Verdict | None:
        """The verdict once it has held for the re-probe window: a supervisor that answers at
        any moment of it is not repaired (it was slow, not wedged)."""
        deadline = time.monotonic() + self.timing.reprobe_window
        while True:
            obs, _ = observe(sock, self._layout_for(sock), timing=self.timing)
            verdict = classify(obs, protocol=PROTOCOL_VERSION, app_version=APP_VERSION)
            if verdict is None or not verdict.problem or time.monotonic() >= deadline:
                return verdict
            time.sleep(self.timing.probe_interval)

    def kill(self, pid: int, start_id: str | None) -> bool:
        import signal

        # SIGKILL alone: it ends a stopped process too, and a SIGCONT first would let a revoked
        # supervisor run between the two signals and answer queued clients "ownership_lost"
        signal_identity_checked(pid, start_id, signal.SIGKILL)
        deadline = time.monotonic() + self.timing.kill_confirm_timeout
        while time.monotonic() < deadline:
            if liveness(pid, start_id) is Liveness.DEAD:
                return True
            time.sleep(KILL_POLL_INTERVAL)
        return liveness(pid, start_id) is Liveness.DEAD

    def launch(self, sock: str, ticket: str) -> None:
        from ._autostart import spawn_daemon

        spawn_daemon(self._layout_for(sock), extra_env={"TRIO_AGENTD_ADMISSION_TICKET": ticket})

    def wait_hello(self, sock: str, old_generation: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.timing.startup_timeout
        while time.monotonic() < deadline:
            try:
                _, _, hello = probe_hello(sock, self.timing)
            except Untrusted:
                return None  # someone else's now: not what we launched
            if hello is not None and hello.get("generation") != old_generation:
                return hello
            time.sleep(self.timing.probe_interval)
        return None

    def revoke(self, generation: str) -> None:
        registry = self.layout.registry
        with _fs.locked_sync(registry / GUARD_FILE):
            write_tombstone(registry, generation, {"by": "doctor", "pid": os.getpid()})
            move_aside(registry, owner_dir_name(generation))

    def remove_socket(self, sock: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)

    def take_admission(self) -> str | None:
        path = self.layout.registry / SHUTDOWN_LOCK_FILE
        _fs.ensure_dir(self.layout.registry)
        deadline = time.monotonic() + ADMISSION_WAIT
        while True:
            fd = _fs.try_lock(path)
            if fd is not None:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(ADMISSION_POLL_INTERVAL)
        ticket = os.urandom(8).hex()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "ticket": ticket}).encode(), 0)
        self._admission_fd = fd
        return ticket

    def release_admission(self) -> None:
        if self._admission_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._admission_fd, 0)
            _fs.unlock(self._admission_fd)
            self._admission_fd = None


def stop_orphan_workers(layout: Layout, sock: str, timing: Timing | None = None) -> list[int]:
    """TERM (then KILL) the live workers of a socket whose supervisor is gone; identity-checked."""
    import signal

    from .timing import DEFAULT_TIMING

    timing = timing or DEFAULT_TIMING
    stopped = []
    for d in read_descriptors(layout.home):
        pid, sid = d.get("pid"), d.get("start_id")
        if d.get("socket") != sock or not isinstance(pid, int) or not isinstance(sid, str):
            continue
        if read_start_id(pid) != sid:
            continue
        # a worker leads its own process group (pgid == pid)
        signal_group_identity_checked(pid, pid, sid, signal.SIGTERM)
        deadline = time.monotonic() + timing.stop_grace
        while time.monotonic() < deadline and liveness(pid, sid) is not Liveness.DEAD:
            time.sleep(ORPHAN_EXIT_POLL_INTERVAL)
        if liveness(pid, sid) is not Liveness.DEAD:
            signal_group_identity_checked(pid, pid, sid, signal.SIGKILL)
        stopped.append(pid)
    return stopped
