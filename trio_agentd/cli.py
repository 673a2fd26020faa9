"""The ``trio-agentd`` command line: the only place that calls ``trio.run`` and picks exit codes.

Exit codes: 0 success, 1 failure, 2 usage error, 3 ``doctor`` found a problem it did not fix,
141 (128 + SIGPIPE, as ``yes | head``) stdout was closed before everything was written. A prompt
exits with its agent's status instead (see :func:`prompt_exit_code`).
The warm path (``trio-agentd -p TEXT`` with a daemon running) uses the blocking client and never
imports trio.
"""

from __future__ import annotations

import os
import sys

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._errors import AgentdError, ErrorCode, NoSupervisor
from ._paths import Layout
from ._sessionid import SESSION_ID_RULE, is_session_id

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    import argparse  # imported where a parser is built: the warm path (-p) needs none
    from collections.abc import Sequence
    from typing import Any


EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_DOCTOR = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C, as a shell reports it
EXIT_PIPE = 128 + 13  # stdout closed early: the status a shell reports for death by SIGPIPE
EXIT_OWN = 125  # a prompt failed in trio-agentd itself (as docker run, env and timeout say it)

_EXIT_EPILOG = (
    "exit status: 0 success, 1 failure, 2 usage error, 3 doctor found a problem it did not fix,"
    " 141 stdout was closed early (e.g. `trio-agentd -p ... | head -1`): like `yes | head`"
    " (128 + SIGPIPE), the command ends quietly, without a message. A prompt (-p) exits with"
    " its agent's exit status instead: N as the agent exited, 128+N if it was killed by signal"
    " N, 130 after Ctrl-C cancelled it, 126/127 if an exec: program cannot be run / is not"
    " found, 125 if trio-agentd itself failed (the daemon, the session, the connection), 2 for"
    " a usage error (nothing was sent); --json tells them apart for sure"
)

_GLOBAL_WITH_VALUE = {"--socket", "--daemon-socket", "--home", "--registry"}


