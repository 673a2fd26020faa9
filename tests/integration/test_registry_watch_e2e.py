"""A real worker watches the ownership registry with dnotify, end to end: it holds no inotify
instance (those are the user's, 128 by default, shared with every program they run), and it
drops a supervisor whose record was revoked as soon as the registry changes, with no timer to
help it (the slow fallback poll is set to an hour here)."""

from __future__ import annotations

import json
import os
import signal

from .harness import daemon_env, wait_for


def _fd_targets(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def test_a_worker_watches_the_registry_without_inotify_and_drops_a_revoked_supervisor() -> None:
    from trio_agentd._doctor_repair import RealHooks
    from trio_agentd._paths import Layout

    no_timer = json.dumps({"refence_fallback": 3600})
    with daemon_env(extra_env={"TRIO_AGENTD_TIMING": no_timer}) as denv:
        assert denv.prompt("one", session="s") == "[echo turn 1] one"
        owner = denv.owner()
        generation = owner["generation"]
        worker = int(denv.descriptors()[0]["pid"])
        targets = _fd_targets(worker)
        assert "anon_inode:inotify" not in targets, targets
        # the dnotify marks: the registry and the serving supervisor's record dir, held open
        assert str(denv.registry) in targets, targets
        assert str(denv.registry / f"{generation}.owner") in targets, targets

        log = denv.home / "sessions" / "s" / "worker.log"
        dropped = f"dropping supervisor generation {generation}"
        assert dropped not in log.read_text()
        sup = int(owner["pid"])
        os.kill(sup, signal.SIGSTOP)  # it can neither restore its record nor hang up
        try:
            RealHooks(Layout(home=denv.home, socket=denv.socket, registry=denv.registry)
                      ).revoke(generation)
            wait_for(lambda: dropped in log.read_text(), timeout=20,
                     what="the worker to drop the revoked supervisor")
        finally:
            os.kill(sup, signal.SIGCONT)
        wait_for(lambda: sup not in denv.our_pids(), timeout=20, what="the revoked one to exit")
        # its session goes on under the next supervisor
        assert denv.prompt("two", session="s") == "[echo turn 2] two"
