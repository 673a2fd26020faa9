"""A cleaner deletes the state under a live supervisor: it is made again from memory, so a
later crash still finds every worker to adopt."""

from __future__ import annotations

import os
import shutil
import signal

from .harness import DaemonEnv, wait_for


def test_deleted_state_and_registry_are_made_again_and_adoption_still_works(
    denv: DaemonEnv,
) -> None:
    assert denv.prompt("one", session="w") == "[echo turn 1] one"
    worker = next(d["pid"] for d in denv.descriptors() if d["session"] == "w")
    state = denv.state_dir()
    shutil.rmtree(state)
    shutil.rmtree(denv.registry)
    shutil.rmtree(denv.home / "sessions" / "w")
    # the supervisor's self-check makes it all again: descriptor, token, owner record, meta
    wait_for(lambda: (state / "workers" / "w.json").exists(), timeout=10,
             what="the descriptor to be written again")
    assert (state / "workers" / "w.token").exists()
    wait_for(lambda: denv.owner_records() != [], timeout=10, what="the owner record again")
    wait_for(lambda: (denv.home / "sessions" / "w" / "session.json").exists(), timeout=10,
             what="the session's metadata again")
    assert (denv.home / "sessions" / "w").stat().st_mode & 0o777 == 0o700
    # the proof: a crash now still adopts the same worker
    os.kill(int(denv.owner()["pid"]), signal.SIGKILL)
    assert denv.prompt("two", session="w") == "[echo turn 2] two"
    assert next(d["pid"] for d in denv.descriptors() if d["session"] == "w") == worker
