"""The argparse parser of the whole command line, for everything but the warm paths: every
command's options, its help with examples and the exit statuses, the overview a bare
``trio-agentd`` prints, ``--version``, and the shell completion made from the parser.
"""

from __future__ import annotations

from ._cli_exit import EXIT_FAIL, EXIT_OK
from ._cli_io import error
from ._sessionid import SESSION_ID_RULE

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    import argparse
    from typing import Any


_EXIT_EPILOG = (
    "exit status: 0 success, 1 failure, 2 usage error, 3 doctor found a problem it did not fix,"
    " 141 stdout was closed early (e.g. `trio-agentd -p ... | head -1`): like `yes | head`"
    " (128 + SIGPIPE), the command ends quietly, without a message. A prompt (-p) exits with"
    " its agent's exit status instead: N as the agent exited, 128+N if it was killed by signal"
    " N, 130 after Ctrl-C cancelled it, 126/127 if an exec: program cannot be run / is not"
    " found, 125 if trio-agentd itself failed (the daemon, the session, the connection), 2 for"
    " a usage error (nothing was sent); --json tells them apart for sure"
)


_AGENT_FORMS = """\
agents (--agent, or default_agent in the config file):
  echo            answers with the prompt itself (the default)
  shell           the prompt is a /bin/sh script, run in one shell that lives as long as
                  the session (cd and variables carry over from turn to turn)
  exec:COMMAND    runs COMMAND (split as a shell would, no shell) once per prompt, the
                  prompt on its stdin: exec:my-agent --model x
  module:attr     a Python agent: attr() (a factory without arguments) returns it:
                  my_pkg.agents:make_agent (docs/agents.md)"""


_AGENT_HELP = ("agent of a new session (default: default_agent in the config file, else echo):"
               " echo, shell, exec:COMMAND or module:attr")


def _fill(text: str) -> str:
    import textwrap

    return "\n\n".join(textwrap.fill(part, 92) for part in text.split("\n\n"))


def _epilog(examples: str, *more: str) -> str:
    """A subcommand's epilog: its examples, then anything else (as written), then the exit
    statuses."""
    parts = ["examples:\n" + "\n".join(f"  {line}" if line else "" for line in
                                       examples.strip("\n").split("\n"))]
    return "\n\n".join([*parts, *more, _fill(_EXIT_EPILOG)])


