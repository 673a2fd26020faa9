"""The commands on the supervisor itself: run it in the foreground (``daemon``, with its
log and settings), show those settings (``config``), stop it (``shutdown``) and replace it
(``restart``)."""

from __future__ import annotations

import os
import sys

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._cli_exit import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from ._cli_io import client_or_none, current_trace, error
from ._errors import AgentdError, ErrorCode

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    import argparse
    from typing import Any, NoReturn

    from ._paths import Layout


def cmd_config(args: argparse.Namespace) -> int:
    from . import _config

    try:
        path, found, settings = _config.load()
    except _config.ConfigError as exc:
        error(exc.message)
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


def daemon_settings() -> dict[str, Any] | None:
    """The config file and environment, for a supervisor about to start: the file's values go
    into this process's environment (its workers read them from there), and the options
    :class:`SupervisorConfig` takes are returned. ``None`` (after one line on stderr) for an
    invalid file or variable: the supervisor does not start."""
    from . import _config

    try:
        _path, _found, settings = _config.load()
    except _config.ConfigError as exc:
        error(f"{exc.message} — the supervisor does not start on an invalid config")
        return None
    os.environ.update(_config.daemon_environment(settings, os.environ))
    return _config.supervisor_options(settings)


def cmd_daemon(layout: Layout, args: argparse.Namespace) -> NoReturn:
    """Run the supervisor until it stops; then the process ends, without the interpreter's
    teardown (:func:`._cli_exit.exit_after_cleanup`): ``shutdown`` waits for it to be gone."""
    from ._cli_exit import exit_after_cleanup

    exit_after_cleanup(_run_daemon(layout, args))


def _run_daemon(layout: Layout, args: argparse.Namespace) -> int:
    from . import _earlytemplate
    from ._autostart import take_ready_fd

    ready_fd = take_ready_fd(os.environ)  # (before anything is started: nothing inherits it)
    # the worker fork template starts beside the imports below, not after them
    _earlytemplate.start()
    import logging

    from ._trioimport import import_trio

    import_trio()  # (without the ldconfig run a plain import costs)
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
        error(str(exc))
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
        if ready_fd is not None:  # its client waits on the pipe, not only on its probe ticks
            from ._autostart import readiness_notifier

            notifier = readiness_notifier(ready_fd)
        else:
            notifier = Notifier(None)
    else:
        if ready_fd is not None:
            os.close(ready_fd)
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
            error(exc.message)
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


def cmd_shutdown(layout: Layout, args: argparse.Namespace) -> int:
    if args.all or args.force:
        from ._shutdown import shutdown_many

        return shutdown_many(layout, every=args.all, force=args.force, as_json=args.json)
    from ._defaults import SHUTDOWN_EXIT_WAIT
    from ._identity import wait_gone

    client = client_or_none(layout)
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
        error(f"supervisor pid {pid} did not exit within {SHUTDOWN_EXIT_WAIT:g}s — try"
               " `trio-agentd doctor --fix`")
    return EXIT_OK if stopped else EXIT_FAIL


def cmd_restart(layout: Layout, args: argparse.Namespace) -> int:
    import time

    from ._autostart import is_ours
    from ._defaults import CLIENT, RESTART_WAIT
    from ._paths import check_socket_path
    from ._syncclient import SyncClient, probe

    check_socket_path(layout.socket)
    got = probe(layout, patience=CLIENT.patience, trace=current_trace())
    if got is None:
        error(f"no supervisor running on {layout.socket} — the next command starts one")
        return EXIT_FAIL
    got[0].close()
    layout.check_served_home(got[1].get("home"))
    if not is_ours(got[1]):
        # another version: its own restart would start its own code again; hand the socket
        # over to a supervisor of this installation instead, at once (turns go on)
        return _hand_over_now(layout, got[1], as_json=args.json)
    client = client_or_none(layout)
    if client is None:
        error(f"no supervisor running on {layout.socket} — the next command starts one")
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
        error(f"the new supervisor did not answer on {layout.socket} within"
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