def _rewrite(argv: list[str]) -> list[str]:
    """Map the seed CLI's spellings onto subcommands: ``-p`` → prompt, ``--mode daemon``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in _GLOBAL_WITH_VALUE and i + 1 < len(argv):
            out += [tok, argv[i + 1]]
            i += 2
            continue
        if tok == "-p":
            return [*out, "prompt", *argv[i + 1 :]]
        if tok == "--mode" and i + 1 < len(argv):
            if argv[i + 1] != "daemon":
                raise SystemExit(f"trio-agentd: error: unknown --mode {argv[i + 1]!r}")
            return [*out, "daemon", *argv[i + 2 :]]
        if tok.startswith("--mode="):
            return [*out, "daemon", *argv[i + 1 :]]
        if not tok.startswith("-"):
            return argv
        out.append(tok)
        i += 1
    return out


class UsageError(Exception):
    """A bad command line: the CLI prints the message and exits 2, before contacting a daemon."""


class PromptArgs:
    """What follows ``-p`` / ``prompt``. ``text`` is None when the prompt is to be read from stdin.

    Global options (``--socket``, ``--home``, ``-v``) are accepted here too; ``None`` / False when
    not given after ``-p``.
    """

    __slots__ = (
        "agent", "cwd", "help", "home", "json", "registry", "session", "socket", "text",
        "verbose",
    )
    command = "prompt"

    def __init__(self) -> None:
        self.session = "default"
        self.agent: str | None = None
        self.cwd: str | None = None
        self.json = False
        self.text: str | None = None
        self.socket: str | None = None
        self.home: str | None = None
        self.registry: str | None = None
        self.verbose = False
        self.help = False


_PROMPT_VALUE_OPTS = {
    "-s": "session", "--session": "session", "--agent": "agent", "--cwd": "cwd",
    "--socket": "socket", "--daemon-socket": "socket", "--home": "home",
}
_PROMPT_FLAG_OPTS = {"--json": "json", "-v": "verbose", "--verbose": "verbose"}


def parse_prompt_args(words: list[str], *, stdin_is_tty: bool) -> PromptArgs:
    """Parse the words after ``-p``: options anywhere, ``--`` ends them, TEXT words join with " ".

    The prompt comes from stdin (``text`` None) when TEXT is exactly ``-``, or when there is no
    TEXT and stdin is not a terminal. Pure: ``stdin_is_tty`` is the caller's ``isatty()``.

    Raises:
        UsageError: unknown option, option without its value, invalid session id, no TEXT on
            a terminal.
    """
    got = PromptArgs()
    text: list[str] = []
    i = 0
    while i < len(words):
        tok = words[i]
        i += 1
        if tok == "--":
            text += words[i:]
            break
        if tok == "-" or not tok.startswith("-") or tok[1:2].isdigit():  # "-", a word, "-5"
            text.append(tok)
            continue
        if tok in ("-h", "--help"):
            got.help = True
            return got
        if tok in _PROMPT_FLAG_OPTS:
            setattr(got, _PROMPT_FLAG_OPTS[tok], True)
            continue
        name, eq, value = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        if not eq and name not in _PROMPT_VALUE_OPTS and tok[:2] == "-s":
            name, eq, value = "-s", "=", tok[2:]  # -sNAME, as argparse allows
        if name not in _PROMPT_VALUE_OPTS:
            raise UsageError(
                f"unknown option {tok!r} — to send it as text, put it after --"
                f" (trio-agentd -p -- {tok})"
            )
        if not eq:
            if i >= len(words):
                raise UsageError(f"{name} needs a value")
            value = words[i]
            i += 1
        setattr(got, _PROMPT_VALUE_OPTS[name], value)
    if not is_session_id(got.session):
        raise UsageError(f"invalid session id {got.session!r}: use {SESSION_ID_RULE}")
    if text == ["-"] or (not text and not stdin_is_tty):
        got.text = None
    elif not text:
        raise UsageError("prompt needs TEXT — e.g. trio-agentd -p hello, or a prompt on stdin")
    else:
        got.text = " ".join(text)
    return got


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


def _parser() -> argparse.ArgumentParser:
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


def _overview(parser: argparse.ArgumentParser) -> str:
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


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(list(sys.argv[1:] if argv is None else argv)))


def _command_index(argv: list[str]) -> int:
    """Index of the subcommand in (rewritten) ``argv``: the first word that is no global option."""
    i = 0
    while i < len(argv):
        if argv[i] in _GLOBAL_WITH_VALUE:
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return i
    return len(argv)


# ps/status/doctor and the only flags they take: parsed without argparse (anything else, such
# as -h, an abbreviation or a repeated global option, goes to argparse as before)
_LOOK_FLAGS = {
    "ps": ("--json",), "status": ("--json",), "doctor": ("--fix", "--dry-run", "--json"),
}


_DEST = {"--daemon-socket": "--socket", "--verbose": "-v"}


def _look_args(argv: list[str], at: int) -> Any:
    """The namespace argparse would make of ``[globals] ps|status|doctor [flags]``, or
    ``None`` for any other command line."""
    flags = _LOOK_FLAGS.get(argv[at]) if at < len(argv) else None
    if flags is None or not set(argv[at + 1 :]) <= set(flags):
        return None
    into = PromptArgs()
    named = [_DEST.get(w.partition("=")[0], w.partition("=")[0])
             for w in argv[:at] if w.startswith("--")]
    if len(named) != len(set(named)) or not _parse_globals(argv[:at], into):
        return None  # a repeated option (argparse: the last wins) or anything unknown
    import types

    return types.SimpleNamespace(
        command=argv[at], socket=into.socket, home=into.home, registry=into.registry,
        verbose=into.verbose, version=False,
        **{f[2:].replace("-", "_"): f in argv[at + 1 :] for f in flags},
    )


def _parse_globals(words: list[str], into: PromptArgs) -> bool:
    """Read the global options before ``-p`` into ``into`` (those after ``-p`` win).

    False if there is anything else (``-h``, a typo, a missing value): argparse then answers.
    """
    i = 0
    while i < len(words):
        tok = words[i]
        i += 1
        if tok in ("-v", "--verbose"):
            into.verbose = True
            continue
        name, eq, value = tok.partition("=")
        if name not in _GLOBAL_WITH_VALUE:
            return False
        if not eq:
            if i >= len(words):
                return False
            value = words[i]
            i += 1
        field = {"--home": "home", "--registry": "registry"}.get(name, "socket")
        if getattr(into, field) is None:
            setattr(into, field, value)
    return True


def run(argv: list[str]) -> int:
    argv = _rewrite(argv)
    at = _command_index(argv)
    if (look := _look_args(argv, at)) is not None:
        return _run_command(look, None)  # ps/doctor: building argparse costs more than they do
    prompt: PromptArgs | None = None
    if argv[at : at + 1] == ["prompt"]:
        try:
            prompt = parse_prompt_args(argv[at + 1 :], stdin_is_tty=_stdin_is_tty())
        except UsageError as exc:
            _error(f"{exc} (see trio-agentd -p --help)")
            return EXIT_USAGE
        late = (prompt.socket, prompt.home)
        if not prompt.help and _parse_globals(argv[:at], prompt):
            return _run_command(prompt, prompt)  # the warm path: no argparse at all
        prompt.socket, prompt.home = late
        argv = [*argv[: at + 1], *(["--help"] if prompt.help else [])]
    if "--version" in argv[:at] and _parse_globals(
            [w for w in argv[:at] if w != "--version"], PromptArgs()):
        print(version_line())  # before argparse: nothing else is needed
        return EXIT_OK
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    if args.version:
        print(version_line())
        return EXIT_OK
    if args.command is None:
        # a bare command asks what there is: the overview is the answer (stdout, exit 0);
        # nothing was attempted, so nothing failed
        print(_overview(parser))
        return EXIT_OK
    if prompt is not None:  # global options given after -p
        args.socket = prompt.socket or args.socket
        args.home = prompt.home or args.home
        args.verbose = prompt.verbose or args.verbose
    return _run_command(args, prompt)


def _run_command(args: Any, prompt: PromptArgs | None) -> int:
    try:
        code = _dispatch(args, prompt)
        sys.stdout.flush()  # here, not at exit: a closed stdout must end us quietly
        return code
    except _StdoutClosed:
        return _quiet_pipe_exit()
    except BrokenPipeError as exc:
        if _stdout_broken():
            return _quiet_pipe_exit()
        _report_os_error(exc)
        return EXIT_FAIL


def _dispatch(args: Any, prompt: PromptArgs | None) -> int:
    global _trace
    if args.verbose and args.command != "daemon":
        _trace = _Trace()
    try:
        match args.command:  # those that need no layout
            case "completion":
                return _cmd_completion(args.shell)
            case "config":
                return _cmd_config(args)
        layout = Layout.resolve(socket=args.socket, home=args.home, registry=args.registry)
        match args.command:
            case "service":
                from ._service import run_service

                return run_service(args, layout)
            case "daemon":
                if (options := _daemon_settings()) is None:
                    return EXIT_USAGE
                args.supervisor_options = options
                return _cmd_daemon(layout, args)
            case "prompt":
                assert prompt is not None
                return _cmd_prompt(layout, prompt)
            case "sessions":
                return _cmd_sessions(layout, args)
            case "kill":
                _client(layout).request("kill_session", {"session": args.session})
                print(f"killed session {args.session}")
                return EXIT_OK
            case "cancel":
                done = _client(layout).request("cancel", {"session": args.session})
                print(f"cancelled the running turn of session {args.session}"
                      if isinstance(done, dict) and done.get("cancelled")
                      else f"session {args.session} runs no turn")
                return EXIT_OK
            case "logs":
                return _cmd_logs(layout, args)
            case "rm":
                _client(layout).request(
                    "remove_session", {"session": _session_arg(args.session),
                                       "force": args.force}, retry_for=0)
                print(f"removed session {args.session}")
                return EXIT_OK
            case "retry":
                done = _client(layout).request("retry_session", {"session": args.session})
                if isinstance(done, dict) and done.get("retried") is False:
                    print(f"session {args.session} is {done.get('state')}: nothing to retry"
                          " (it has not failed)")
                else:
                    print(f"re-armed session {args.session}")
                return EXIT_OK
            case "shutdown":
                return _cmd_shutdown(layout, args)
            case "restart":
                return _cmd_restart(layout, args)
            case "ps" | "status":
                return _cmd_ps(layout, args)
            case "doctor":
                return _cmd_doctor(layout, args)
    except UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except AgentdError as exc:
        _error(exc.message)
        if args.command == "prompt":
            return prompt_error_code(exc)  # never confused with the agent's own statuses
        return EXIT_FAIL
    except BrokenPipeError:
        raise  # run() tells a closed stdout from any other broken pipe
    except OSError as exc:
        _report_os_error(exc)
        return EXIT_OWN if args.command == "prompt" else EXIT_FAIL
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED  # a second Ctrl-C: at once, without waiting for the worker
    return EXIT_USAGE


def _error(message: str) -> None:
    """One error on stderr. Messages quote what others sent (agent specs, paths, a daemon's
    log), so control characters are shown escaped; line breaks stay (a log tail)."""
    from ._text import printable

    text = "\n".join(printable(line) for line in message.split("\n"))
    print(f"trio-agentd: error: {text}", file=sys.stderr)


def _report_os_error(exc: OSError) -> None:
    where = f" ({exc.filename})" if exc.filename else ""
    _error(f"{exc.strerror or exc}{where} — check the path and its permissions")


class _StdoutClosed(Exception):
    """Writing an answer hit EPIPE. Not an OSError: the client must not take it for a lost
    connection (and resend), nor the CLI for a path problem."""


def _quiet_pipe_exit() -> int:
    """Stdout's reader is gone: exit 141 without a word, as ``yes | head`` does."""
    try:  # what is still buffered would fail again in the interpreter's flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return EXIT_PIPE