def build_parser() -> argparse.ArgumentParser:
    import argparse

    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="trio-agentd", formatter_class=raw,
        description=_fill("Long-lived agent sessions that survive anything: a per-user"
                          " supervisor (started by the first command that needs it) runs one"
                          " worker process per session."),
        epilog=_epilog(_EXAMPLES, "Run `trio-agentd COMMAND --help` for a command's options"
                       " and examples."),
    )
    p.add_argument("--version", action="store_true",
                   help="print the version (and protocol version) and exit")
    p.add_argument("--socket", "--daemon-socket", dest="socket",
                   help="supervisor socket path (default: TRIO_AGENTD_SOCKET, else in"
                   " $XDG_RUNTIME_DIR)")
    p.add_argument("--home", help="state directory (default: TRIO_AGENTD_HOME, else the"
                   " platform state dir)")
    # the ownership registry (TRIO_AGENTD_REGISTRY_DIR); autostart passes it to the daemon
    p.add_argument("--registry", help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="client commands: print each connection step on stderr (socket and"
                   " how it was proved ours, autostart, route, timings); daemon: debug log")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def cmd(name: str, help: str, description: str, examples: str,
            *more: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=_fill(description),
                              epilog=_epilog(examples, *more), formatter_class=raw, **kw)

    # only for --help (and completion): parse_prompt_args parses what follows "prompt" / "-p"
    pr = cmd(
        "prompt", "send a prompt to a session (also: -p)",
        "Send TEXT (its words joined with spaces) to a session and print the answer as it"
        " streams. The session is created on its first prompt (with --agent, or the default"
        " agent); the supervisor is started if none runs. Options may come before or after"
        " TEXT; after -- everything is TEXT. With TEXT '-', or no TEXT and stdin not a"
        " terminal, the prompt is stdin (UTF-8, one trailing newline dropped).",
        "trio-agentd -p hello\n"
        "trio-agentd -p -s build --agent shell 'make test'\n"
        "echo hello | trio-agentd -p -s chat\n"
        "trio-agentd -p --json -- --not-an-option",
        _AGENT_FORMS,
        usage="trio-agentd -p [-s SESSION] [--agent AGENT] [--cwd DIR] [--json] [-v] [--]"
        " [TEXT ... | -]",
    )
    pr.add_argument("-s", "--session", default="default",
                    help=f"session id (default: default): {SESSION_ID_RULE}")
    pr.add_argument("--agent", default=None, help=_AGENT_HELP)
    pr.add_argument("--cwd", default=None, metavar="DIR",
                    help="working directory of a new session (default: the current one)")
    pr.add_argument("--json", action="store_true", help="print the result as JSON")
    pr.add_argument("text", nargs="*", metavar="TEXT")

    s = cmd("sessions", "list sessions",
            "List the sessions of the supervisor: agent, state, worker pid and version,"
            " restarts, turns, idle time, and why a session failed.",
            "trio-agentd sessions\ntrio-agentd sessions --json | jq '.[].session'")
    s.add_argument("--json", action="store_true", help="print them as a JSON array")

    k = cmd("kill", "stop a session's worker and forget the session",
            "Stop SESSION's worker (a running turn is killed: its client gets session_killed)"
            " and forget the session. Its data stays on disk (see rm).",
            "trio-agentd kill build")
    k.add_argument("session", metavar="SESSION")
    c = cmd("cancel", "cancel the turn a session is running (as Ctrl-C on -p)",
            "Cancel the turn SESSION is running, as Ctrl-C on its trio-agentd -p would: the"
            " agent is interrupted, the session stays and takes the next prompt.",
            "trio-agentd cancel build")
    c.add_argument("session", metavar="SESSION")
    r = cmd("retry", "re-arm a session marked failed",
            "A session whose worker kept crashing is marked failed and refuses prompts;"
            " retry clears that, and its next prompt starts a worker again.",
            "trio-agentd retry build")
    r.add_argument("session", metavar="SESSION")

    lg = cmd(
        "logs", "a session's history (-f: follow it live), or the supervisor's log",
        "Print SESSION's transcript: each turn's prompt, its output (the bytes exactly),"
        " stderr and exit status, and events (worker started/stopped, turns cancelled,"
        " killed, failed or interrupted by a restart). -f then follows new turns as they"
        " stream, whichever client sends them. --daemon prints the supervisor's log.",
        "trio-agentd logs build -n 3\ntrio-agentd logs -f build\ntrio-agentd logs --daemon -n 50",
    )
    lg.add_argument("session", nargs="?", metavar="SESSION")
    lg.add_argument("-n", "--lines", type=int, default=None, metavar="N",
                    help="only the last N turns (with --daemon: lines)")
    lg.add_argument("-f", "--follow", action="store_true", help="follow as it grows")
    lg.add_argument("--json", action="store_true", help="one JSON object per line")
    lg.add_argument("--daemon", action="store_true", help="the supervisor's log (daemon.log)")

    rm = cmd("rm", "stop a session and delete its data",
             "Stop SESSION's worker if it runs, forget the session and delete its data"
             " (transcript, logs, outputs, journal). Refused while a turn runs, unless --force"
             " (which kills the turn first). The id may then be used again: for a brand-new"
             " session.",
             "trio-agentd rm build\ntrio-agentd rm --force build")
    rm.add_argument("session", metavar="SESSION")
    rm.add_argument("--force", action="store_true", help="kill a running turn first")

    for name in ("ps", "status"):
        ps = cmd(name, "every supervisor found, with its status" if name == "ps"
                 else "the same as ps",
                 "List every supervisor of yours found (sockets, records, processes), each"
                 " with its status: ok, starting, unreachable, wedged, stale. It never starts"
                 " one and never repairs anything (see doctor).",
                 f"trio-agentd {name}\ntrio-agentd {name} --json")
        ps.add_argument("--json", action="store_true", help="print them as a JSON array")

    dr = cmd("doctor", "find wedged supervisors; --fix repairs only those",
             "Look as ps does and say what is broken and how it would be repaired. --fix"
             " repairs only what stays unresponsive for a while (a busy supervisor is not"
             " wedged); exit 3 if a problem is left.",
             "trio-agentd doctor\ntrio-agentd doctor --fix --dry-run\ntrio-agentd doctor --fix")
    dr.add_argument("--fix", action="store_true", help="repair what is broken")
    dr.add_argument("--dry-run", action="store_true", help="print the repair plan only")
    dr.add_argument("--json", action="store_true", help="print the findings as JSON")

    rs = cmd("restart", "replace the supervisor, keep sessions (workers adopted)",
             "Replace the supervisor with a fresh one of this installation; it adopts every"
             " worker, so sessions and running turns go on. Also how an upgrade is applied"
             " at once.",
             "trio-agentd restart\ntrio-agentd restart --json")
    rs.add_argument("--json", action="store_true", help="print the old and new pid as JSON")

    sd = cmd("shutdown", "stop the supervisor and its workers",
             "Stop the supervisor on the socket and its workers (sessions stay on disk; the"
             " next command starts a supervisor again). --all stops every supervisor found.",
             "trio-agentd shutdown\ntrio-agentd shutdown --all --force")
    sd.add_argument("--all", action="store_true", help="every supervisor found")
    sd.add_argument("--force", action="store_true",
                    help="also kill wedged supervisors (identity-checked)")
    sd.add_argument("--json", action="store_true", help="print what was stopped as JSON")

    cf = cmd("config", "the effective settings and where each came from",
             "Print every setting's effective value and its source: default, the config file"
             " ($XDG_CONFIG_HOME/trio-agentd/config.toml, default ~/.config/...) or an"
             " environment variable (which wins over the file). An invalid file is one line"
             " naming the file, the key and what is wrong (exit 1); a supervisor refuses to"
             " start on it. The supervisor reads the file when it starts: `trio-agentd"
             " restart` applies a change.",
             "trio-agentd config\ntrio-agentd config --json\n"
             "printf '[timing]\\nidle_eviction = 0\\n' >> ~/.config/trio-agentd/config.toml",
             "docs/operations.md (Configuration) lists every key.")
    cf.add_argument("--json", action="store_true", help="print them as a JSON object")

    cp = cmd("completion", "print a shell completion script (bash, zsh, fish)",
             "Print a completion script for SHELL, generated from this command line's"
             " parser. Install it where your shell looks:",
             "trio-agentd completion bash"
             " > ~/.local/share/bash-completion/completions/trio-agentd\n"
             "trio-agentd completion zsh > ~/.zfunc/_trio-agentd  # with fpath+=~/.zfunc\n"
             "trio-agentd completion fish > ~/.config/fish/completions/trio-agentd.fish")
    cp.add_argument("shell", choices=("bash", "zsh", "fish"), metavar="SHELL",
                    help="bash, zsh or fish")

    d = cmd("daemon", "run the supervisor in the foreground",
            "Run the supervisor in the foreground (clients start one by themselves when none"
            " runs: this is for a service manager, or to watch its log on stderr). It reads"
            " the config file once, at start; an invalid one stops it with one line. Ctrl-C"
            " (SIGINT) stops it and its workers; SIGTERM leaves the workers running, for the"
            " next supervisor to adopt (docs/operations.md, Signals).",
            "trio-agentd daemon\ntrio-agentd --home /srv/agents -v daemon")
    d.add_argument("--autostarted", action="store_true", help=argparse.SUPPRESS)

    from ._service import SERVICE_DESCRIPTION, SERVICE_EXAMPLES, add_service_parser

    add_service_parser(sub, description=_fill(SERVICE_DESCRIPTION), formatter_class=raw,
                       epilog=_epilog(SERVICE_EXAMPLES))
    return p


