"""Test helpers for code that runs on trio-agentd: fakes on MockClock, and real daemons.

Three levels, each also a pytest fixture (the ``trio_agentd`` pytest plugin, registered when
trio-agentd is installed; see docs/testing.md):

- :func:`open_fake_session` (fixture ``agentd_fake_session``) — one session's
  :class:`WorkerHandle` on :class:`FakeWorkerOps`: the recovery schedule at exact virtual
  times.
- :func:`open_fake_supervisor` (fixture ``agentd_fake_supervisor``) — the whole
  :class:`~trio_agentd.Supervisor` on fake workers, clients over memory streams.
- :func:`daemon_env` (fixture ``agentd_daemon``) — a real supervisor and real workers in a
  private home and socket dir; teardown kills exactly the processes the test started, by pid.

Things the source would otherwise have to tell you:

- **Nothing is spawned until asked.** A :class:`WorkerHandle` supervised with
  ``supervise_new`` (as the fakes here do) starts no worker until its first command
  (``handle.call``, ``handle.wait_ready``, :meth:`FakeSession.prompt`); a supervisor starts
  none until a prompt names a session. ``handle.supervise(alive=False, wanted=True)`` spawns
  at once.
- **The last :class:`Behaviour` repeats.** ``FakeWorkerOps(behaviours=[HUNG, ANSWERS])``: the
  first spawn hangs, the second and every later one answers.
- **Which timeout is which** (fields of :class:`trio_agentd.timing.Timing`):
  ``worker_connect_timeout`` bounds a fresh spawn until its worker is ready (a
  ``NEVER_READY`` worker is stopped and respawned after it), and how long a command waits for
  a session to become ready; ``adopt_connect_timeout`` bounds each reconnect to a live worker
  (after ``worker_retry_delays``, then every ``deferred_recovery_recheck`` for
  ``max_deferred_recovery_rounds``); ``stop_grace`` is SIGTERM → SIGKILL and
  ``kill_confirm_timeout`` the wait after SIGKILL; ``link_ping_interval`` +
  ``link_ping_timeout`` find a worker that answers nothing during a command
  (``link_idle_ping_interval`` when idle); more than ``restart_intensity`` respawns within
  ``restart_window`` mark a session failed. Read times from the ``Timing`` in use, never
  hard-code them.
- **When to call** ``trio.testing.wait_all_tasks_blocked()``: after you cause something
  that other tasks react to without your test awaiting it (``FakeProcess.die()``,
  ``FakeProcess.cut()``, ``FakeWorkerOps.registry_changed()``, a file you deleted) and before
  you assert on their reaction at the *same* virtual time; or after ``trio.sleep_until(t)``
  to let every task due at ``t`` run. Where you can, await the outcome itself instead
  (``await handle.mode.wait_value(Mode.READY)``): that is exact and cannot race.
  With ``autojump_clock`` a wait only inside trio (never a thread, socket or file watch) is
  skipped at once; real I/O while the clock jumps makes virtual times meaningless.

Everything is loaded lazily: importing this package (and the pytest plugin) costs no trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._handle import WorkerHandle as WorkerHandle
    from .._recovery import Mode as Mode
    from ._daemon import DaemonEnv as DaemonEnv
    from ._daemon import daemon_env as daemon_env
    from ._daemon import wait_for as wait_for
    from ._fakeops import Behaviour as Behaviour
    from ._fakeops import FakeProcess as FakeProcess
    from ._fakeops import FakeWatcher as FakeWatcher
    from ._fakeops import FakeWorkerOps as FakeWorkerOps
    from ._fakesession import FakeSession as FakeSession
    from ._fakesession import open_fake_session as open_fake_session
    from ._fakesupervisor import FakeSupervisor as FakeSupervisor
    from ._fakesupervisor import MemoryClient as MemoryClient
    from ._fakesupervisor import MemoryListener as MemoryListener
    from ._fakesupervisor import open_fake_supervisor as open_fake_supervisor
    from ._fakesupops import FakeSupervisorOps as FakeSupervisorOps
    from ._memory import MemoryRegistry as MemoryRegistry
    from ._memory import make_owner_record as make_owner_record
    from ._memory import make_worker_core as make_worker_core
    from ._memory import memory_stream_pair as memory_stream_pair

# public name -> the module (relative to this package) that defines it
_LAZY = {
    "WorkerHandle": ".._handle",
    "Mode": ".._recovery",
    "DaemonEnv": "._daemon",
    "daemon_env": "._daemon",
    "wait_for": "._daemon",
    "Behaviour": "._fakeops",
    "FakeProcess": "._fakeops",
    "FakeWatcher": "._fakeops",
    "FakeWorkerOps": "._fakeops",
    "FakeSession": "._fakesession",
    "open_fake_session": "._fakesession",
    "FakeSupervisor": "._fakesupervisor",
    "FakeSupervisorOps": "._fakesupops",
    "MemoryClient": "._fakesupervisor",
    "MemoryListener": "._fakesupervisor",
    "open_fake_supervisor": "._fakesupervisor",
    "MemoryRegistry": "._memory",
    "make_owner_record": "._memory",
    "make_worker_core": "._memory",
    "memory_stream_pair": "._memory",
}

__all__ = [
    "Behaviour",
    "DaemonEnv",
    "FakeProcess",
    "FakeSession",
    "FakeSupervisor",
    "FakeSupervisorOps",
    "FakeWatcher",
    "FakeWorkerOps",
    "MemoryClient",
    "MemoryListener",
    "MemoryRegistry",
    "Mode",
    "WorkerHandle",
    "daemon_env",
    "make_owner_record",
    "make_worker_core",
    "memory_stream_pair",
    "open_fake_session",
    "open_fake_supervisor",
    "wait_for",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trio_agentd.testing' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