def _stdout_broken() -> bool:
    """Whether stdout is a pipe nobody reads any more (poll reports POLLERR for it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _stdin_is_tty() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (OSError, ValueError):
        return False


class _Answer:
    """Writes answers to stdout as UTF-8 bytes, whatever the terminal's encoding; a lone
    surrogate from undecodable input goes back out as the byte it came from."""

    def __init__(self) -> None:
        self.buffer = getattr(sys.stdout, "buffer", None)

    def write_bytes(self, data: bytes) -> None:
        if not data:
            return
        try:
            if self.buffer is None:
                sys.stdout.write(data.decode("utf-8", "replace"))
                sys.stdout.flush()
                return
            self.buffer.write(data)
            self.buffer.flush()
        except BrokenPipeError:
            raise _StdoutClosed from None

    def write(self, text: str) -> None:
        if not text:
            return
        try:
            if self.buffer is None:  # stdout replaced by a text-only stream
                sys.stdout.write(text)
                sys.stdout.flush()
                return
            try:
                data = text.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:  # a surrogate that was never a byte
                data = text.encode("utf-8", "backslashreplace")
            self.buffer.write(data)
            self.buffer.flush()
        except BrokenPipeError:
            raise _StdoutClosed from None


class _Diagnostics:
    """Writes the agent's stderr to ours as it comes, byte for byte."""

    def __init__(self) -> None:
        self.buffer = getattr(sys.stderr, "buffer", None)
        self.closed = False

    def write_bytes(self, data: bytes) -> None:
        if not data or self.closed:
            return
        try:
            if self.buffer is None:  # stderr replaced by a text-only stream
                sys.stderr.write(data.decode("utf-8", "replace"))
                sys.stderr.flush()
                return
            self.buffer.write(data)
            self.buffer.flush()
        except BrokenPipeError:
            # nobody reads our stderr: its diagnostics have nowhere to go; the answer (stdout)
            # and the exit status still do, and the transcript keeps them
            self.closed = True


