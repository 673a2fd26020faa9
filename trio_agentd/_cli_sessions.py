"""The commands on one supervisor's sessions: ``sessions``, ``kill``, ``cancel``, ``retry``,
``rm`` and ``logs``."""

from __future__ import annotations

import sys

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._cli_args import UsageError
from ._cli_exit import EXIT_OK
from ._cli_io import Answer, new_client
from ._sessionid import SESSION_ID_RULE, is_session_id

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from ._paths import Layout


def session_arg(session: str) -> str:
    if not is_session_id(session):
        raise UsageError(f"invalid session id {session!r}: use {SESSION_ID_RULE}")
    return session


def cmd_sessions(layout: Layout, args: argparse.Namespace) -> int:
    client = new_client(layout)
    rows = client.request("sessions")
    client.close()
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    if not rows:
        print("no sessions")
        return EXIT_OK
    from ._text import printable

    headers = ["SESSION", "AGENT", "STATE", "PID", "VERSION", "RESTARTS", "TURNS", "IDLE",
               "CAUSE"]
    # every cell escaped: an agent spec may carry ANSI/OSC sequences or bidi overrides; the
    # version is the worker's own word (its hello)
    table = [
        [printable(str(c)) for c in (
            r["session"], r["agent"], r["state"], r["pid"] or "-", r.get("version") or "-",
            r["restarts"], r["turns"], f"{r['idle_s']:.0f}s", r.get("cause") or "")]
        for r in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    for row in [headers, *table]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return EXIT_OK


def cmd_logs(layout: Layout, args: argparse.Namespace) -> int:
    from . import _logs

    if args.lines is not None and args.lines < 0:
        raise UsageError("-n needs a whole number >= 0")
    out = Answer().write_bytes
    if args.daemon:
        if args.session is not None:
            raise UsageError("logs --daemon takes no SESSION")
        if args.json:
            raise UsageError("logs --daemon has no --json (the log is lines of text)")
        _logs.follow_daemon_log(layout.log_path, out, last=args.lines, follow=args.follow)
        return EXIT_OK
    if args.session is None:
        raise UsageError("logs needs SESSION (or --daemon for the supervisor's log)")
    session_dir = _logs.session_dir_of(layout, session_arg(args.session))
    printer = _logs.Printer(out, as_json=args.json)
    if not args.follow:
        _logs.print_history(printer, session_dir, args.lines)
        return EXIT_OK
    follower = _logs.Follower(printer, session_dir)  # from here on: nothing is missed
    try:
        _logs.print_history(printer, session_dir, args.lines, follower.tail)
        client = new_client(layout)
        _logs.follow_session(layout, args.session, follower, client=client,
                             notice=lambda line: print(f"trio-agentd: {line}",
                                                       file=sys.stderr, flush=True))
    finally:
        follower.close()
    return EXIT_OK


def cmd_kill(layout: Layout, args: argparse.Namespace) -> int:
    new_client(layout).request("kill_session", {"session": args.session})
    print(f"killed session {args.session}")
    return EXIT_OK


def cmd_cancel(layout: Layout, args: argparse.Namespace) -> int:
    done = new_client(layout).request("cancel", {"session": args.session})
    print(f"cancelled the running turn of session {args.session}"
          if isinstance(done, dict) and done.get("cancelled")
          else f"session {args.session} runs no turn")
    return EXIT_OK


def cmd_rm(layout: Layout, args: argparse.Namespace) -> int:
    new_client(layout).request(
        "remove_session", {"session": session_arg(args.session),
                           "force": args.force}, retry_for=0)
    print(f"removed session {args.session}")
    return EXIT_OK


def cmd_retry(layout: Layout, args: argparse.Namespace) -> int:
    done = new_client(layout).request("retry_session", {"session": args.session})
    if isinstance(done, dict) and done.get("retried") is False:
        print(f"session {args.session} is {done.get('state')}: nothing to retry"
              " (it has not failed)")
    else:
        print(f"re-armed session {args.session}")
    return EXIT_OK


SESSION_COMMANDS: dict[str, Callable[[Layout, argparse.Namespace], int]] = {
    "sessions": cmd_sessions, "kill": cmd_kill, "cancel": cmd_cancel, "rm": cmd_rm,
    "retry": cmd_retry, "logs": cmd_logs,
}
