"""``trio-agentd service install|uninstall|status``: a systemd user unit for the supervisor.

``install`` writes ``trio-agentd.service`` (and with ``--socket-activation`` a matching
``trio-agentd.socket``) into ``$XDG_CONFIG_HOME/systemd/user`` (``~/.config/systemd/user``)
and prints what to run next; ``uninstall`` removes them; ``status`` says whether they exist and
are what this installation would write now. None of them runs ``systemctl`` unless asked
(``--systemctl``).

The unit runs this installation's Python (absolute path) on this layout's socket, home and
registry (absolute paths, so the unit does not depend on the service manager's environment):

- ``Type=notify``: the supervisor says READY=1 once it serves, STATUS= as it goes, STOPPING=1;
- ``WatchdogSec=`` :data:`~trio_agentd.timing.SERVICE_WATCHDOG_SEC`: pinged from the
  supervisor's self-check loop after each healthy check (every half of it);
- ``KillMode=process``: ``systemctl --user stop|restart`` sends SIGTERM to the supervisor only;
  it releases the socket and its record and its workers run on, adopted by the next supervisor;
- ``Restart=on-failure``: a crash, a non-zero exit or a missed watchdog starts it again.

Rendering (:func:`render_service`, :func:`render_socket`, :func:`exec_quote`) is pure; the
rest is a thin shell of file writes and prints.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import AgentdError, ErrorCode
from ._paths import Layout
from ._trust import isolated_python
from .timing import SERVICE_WATCHDOG_SEC

UNIT = "trio-agentd"
SERVICE_FILE = f"{UNIT}.service"
SOCKET_FILE = f"{UNIT}.socket"
_HEADER = (
    "# Written by `trio-agentd service install`; `trio-agentd service status` says whether it\n"
    "# is current. Put your own settings in a drop-in (`systemctl --user edit trio-agentd`):\n"
    "# `trio-agentd service install` rewrites this file.\n"
)


def unit_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/systemd/user`` (an absolute XDG_CONFIG_HOME only, as the XDG spec
    says), else ``~/.config/systemd/user``.

    Raises:
        AgentdError: ``config`` when neither XDG_CONFIG_HOME nor HOME is usable.
    """
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CONFIG_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "systemd" / "user"
    home = env.get("HOME", "") or os.path.expanduser("~")
    if not os.path.isabs(home):
        raise AgentdError(
            ErrorCode.CONFIG,
            "cannot find where systemd user units go: XDG_CONFIG_HOME and HOME are unset or"
            " not absolute — set HOME (or XDG_CONFIG_HOME)",
        )
    return Path(home) / ".config" / "systemd" / "user"