def _read_prompt_from_stdin() -> str | None:
    """The prompt on stdin, one trailing newline dropped; None if stdin is empty or closed."""
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        return None
    data: bytes = stream.read()
    if not data:
        return None
    text = data.decode("utf-8", "surrogateescape")
    return text[:-1] if text.endswith("\n") else text


class _Trace:
    """``-v``: each connection step on stderr, one line each, with the time since the
    command started (ms)."""

    def __init__(self) -> None:
        import time

        self.clock = time.monotonic
        self.start = self.clock()

    def __call__(self, line: str) -> None:
        from ._text import printable

        ms = (self.clock() - self.start) * 1000
        print(f"trio-agentd: [{ms:7.1f} ms] {printable(line)}", file=sys.stderr, flush=True)


_trace: _Trace | None = None  # set by -v on a client command


def _client(layout: Layout, *, autostart: bool = True, connect: bool = True) -> Any:
    from ._syncclient import SyncClient

    client = SyncClient(layout, autostart=autostart)
    client.progress = lambda line: print(f"trio-agentd: {line}", file=sys.stderr, flush=True)
    client.trace = _trace
    if connect:
        client.connect()
    return client


def prompt_exit_code(result: Any) -> int:
    """The CLI's exit status for a prompt that was answered: the agent's own, as a shell
    reports a command's (128 + N for death by signal N); 0 for an agent that reports none."""
    status = result.get("exit_status") if isinstance(result, dict) else None
    if not isinstance(status, int) or isinstance(status, bool):
        return EXIT_OK
    if status < 0:
        return min(128 - status, 255)
    return status & 0xFF


