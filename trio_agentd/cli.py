"""The ``trio-agentd`` command line. It and the ``_cli_*`` modules beside it are the only place
that calls ``trio.run`` (the ``daemon`` command) and picks exit codes.

This module reads the command line and runs one command; the pieces live beside it, one job
each: :mod:`._cli_args` (the warm paths' parsing, without argparse), :mod:`._cli_parser` (the
argparse parser and its help), :mod:`._cli_io` (answers out, errors, ``-v``), and the commands
by what they touch: :mod:`._cli_prompt`, :mod:`._cli_sessions`, :mod:`._cli_daemon` (the
supervisor itself) and :mod:`._cli_look` (``ps``, ``doctor``). The exit codes are in
:mod:`._cli_exit`. The warm paths (``trio-agentd -p TEXT`` with a daemon running, ``ps``,
``doctor``) build no argparse parser, and the prompt uses the blocking client and never
imports trio.
"""

from __future__ import annotations

import sys

from ._cli_args import (
    PromptArgs,
    UsageError,
    command_index,
    look_args,
    parse_globals,
    parse_prompt_args,
    rewrite,
)
from ._cli_exit import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OWN,
    EXIT_USAGE,
    exit_now,
    quiet_pipe_exit,
    stdout_broken,
)
from ._cli_io import StdoutClosed, error, report_os_error, start_trace, stdin_is_tty
from ._errors import AgentdError
from ._paths import Layout

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any


def main(argv: Sequence[str] | None = None) -> None:
    """The ``trio-agentd`` command: :func:`run`, then the process ends with its status."""
    exit_now(run(list(sys.argv[1:] if argv is None else argv)))


def run(argv: list[str]) -> int:
    """Run the command ``argv`` (without the program name); its exit status."""
    if argv[-2:] == ["daemon", "--autostarted"]:
        # a supervisor a client autostarted, the first prompt waiting on it. It never holds
        # the client's cwd (or its mount) busy: the client's posix_spawn could not set it
        import os

        os.chdir("/")
        # its worker fork template (on that prompt's path) starts now, beside argparse and
        # the imports its parser costs, not after them
        from . import _earlytemplate

        _earlytemplate.start()
        if (daemon := autostarted_args(argv)) is not None:
            return _run_command(daemon, None)  # no argparse (~10 ms) before it serves
    argv = rewrite(argv)
    at = command_index(argv)
    if (look := look_args(argv, at)) is not None:
        return _run_command(look, None)  # ps/doctor: building argparse costs more than they do
    prompt: PromptArgs | None = None
    if argv[at : at + 1] == ["prompt"]:
        try:
            prompt = parse_prompt_args(argv[at + 1 :], stdin_is_tty=stdin_is_tty())
        except UsageError as exc:
            error(f"{exc} (see trio-agentd -p --help)")
            return EXIT_USAGE
        late = (prompt.socket, prompt.home)
        if not prompt.help and parse_globals(argv[:at], prompt):
            return _run_command(prompt, prompt)  # the warm path: no argparse at all
        prompt.socket, prompt.home = late
        argv = [*argv[: at + 1], *(["--help"] if prompt.help else [])]
    if "--version" in argv[:at] and parse_globals(
            [w for w in argv[:at] if w != "--version"], PromptArgs()):
        from ._cli_parser import version_line

        print(version_line())  # before argparse: nothing else is needed
        return EXIT_OK
    from ._cli_parser import build_parser, overview, version_line

    parser = build_parser()
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
        print(overview(parser))
        return EXIT_OK
    if prompt is not None:  # global options given after -p
        args.socket = prompt.socket or args.socket
        args.home = prompt.home or args.home
        args.verbose = prompt.verbose or args.verbose
    return _run_command(args, prompt)


def autostarted_args(argv: list[str]) -> Any:
    """The arguments of ``--socket S --home H --registry R daemon --autostarted``, the one
    form the CLI's autostart writes, read without argparse (a cold prompt waits on this
    daemon); ``None`` for any other form, which argparse reads."""
    if len(argv) != 8 or argv[0:8:2] != ["--socket", "--home", "--registry", "daemon"]:
        return None
    if argv[7] != "--autostarted" or any(v.startswith("-") for v in argv[1:7:2]):
        return None
    from types import SimpleNamespace

    return SimpleNamespace(command="daemon", socket=argv[1], home=argv[3], registry=argv[5],
                           verbose=False, autostarted=True, version=False)


def _run_command(args: Any, prompt: PromptArgs | None) -> int:
    try:
        code = _dispatch(args, prompt)
        if sys.stdout is not None:  # (None: descriptor 1 was closed when we started)
            sys.stdout.flush()  # here, not at exit: a closed stdout must end us quietly
        return code
    except StdoutClosed:
        return quiet_pipe_exit()
    except BrokenPipeError as exc:
        if stdout_broken():
            return quiet_pipe_exit()
        report_os_error(exc)
        return EXIT_FAIL


def _dispatch(args: Any, prompt: PromptArgs | None) -> int:
    if args.verbose and args.command != "daemon":
        start_trace()
    try:
        match args.command:  # those that need no layout
            case "completion":
                from ._cli_parser import cmd_completion

                return cmd_completion(args.shell)
            case "config":
                from ._cli_daemon import cmd_config

                return cmd_config(args)
        layout = Layout.resolve(socket=args.socket, home=args.home, registry=args.registry)
        match args.command:
            case "service":
                from ._service import run_service

                return run_service(args, layout)
            case "daemon":
                from ._cli_daemon import cmd_daemon, daemon_settings

                if (options := daemon_settings()) is None:
                    return EXIT_USAGE
                args.supervisor_options = options
                return cmd_daemon(layout, args)
            case "prompt":
                from ._cli_prompt import cmd_prompt

                assert prompt is not None
                return cmd_prompt(layout, prompt)
            case "sessions" | "kill" | "cancel" | "logs" | "rm" | "retry":
                from ._cli_sessions import SESSION_COMMANDS

                return SESSION_COMMANDS[args.command](layout, args)
            case "shutdown":
                from ._cli_daemon import cmd_shutdown

                return cmd_shutdown(layout, args)
            case "restart":
                from ._cli_daemon import cmd_restart

                return cmd_restart(layout, args)
            case "ps" | "status":
                from ._cli_look import cmd_ps

                return cmd_ps(layout, args)
            case "doctor":
                from ._cli_look import cmd_doctor

                return cmd_doctor(layout, args)
    except UsageError as exc:
        error(str(exc))
        return EXIT_USAGE
    except AgentdError as exc:
        error(exc.message)
        if args.command == "prompt":
            from ._cli_prompt import prompt_error_code

            return prompt_error_code(exc)  # never confused with the agent's own statuses
        return EXIT_FAIL
    except BrokenPipeError:
        raise  # run() tells a closed stdout from any other broken pipe
    except OSError as exc:
        report_os_error(exc)
        return EXIT_OWN if args.command == "prompt" else EXIT_FAIL
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED  # a second Ctrl-C: at once, without waiting for the worker
    return EXIT_USAGE