def exec_quote(word: str) -> str:
    """One word of an ``ExecStart=`` line, as systemd splits and expands it: ``%`` and ``$``
    doubled, quoted (with ``\\`` and ``"`` escaped) when it holds a space, quote or
    backslash.

    Raises:
        AgentdError: ``config`` for a word with a control character (a unit line cannot
            hold it).
    """
    if any(ord(c) < 32 or ord(c) == 127 for c in word):
        raise AgentdError(ErrorCode.CONFIG,
                          f"cannot write {word!r} into a systemd unit: it has a control"
                          " character — use a path without one")
    word = word.replace("%", "%%").replace("$", "$$")
    if word and not any(c in word for c in " \t\"'\\;"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _unit_value(text: str) -> str:
    """A path as the value of a plain unit setting (``ListenStream=``): ``%`` doubled."""
    exec_quote(text)  # the same refusal of control characters
    return text.replace("%", "%%")


def daemon_argv(layout: Layout, python: str | None = None) -> list[str]:
    """What ``ExecStart=`` runs: this installation's Python on ``layout``, absolute paths."""
    base = isolated_python("trio_agentd")
    if python is not None:
        base[0] = python
    return [*base, "--socket", layout.socket, "--home", str(layout.home),
            "--registry", str(layout.registry), "daemon"]


def render_service(layout: Layout, *, socket_activation: bool, python: str | None = None) -> str:
    exec_start = " ".join(exec_quote(w) for w in daemon_argv(layout, python))
    sock = (f"Requires={SOCKET_FILE}\nAfter={SOCKET_FILE}\n" if socket_activation else "")
    return (
        f"{_HEADER}"
        "[Unit]\n"
        f"Description=trio-agentd session supervisor on {_unit_value(layout.socket)}\n"
        f"{sock}"
        "\n"
        "[Service]\n"
        "Type=notify\n"
        f"ExecStart={exec_start}\n"
        "# SIGTERM to the supervisor only: it releases the socket and its ownership record,\n"
        "# and its workers run on, adopted by the next supervisor (no session is lost)\n"
        "KillMode=process\n"
        "Restart=on-failure\n"
        "RestartSec=1\n"
        f"# pinged every {SERVICE_WATCHDOG_SEC / 2:g}s after a healthy self-check\n"
        f"WatchdogSec={SERVICE_WATCHDOG_SEC}\n"
        "\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def render_socket(layout: Layout) -> str:
    return (
        f"{_HEADER}"
        "[Unit]\n"
        f"Description=trio-agentd supervisor socket {_unit_value(layout.socket)}\n"
        "\n"
        "[Socket]\n"
        f"ListenStream={_unit_value(layout.socket)}\n"
        "# the supervisor refuses a socket others may use, or in a dir others may enter\n"
        "SocketMode=0600\n"
        "DirectoryMode=0700\n"
        "\n"
        "[Install]\n"
        "WantedBy=sockets.target\n"
    )


@dataclass(frozen=True, slots=True)
class UnitState:
    path: Path
    state: str  # "current" | "differs" | "missing"


def installed_python(text: str) -> str | None:
    """The program of a unit's ``ExecStart=`` (the first word, unquoted and unescaped as
    :func:`exec_quote` wrote it), or ``None``."""
    for line in text.splitlines():
        if not line.startswith("ExecStart="):
            continue
        value = line[len("ExecStart="):]
        if value.startswith('"'):
            out, i = [], 1
            while i < len(value) and value[i] != '"':
                if value[i] == "\\" and i + 1 < len(value):
                    i += 1
                out.append(value[i])
                i += 1
            word = "".join(out)
        else:
            word = value.split(None, 1)[0] if value.strip() else ""
        return word.replace("%%", "%").replace("$$", "$") or None
    return None


def same_python(a: str, b: str) -> bool:
    """Two paths of one interpreter in one environment (``venv/bin/python`` and
    ``venv/bin/python3``): same dir, same file. Not resolved further: a venv is known by the
    path it is run by."""
    try:
        return os.path.dirname(a) == os.path.dirname(b) and os.path.samefile(a, b)
    except OSError:
        return False


def _state(path: Path, want: Callable[[str | None], str]) -> UnitState:
    """``want(python)``: the unit this installation writes, naming ``python`` (None: ours)."""
    try:
        have = path.read_text()
    except FileNotFoundError:
        return UnitState(path, "missing")
    except (OSError, UnicodeDecodeError):
        return UnitState(path, "differs")
    if have == want(None):
        return UnitState(path, "current")
    python = installed_python(have)
    if python is not None and same_python(python, sys.executable) and have == want(python):
        return UnitState(path, "current")  # written by this Python under another of its names
    return UnitState(path, "differs")


SERVICE_DESCRIPTION = (
    "Write, remove or check a systemd user unit (trio-agentd.service, and with"
    " --socket-activation trio-agentd.socket) in $XDG_CONFIG_HOME/systemd/user"
    " (~/.config/systemd/user) that runs this installation's supervisor on this socket and"
    " home. systemctl is not run unless you pass --systemctl."
)
SERVICE_EXAMPLES = (
    "trio-agentd service install\n"
    "systemctl --user daemon-reload && systemctl --user enable --now trio-agentd\n"
    "trio-agentd service install --socket-activation --systemctl\n"
    "trio-agentd service status\n"
    "trio-agentd service uninstall --systemctl"
)


def add_service_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
                       **kw: Any) -> None:
    """``service install|uninstall|status`` under the CLI's subcommands (``kw``: more
    ``add_parser`` arguments, e.g. the CLI's formatter and epilog)."""
    sv = subparsers.add_parser(
        "service", help="install a systemd user unit for the supervisor",
        **{"description": SERVICE_DESCRIPTION, **kw},
    )
    ssub = sv.add_subparsers(dest="service_command", metavar="ACTION")
    ssub.required = True
    ins = _action(
        ssub, "install", "write the unit file(s) and say what to run next",
        "Write trio-agentd.service (and with --socket-activation trio-agentd.socket) for this"
        " installation's Python, socket, home and registry, then print the systemctl and"
        " loginctl commands that enable it. An existing file is rewritten: put your own"
        " settings in a drop-in (systemctl --user edit trio-agentd).",
        "trio-agentd service install\n"
        "trio-agentd service install --socket-activation\n"
        "trio-agentd service install --systemctl   # and daemon-reload, enable --now",
    )
    ins.add_argument("--socket-activation", action="store_true",
                     help="also write trio-agentd.socket: systemd listens, and starts the"
                     " supervisor when a client connects")
    ins.add_argument("--systemctl", action="store_true",
                     help="then run systemctl --user daemon-reload and enable --now")
    un = _action(
        ssub, "uninstall", "remove the unit file(s)",
        "Remove trio-agentd.service and trio-agentd.socket. Disable the unit first (or pass"
        " --systemctl, which runs systemctl --user disable --now before and daemon-reload"
        " after): a running supervisor is not stopped by removing its file.",
        "trio-agentd service uninstall --systemctl\n"
        "systemctl --user disable --now trio-agentd && trio-agentd service uninstall",
    )
    un.add_argument("--systemctl", action="store_true",
                    help="first run systemctl --user disable --now, then daemon-reload")
    _action(
        ssub, "status", "whether the unit file(s) exist and are current (exit 1 if not)",
        "Compare each unit file with what install would write now: exit 0 when every file"
        " is installed and current, 1 when one is missing or differs (another Python, socket,"
        " home or registry, or an edit by hand).",
        "trio-agentd service status\n"
        "trio-agentd service status || trio-agentd service install",
    )


def _action(ssub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str,
            description: str, examples: str) -> argparse.ArgumentParser:
    """One ``service`` action, its help with a description and examples, as every command's."""
    import textwrap

    return ssub.add_parser(
        name, help=help, description=textwrap.fill(description, 92),
        epilog="examples:\n" + "\n".join(f"  {line}" for line in examples.split("\n")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def run_service(args: argparse.Namespace, layout: Layout) -> int:
    """Run ``service ACTION``. Returns the exit status (0 done / current, 1 otherwise)."""
    try:
        match args.service_command:
            case "install":
                return _install(layout, socket_activation=args.socket_activation,
                                systemctl=args.systemctl)
            case "uninstall":
                return _uninstall(systemctl=args.systemctl)
            case "status":
                return _status(layout)
    except AgentdError as exc:
        _say_error(exc.message)
        return 1
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        _say_error(f"cannot write or remove the unit file{where}: {exc.strerror or exc} — check"
                   " the permissions of that directory")
        return 1
    _say_error(f"unknown service action {args.service_command!r}: use install, uninstall or"
               " status")
    return 2


def _say_error(message: str) -> None:
    print(f"trio-agentd: error: {message}", file=sys.stderr)


def _write(path: Path, want: Callable[[str | None], str]) -> str:
    from ._fs import atomic_write

    old = _state(path, want).state
    if old == "current":
        return "unchanged"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, want(None).encode(), mode=0o644)
    return "wrote" if old == "missing" else "rewrote"


def _install(layout: Layout, *, socket_activation: bool, systemctl: bool) -> int:
    d = unit_dir()
    units: list[tuple[Path, Callable[[str | None], str]]] = [(
        d / SERVICE_FILE,
        lambda py: render_service(layout, socket_activation=socket_activation, python=py))]
    if socket_activation:
        units.append((d / SOCKET_FILE, lambda _: render_socket(layout)))
    for path, want in units:
        print(f"{_write(path, want)} {path}")
    stale_socket = not socket_activation and (d / SOCKET_FILE).exists()
    if stale_socket:
        (d / SOCKET_FILE).unlink()
        print(f"removed {d / SOCKET_FILE} (no --socket-activation)")
    enable = f"{UNIT}.socket" if socket_activation else UNIT
    commands = [["systemctl", "--user", "daemon-reload"],
                ["systemctl", "--user", "enable", "--now", enable]]
    if systemctl:
        return _run_systemctl(commands)
    print("next, to start it now and at every login:")
    print(f"  systemctl --user daemon-reload && systemctl --user enable --now {enable}")
    if socket_activation:
        print("  (systemd then listens on the socket and starts the supervisor at the first"
              " client)")
    print("to keep it running while you are logged out, and start it at boot:")
    print("  loginctl enable-linger $USER")
    print("a supervisor already running outside systemd keeps the socket: hand it over first"
          " with `kill -TERM PID` (PID from `trio-agentd ps`; its workers are adopted)")
    return 0


def _uninstall(*, systemctl: bool) -> int:
    d = unit_dir()
    if systemctl:
        rc = _run_systemctl([["systemctl", "--user", "disable", "--now",
                              *([f"{UNIT}.socket"] if (d / SOCKET_FILE).exists() else []),
                              UNIT]])
        if rc != 0:
            return rc
    removed: list[Path] = []
    for path in (d / SERVICE_FILE, d / SOCKET_FILE):
        if not os.path.lexists(path):
            continue  # (an unlink would say EROFS, not ENOENT, on a read-only dir)
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
        print(f"removed {path}")
    if not removed:
        print(f"no {UNIT} unit in {d}: nothing to remove")
        return 0
    if systemctl:
        return _run_systemctl([["systemctl", "--user", "daemon-reload"]])
    units = " ".join([*([f"{UNIT}.socket"] if d / SOCKET_FILE in removed else []), UNIT])
    print("if it was enabled, stop it and let systemd forget it:")
    print(f"  systemctl --user disable --now {units} && systemctl --user daemon-reload")
    print("(the supervisor stops on SIGTERM with its workers left running; `trio-agentd"
          " shutdown` stops them)")
    return 0


def _status(layout: Layout) -> int:
    d = unit_dir()
    socket_state = _state(d / SOCKET_FILE, lambda _: render_socket(layout))
    activation = socket_state.state != "missing"
    service = _state(d / SERVICE_FILE, lambda py: render_service(
        layout, socket_activation=activation, python=py))
    good = service.state == "current" and socket_state.state in ("current", "missing")
    print(f"service unit {service.path}: {_SAY[service.state]}")
    if activation:
        print(f"socket unit {socket_state.path}: {_SAY[socket_state.state]}")
    if service.state == "differs":
        with contextlib.suppress(OSError, UnicodeDecodeError):
            for line in service.path.read_text().splitlines():
                if line.startswith("ExecStart="):
                    print(f"  it runs:       {line[len('ExecStart='):]}")
        print("  this would run: " + " ".join(exec_quote(w) for w in daemon_argv(layout)))
    if not good:
        print("run `trio-agentd service install"
              f"{' --socket-activation' if activation else ''}` to write it for this"
              f" installation ({sys.executable}, socket {layout.socket})")
    return 0 if good else 1


_SAY = {
    "current": "current",
    "missing": "not installed",
    "differs": "differs from what this installation writes (another Python, socket, home or"
               " registry, or edited by hand)",
}


def _run_systemctl(commands: list[list[str]]) -> int:
    import subprocess

    for argv in commands:
        print("$ " + " ".join(argv), flush=True)
        try:
            cp = subprocess.run(argv, stdin=subprocess.DEVNULL, check=False)
        except FileNotFoundError:
            _say_error("systemctl is not found on PATH — is this a systemd system? The unit"
                       " files are written; run the commands above where systemd runs")
            return 1
        except OSError as exc:
            _say_error(f"cannot run systemctl: {exc.strerror or exc}")
            return 1
        if cp.returncode != 0:
            _say_error(f"`{' '.join(argv)}` exited {cp.returncode} (its message is above)")
            return 1
    return 0