def prompt_error_code(exc: AgentdError) -> int:
    """The CLI's exit status for a prompt that failed: 130 once its cancel was confirmed
    (Ctrl-C), the status the error names (126/127: an exec program cannot be run / is not
    found), else 125 — trio-agentd's own, never confused with an agent's usual 1."""
    if exc.code == ErrorCode.COMMAND_CANCELLED:
        return EXIT_INTERRUPTED
    status = exc.details.get("exit_status")
    if isinstance(status, int) and not isinstance(status, bool) and 0 < status < 256:
        return status
    return EXIT_OWN


def _json_text(data: bytes, field: str) -> dict[str, str]:
    """A stream for --json: text if it is UTF-8, else base64 under ``FIELD_base64``."""
    try:
        return {field: data.decode()}
    except UnicodeDecodeError:
        import base64

        return {f"{field}_base64": base64.b64encode(data).decode("ascii")}


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _cmd_prompt(layout: Layout, args: PromptArgs) -> int:
    text = args.text
    if text is None:
        text = _read_prompt_from_stdin()
        if text is None:
            _error("prompt needs TEXT: none given and stdin was empty — e.g. trio-agentd -p hello")
            return EXIT_USAGE
    cwd = _session_cwd(args.cwd)
    if isinstance(cwd, int):
        return cwd
    from ._syncclient import Output

    out = _Answer()
    err = _Diagnostics()
    kept: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    # the agent's bytes, exactly, as they come, each stream to its own; nothing added (a
    # resend's repeat is skipped). --json gathers them for the one object it prints
    output = (
        Output(kept["stdout"].append, kept["stderr"].append) if args.json
        else Output(out.write_bytes, err.write_bytes)
    )
    client = _client(layout, connect=False)
    client.connect_for_prompt(args.session, args.agent, cwd_given=bool(cwd))
    result = client.request(
        "prompt",
        {"session": args.session, "text": text, "agent": args.agent, **cwd},
        on_event=output.on_event,
    )
    client.close()
    output.finish(result)
    code = prompt_exit_code(result)
    if args.json:
        status = result.get("exit_status") if isinstance(result, dict) else None
        out.write(json.dumps({
            **result, "exit_status": status if isinstance(status, int) else None,
            **_json_text(b"".join(kept["stdout"]), "stdout"),
            **_json_text(b"".join(kept["stderr"]), "stderr"),
        }) + "\n")
        return code
    status = result.get("exit_status") if isinstance(result, dict) else None
    if isinstance(status, int) and status < 0 and -status not in (2, 13):
        # as a shell says it for a foreground job (not for SIGINT or SIGPIPE)
        _error(f"the agent was killed by {_signal_name(-status)}")
    return code


def _session_cwd(given: str | None) -> dict[str, Any] | int:
    """The prompt's ``cwd`` arguments: ``--cwd DIR`` made absolute and checked (a usage error,
    before anything is sent, if it is missing or not a directory), else none (the client's own
    cwd is sent)."""
    if given is None:
        return {}
    path = os.path.abspath(given)
    if not os.path.isdir(path):
        why = "is not a directory" if os.path.exists(path) else "does not exist"
        _error(f"--cwd {given!r} {why} — create it, or give an existing directory")
        return EXIT_USAGE
    return {"cwd": path, "cwd_given": True}