_EXAMPLES = """\
trio-agentd -p hello                            # prompt the default session (echo agent)
trio-agentd -p -s build --agent shell 'make test'   # a shell session named build"""


def overview(parser: argparse.ArgumentParser) -> str:
    """What a bare ``trio-agentd`` prints: one line per command, then the common examples."""
    import argparse

    lines = ["trio-agentd: long-lived agent sessions that survive anything.", "",
             "usage: trio-agentd [--socket PATH] [--home DIR] [-v] COMMAND ...", "",
             "commands:"]
    rows: list[tuple[str, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            rows += [(a.dest, a.help or "") for a in action._choices_actions]
    rows = [("-p TEXT", "send a prompt to a session (also: prompt)"),
            *[r for r in rows if r[0] != "prompt"]]
    width = max(len(name) for name, _ in rows)
    lines += [f"  {name.ljust(width)}  {text}" for name, text in rows]
    lines += ["", "examples:", *(f"  {line}" for line in _EXAMPLES.split("\n")), "",
              "more: trio-agentd COMMAND --help, trio-agentd --help, trio-agentd --version"]
    return "\n".join(lines)


def version_line() -> str:
    """``trio-agentd X.Y.Z (protocol N)``: the installed package's version (its metadata),
    else the version built into the code."""
    from importlib.metadata import PackageNotFoundError, version

    from ._version import APP_VERSION, PROTOCOL_VERSION

    try:
        found = version("trio-agentd")
    except PackageNotFoundError:  # run from a source tree that was never installed
        found = APP_VERSION
    return f"trio-agentd {found} (protocol {PROTOCOL_VERSION})"


def cmd_completion(shell: str) -> int:
    try:
        import shtab
    except ImportError:
        error("shell completion needs the shtab package — install it (pip install shtab)"
               " next to trio-agentd")
        return EXIT_FAIL
    parser = build_parser()
    parser.prog = "trio-agentd"
    print(shtab.complete(parser, shell=shell))
    return EXIT_OK
