"""Printing for ``ps`` and ``doctor``: an aligned table, the remedy footers, doctor's run."""

from __future__ import annotations

import os
import sys

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._doctor import Found, survey
from ._doctor_plan import PROBLEMS, Repair, Status, Step, plan_repair, remedy
from ._paths import Layout
from ._text import printable

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from typing import Any

    from ._doctor_repair import Outcome

_COLOURS = {
    Status.CURRENT: "32",
    Status.STARTING: "36",
    Status.STOPPING: "36",
    Status.STALE: "33",
    Status.OWNERSHIP_LOST: "31",
    Status.UNREACHABLE: "31",
    Status.ORPHAN_FILE: "33",
    Status.FOREIGN: "35",
}


def _colour(out: Any) -> bool:
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def print_table(found: list[Found], *, out: Any = None, now: float | None = None) -> None:
    """The ``ps`` table; uptimes count to ``now`` (epoch seconds; default: the wall clock)."""
    out = out or sys.stdout
    if not found:
        print("no trio-agentd supervisor found", file=out)
        return
    colour = _colour(out)
    headers = ["", "SOCKET", "PID", "VERSION", "STATUS", "SESSIONS", "UPTIME"]
    rows = []
    for f in found:
        j = f.as_json(now=now)
        status = str(f.verdict.status) + (f" ({f.verdict.cause})" if f.verdict.cause else "")
        # every cell escaped: a version or socket path read from files may hold escapes
        rows.append([printable(c) for c in (
            "*" if j["is_default"] else "", f.socket, str(j["pid"] or "-"),
            str(j["app_version"] or "-"), status, str(j["sessions"]), _age(j["uptime_s"]))])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(), file=out)
    for f, r in zip(found, rows, strict=True):
        cells = [c.ljust(w) for c, w in zip(r, widths, strict=True)]
        if colour:
            cells[4] = f"\033[{_COLOURS[f.verdict.status]}m{cells[4]}\033[0m"
        print("  ".join(cells).rstrip(), file=out)
    footers = [remedy(f.socket, f.verdict) for f in found]
    for line in footers:
        if line:
            line = printable(line)
            print(f"\033[31m{line}\033[0m" if colour else line, file=out)


def run_doctor(layout: Layout, *, fix: bool, dry_run: bool, as_json: bool) -> bool:
    """doctor [--fix] [--dry-run]: whether a problem is left unfixed (the CLI's exit code)."""
    found = survey(layout)
    problems = [f for f in found if f.verdict.status in PROBLEMS]
    plans: list[tuple[Found, Repair | None]] = [
        (f, plan_repair(f.socket, f.verdict, home_proven=f.home_proven, home=layout.home_dir))
        for f in problems
    ]
    outcomes: dict[str, Outcome] = {}
    log_lines: list[str] = []
    if fix:
        from ._doctor_repair import RealHooks, execute  # only --fix repairs: ps and doctor don't

        hooks = RealHooks(layout).hooks()
        for f, repair in plans:
            if repair is None:
                continue

            def note(step: Step, text: str, sock: str = f.socket) -> None:
                line = f"{sock}: {step}: {text}"
                log_lines.append(line)
                if not as_json:
                    print(printable(line))

            outcomes[f.socket] = execute(repair, hooks, on_step=note)
            if repair.declined and not as_json:
                print(printable(repair.describe()))
    unfixed = [f for f, _ in plans if not (f.socket in outcomes and outcomes[f.socket].ok)]
    if as_json:
        rows = []
        for f in found:
            row = f.as_json()
            plan = next((p for g, p in plans if g is f), None)
            row["plan"] = plan.describe() if plan else None
            row["repair"] = outcomes[f.socket].as_json() if f.socket in outcomes else None
            rows.append(row)
        print(json.dumps(rows))
    else:
        if not found:
            print("nothing found: no trio-agentd supervisor is running for this user")
            return False
        if not fix:
            print_table(found)
        if dry_run:
            for _f, plan in plans:
                if plan is not None:
                    print(printable(f"plan: {plan.describe()}"))
        if fix and outcomes:
            for sock, outcome in outcomes.items():
                if outcome.ok:
                    print(printable(f"{sock}: repaired — new supervisor pid {outcome.new_pid}"
                                    if outcome.new_pid else f"{sock}: repaired"))
                elif outcome.failed:
                    print(printable(f"{sock}: NOT repaired — {outcome.failed[0]} failed:"
                                    f" {outcome.failed[1]}"))
        if not problems:
            print("no problems found")
    return bool(unfixed)