def _session_arg(session: str) -> str:
    if not is_session_id(session):
        raise UsageError(f"invalid session id {session!r}: use {SESSION_ID_RULE}")
    return session


def _cmd_logs(layout: Layout, args: argparse.Namespace) -> int:
    from . import _logs

    if args.lines is not None and args.lines < 0:
        raise UsageError("-n needs a whole number >= 0")
    out = _Answer().write_bytes
    if args.daemon:
        if args.session is not None:
            raise UsageError("logs --daemon takes no SESSION")
        if args.json:
            raise UsageError("logs --daemon has no --json (the log is lines of text)")
        _logs.follow_daemon_log(layout.log_path, out, last=args.lines, follow=args.follow)
        return EXIT_OK
    if args.session is None:
        raise UsageError("logs needs SESSION (or --daemon for the supervisor's log)")
    session_dir = _logs.session_dir_of(layout, _session_arg(args.session))
    printer = _logs.Printer(out, as_json=args.json)
    if not args.follow:
        _logs.print_history(printer, session_dir, args.lines)
        return EXIT_OK
    follower = _logs.Follower(printer, session_dir)  # from here on: nothing is missed
    try:
        _logs.print_history(printer, session_dir, args.lines, follower.tail)
        client = _client(layout)
        _logs.follow_session(layout, args.session, follower, client=client,
                             notice=lambda line: print(f"trio-agentd: {line}",
                                                       file=sys.stderr, flush=True))
    finally:
        follower.close()
    return EXIT_OK


def _cmd_sessions(layout: Layout, args: argparse.Namespace) -> int:
    client = _client(layout)
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


def _cmd_shutdown(layout: Layout, args: argparse.Namespace) -> int:
    if args.all or args.force:
        from ._shutdown import shutdown_many

        return shutdown_many(layout, every=args.all, force=args.force, as_json=args.json)
    from ._defaults import SHUTDOWN_EXIT_WAIT
    from ._identity import wait_gone

    client = _client_or_none(layout)
    if client is None:
        if args.json:
            print(json.dumps([]))
        else:
            print(f"no supervisor running on {layout.socket}")
        return EXIT_OK
    hello = client.hello
    result = client.request("shutdown", {"stop_workers": True}, retry_for=0)
    client.close()
    pid, start_id = int(hello["pid"]), hello.get("start_id")
    stopped = wait_gone(pid, start_id, SHUTDOWN_EXIT_WAIT)
    entry = {"socket": layout.socket, "pid": pid, "generation": result.get("generation"),
             "stopped": stopped}
    if args.json:
        print(json.dumps([entry]))
    elif stopped:
        print(f"stopped supervisor pid {pid} on {layout.socket} and its workers")
    else:
        _error(f"supervisor pid {pid} did not exit within {SHUTDOWN_EXIT_WAIT:g}s — try"
               " `trio-agentd doctor --fix`")
    return EXIT_OK if stopped else EXIT_FAIL


def _cmd_restart(layout: Layout, args: argparse.Namespace) -> int:
    import time

    from ._autostart import is_ours
    from ._defaults import CLIENT, RESTART_WAIT
    from ._paths import check_socket_path
    from ._syncclient import SyncClient, probe

    check_socket_path(layout.socket)
    got = probe(layout, patience=CLIENT.patience, trace=_trace)
    if got is None:
        _error(f"no supervisor running on {layout.socket} — the next command starts one")
        return EXIT_FAIL
    got[0].close()
    layout.check_served_home(got[1].get("home"))
    if not is_ours(got[1]):
        # another version: its own restart would start its own code again; hand the socket
        # over to a supervisor of this installation instead, at once (turns go on)
        return _hand_over_now(layout, got[1], as_json=args.json)
    client = _client_or_none(layout)
    if client is None:
        _error(f"no supervisor running on {layout.socket} — the next command starts one")
        return EXIT_FAIL
    old = client.request("restart", {}, retry_for=0)
    client.close()
    deadline = time.monotonic() + RESTART_WAIT
    hello: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        got = probe(layout)
        if got is not None:
            got[0].close()
            if got[1].get("generation") != old["generation"]:
                hello = got[1]
                break
        time.sleep(CLIENT.probe_interval)
    if hello is None:
        _error(f"the new supervisor did not answer on {layout.socket} within"
               f" {RESTART_WAIT:g}s — see {layout.log_path}")
        return EXIT_FAIL
    fresh = SyncClient(layout, autostart=False)
    fresh.connect()
    rows = fresh.request("sessions")
    fresh.close()
    entry = {"socket": layout.socket, "old_pid": old["pid"], "old_generation": old["generation"],
             "pid": hello["pid"], "generation": hello["generation"], "sessions": len(rows)}
    if args.json:
        print(json.dumps(entry))
    else:
        print(f"restarted supervisor on {layout.socket}: pid {old['pid']} → {hello['pid']},"
              f" {len(rows)} sessions kept")
    return EXIT_OK


