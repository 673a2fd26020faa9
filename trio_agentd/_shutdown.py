"""``shutdown --all`` / ``--force``: stop every supervisor found (and its workers)."""

from __future__ import annotations

import json
from typing import Any

from ._defaults import SHUTDOWN_EXIT_WAIT
from ._doctor import survey
from ._doctor_plan import Status
from ._doctor_repair import RealHooks, stop_orphan_workers
from ._errors import AgentdError
from ._identity import wait_gone
from ._paths import Layout


def shutdown_many(layout: Layout, *, every: bool, force: bool, as_json: bool) -> int:
    from ._syncclient import SyncClient

    found = survey(layout)
    if not every:
        found = [f for f in found if f.socket == layout.socket]
    results: list[dict[str, Any]] = []
    hooks = RealHooks(layout)
    for f in found:
        v = f.verdict
        entry: dict[str, Any] = {"socket": f.socket, "status": str(v.status), "pid": v.pid,
                                 "generation": v.generation, "stopped": False, "how": None}
        target = Layout(home=layout.home, socket=f.socket, registry=layout.registry)
        if v.status is Status.FOREIGN:
            entry.update(stopped=True, how=f"not yours ({v.cause}): left alone")
            results.append(entry)
            continue
        if f.observation.hello is not None and v.status is not Status.UNREACHABLE:
            try:
                client = SyncClient(target, autostart=False)
                client.connect()
                client.request("shutdown", {"stop_workers": True}, retry_for=0)
                client.close()
                entry["stopped"] = not v.pid or wait_gone(v.pid, v.start_id, SHUTDOWN_EXIT_WAIT)
                entry["how"] = "shutdown command"
            except AgentdError as exc:
                entry["how"] = f"shutdown command failed: {exc.message}"
        elif v.status is Status.ORPHAN_FILE:
            hooks.remove_socket(f.socket)
            entry.update(stopped=True, how="stale socket file removed")
        if not entry["stopped"] and v.pid and v.start_id and force:
            if v.generation:
                hooks.revoke(v.generation)
            if hooks.kill(v.pid, v.start_id):
                hooks.remove_socket(f.socket)
                entry.update(stopped=True, how="killed (forced, identity-checked)")
            else:
                entry["how"] = f"pid {v.pid} survived SIGKILL"
        if entry["stopped"] or v.pid is None:
            workers = stop_orphan_workers(layout, f.socket)
            if workers:
                entry["workers_stopped"] = workers
                if v.pid is None:
                    entry.update(stopped=True, how="supervisor-less workers stopped")
        if not entry["stopped"] and entry["how"] is None:
            entry["how"] = "wedged — use --force to kill it"
        results.append(entry)
    if as_json:
        print(json.dumps(results))
    else:
        if not results:
            print("no trio-agentd supervisor found")
        for e in results:
            state = "stopped" if e["stopped"] else "NOT stopped"
            print(f"{e['socket']}: {state} (pid {e['pid'] or '-'}; {e['how']})")
    return 0 if all(e["stopped"] for e in results) else 1