def _hand_over_now(layout: Layout, old: dict[str, Any], *, as_json: bool) -> int:
    """``restart`` of a supervisor of another version: replaced by one of this installation."""
    from ._autostart import hand_over
    from ._syncclient import SyncClient

    conn, hello = hand_over(layout, force=True)
    conn.close()
    fresh = SyncClient(layout, autostart=False)
    fresh.connect()
    rows = fresh.request("sessions")
    fresh.close()
    entry = {"socket": layout.socket, "old_pid": old.get("pid"),
             "old_generation": old.get("generation"), "old_version": old.get("app_version"),
             "pid": hello["pid"], "generation": hello["generation"],
             "version": hello.get("app_version"), "sessions": len(rows)}
    if as_json:
        print(json.dumps(entry))
    else:
        print(f"replaced supervisor on {layout.socket}: pid {old.get('pid')} (version"
              f" {old.get('app_version')}) → {hello['pid']} (version {hello.get('app_version')}),"
              f" {len(rows)} sessions kept")
    return EXIT_OK


def _cmd_ps(layout: Layout, args: argparse.Namespace) -> int:
    from ._doctor import survey
    from ._report import print_table
    from ._trust import home_problem

    if (problem := home_problem(layout)) is not None:
        raise problem  # it could not look: not "no supervisor found" and exit 0

    found = survey(layout)
    if args.json:
        print(json.dumps([f.as_json() for f in found]))
    else:
        print_table(found)
    return EXIT_OK


def _cmd_doctor(layout: Layout, args: argparse.Namespace) -> int:
    from ._report import run_doctor
    from ._trust import home_problem

    if (problem := home_problem(layout)) is not None:
        raise problem  # it could not look: not "nothing found" and exit 0
    unfixed = run_doctor(layout, fix=args.fix and not args.dry_run, dry_run=args.dry_run,
                         as_json=args.json)
    return EXIT_DOCTOR if unfixed else EXIT_OK


def _cmd_config(args: argparse.Namespace) -> int:
    from . import _config

    try:
        path, found, settings = _config.load()
    except _config.ConfigError as exc:
        _error(exc.message)
        return EXIT_FAIL
    if args.json:
        print(json.dumps({
            "file": path, "file_exists": found,
            "settings": {k: {"value": s.value, "source": s.source} for k, s in settings.items()},
        }))
        return EXIT_OK
    print(f"config file: {path}" + ("" if found else " (none: defaults and environment only)"))
    rows = [(k, json.dumps(s.value), s.source) for k, s in settings.items()]
    wk = max(len(r[0]) for r in rows)
    wv = max(len(r[1]) for r in rows)
    for key, value, source in [("KEY", "VALUE", "FROM"), *rows]:
        print(f"{key.ljust(wk)}  {value.ljust(wv)}  {source}")
    return EXIT_OK


def _daemon_settings() -> dict[str, Any] | None:
    """The config file and environment, for a supervisor about to start: the file's values go
    into this process's environment (its workers read them from there), and the options
    :class:`SupervisorConfig` takes are returned. ``None`` (after one line on stderr) for an
    invalid file or variable: the supervisor does not start."""
    from . import _config

    try:
        _path, _found, settings = _config.load()
    except _config.ConfigError as exc:
        _error(f"{exc.message} — the supervisor does not start on an invalid config")
        return None
    os.environ.update(_config.daemon_environment(settings, os.environ))
    return _config.supervisor_options(settings)


def _cmd_completion(shell: str) -> int:
    try:
        import shtab
    except ImportError:
        _error("shell completion needs the shtab package — install it (pip install shtab)"
               " next to trio-agentd")
        return EXIT_FAIL
    parser = _parser()
    parser.prog = "trio-agentd"
    print(shtab.complete(parser, shell=shell))
    return EXIT_OK


def _client_or_none(layout: Layout) -> Any:
    from ._syncclient import SyncClient

    client = SyncClient(layout, autostart=False)
    client.trace = _trace
    try:
        client.connect()
    except NoSupervisor:
        return None
    return client


def _cmd_daemon(layout: Layout, args: argparse.Namespace) -> int:
    from ._forkserver import start_early

    start_early()  # the worker fork template starts beside the imports below, not after them
    import logging

    import trio

    from ._fs import ensure_dir
    from ._supervisor import Supervisor, SupervisorConfig

    # a daemon holds no client's cwd (or its mount) busy, and nothing it creates is readable
    # by others whatever umask it was started with
    os.chdir("/")
    os.umask(0o077)
    ensure_dir(layout.state_dir)
    _setup_logging(layout, verbose=args.verbose)
    log = logging.getLogger("trio_agentd.supervisor")
    from ._exhaustion import raise_nofile_limit
    from .timing import timing_from_env

    raise_nofile_limit(log)  # soft to hard: idle clients and workers each hold descriptors

    try:
        timing = timing_from_env()
    except ValueError as exc:
        _error(str(exc))
        return EXIT_USAGE
    config = SupervisorConfig(
        socket=layout.socket, home=str(layout.home), registry=str(layout.registry), timing=timing,
        prefork=True, **getattr(args, "supervisor_options", {}),
    )
    from ._sdactivate import take_listener
    from ._sdnotify import NOTIFY_ENV, Notifier

    # a service manager's variables are read once and removed: workers and successors must
    # not inherit them (docs/operations.md, "Running under systemd"). An autostarted daemon is
    # no service's main process: what its client inherited from a unit is not for it
    if args.autostarted:
        for name in NOTIFY_ENV:
            os.environ.pop(name, None)
        notifier = Notifier(None)
    else:
        notifier = Notifier.from_environ(os.environ)
    from ._errors import single_errors

    try:
        inherited = take_listener(os.environ, layout.socket)
        # an error from inside the supervisor's nurseries comes out bare: its one line here,
        # or the top level's, never a group's traceback
        with single_errors():
            trio.run(Supervisor(config, inherited=inherited, notifier=notifier).serve)
    except AgentdError as exc:
        if exc.code == ErrorCode.ALREADY_RUNNING and args.autostarted:
            log.info("autostart lost the race: %s", exc.message)
            return EXIT_OK
        log.error("%s", exc.message)
        if not _stderr_is_log(layout):
            _error(exc.message)
        return EXIT_FAIL
    return EXIT_OK


def _stderr_is_log(layout: Layout) -> bool:
    try:
        a, b = os.fstat(2), os.stat(layout.log_path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _setup_logging(layout: Layout, *, verbose: bool) -> None:
    import logging

    from ._rotate import RotatingLog, limits_from_env

    path = layout.log_path
    try:
        limits = limits_from_env()
    except ValueError as exc:
        from ._rotate import Limits

        limits = Limits()
        print(f"trio-agentd: {exc}; using {limits.max_bytes} bytes x {limits.backups}",
              file=sys.stderr)
    fmt = logging.Formatter("%(asctime)s supervisor[%(process)d] %(levelname)s %(message)s")
    root = logging.getLogger("trio_agentd")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # size-bounded (NAME.1 ... NAME.<backups>); an autostarted supervisor's stdout and stderr
    # are this file too, and follow it to each new one
    fh = RotatingLog(path, limits, stdio=(1, 2))
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if not _stderr_is_log(layout):
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        root.addHandler(sh)
