"""The config file, ``$XDG_CONFIG_HOME/trio-agentd/config.toml`` (default ``~/.config/...``).

Every user-facing knob has a key (:data:`KEYS`); where an environment variable sets the same
thing, it wins over the file: flag > environment variable > config file > default. Most keys are
read by the supervisor when it starts (``trio-agentd restart`` applies a change); it hands the
file's values on to its workers through the same variables the environment would set.

The pure part (:func:`parse`, :func:`from_env`, :func:`resolve`) takes a parsed document and an
environment and decides; :func:`read_file` and :func:`load` are the thin I/O shell. Nothing here
is imported on the CLI's warm path (``tomllib`` costs more than a warm prompt can spare): only
``trio-agentd config``, the supervisor's start and a client's upgrade handover read the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from . import _defaults
from ._defaults import ENV_LOG_BACKUPS, ENV_LOG_MAX_BYTES, ENV_OUTPUT_MAX_BYTES
from ._errors import AgentdError, ErrorCode
from ._plain import Frozen
from .timing import DEFAULT_TIMING, Timing, TimingError, check_override

ENV_TIMING = "TRIO_AGENTD_TIMING"
ENV_SELF_HEAL = "TRIO_AGENTD_SELF_HEAL"
DEFAULT_AGENT = "echo"


class ConfigError(AgentdError, ValueError):
    """A bad config file or knob: one line naming the file (or variable), the key and what is
    wrong (an ``AgentdError`` ``config``; also a ``ValueError``)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CONFIG, message)


class Key(Frozen):
    """One config key: its dotted name, the environment variable that overrides it (``None``:
    none; for ``timing.*`` the field of the ``TRIO_AGENTD_TIMING`` JSON object), its default,
    who reads it and what it does."""

    __slots__ = ("default", "env", "meaning", "name", "reader")

    def __init__(
        self, name: str, env: str | None, default: object, reader: str, meaning: str
    ) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "env", env)
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "reader", reader)
        object.__setattr__(self, "meaning", meaning)

    name: str
    env: str | None
    default: object
    reader: str
    meaning: str


_SUP = "supervisor"
# client timings the CLI, doctor and open_client keep at their built-in values (the warm path
# reads no file): a key for each, as TRIO_AGENTD_TIMING takes every field, reaches no client
_BUILTIN = "— (clients: built-in)"
_TIMING_MEANING: dict[str, tuple[str, str]] = {
    "refence_interval": ("worker", "how often a worker re-checks that its session is still its"
                         " own (polling)"),
    "refence_fallback": ("worker", "with a registry watch: the longest a worker goes without"
                         " re-checking"),
    "self_check_interval": (_SUP, "how often the supervisor checks its own record and socket"),
    "worker_connect_timeout": (_SUP, "how long a new worker may take to connect back"),
    "adopt_connect_timeout": (_SUP, "how long adopting a running worker may take to connect"),
    "worker_retry_delays": (_SUP, "pauses between attempts to reach a worker that went away"),
    "deferred_recovery_recheck": (_SUP, "pause between deferred recovery rounds"),
    "max_deferred_recovery_rounds": (_SUP, "deferred recovery rounds before a worker is"
                                     " respawned"),
    "stop_grace": ("supervisor, worker", "how long a running turn may finish on a clean stop"
                   " (0: none)"),
    "kill_confirm_timeout": (_SUP, "how long a KILL is waited for before it is reported"),
    "restart_intensity": (_SUP, "crashes within restart_window before a session is failed"),
    "restart_window": (_SUP, "the window restart_intensity counts crashes in"),
    "idle_eviction": (_SUP, "stop a session's worker after this long idle (0: never)"),
    "idle_sweep_period": (_SUP, "how often idle sessions are looked for"),
    "startup_timeout": (_BUILTIN, "how long a supervisor that was started may take to answer"),
    "probe_interval": (_BUILTIN, "pause between probes of a starting supervisor"),
    "hello_timeout": (_BUILTIN, "how long a supervisor may take to say hello"),
    "connect_timeout": (_SUP, "how long a connect to a socket may take (the supervisor"
                        " probing its own; clients keep the built-in value)"),
    "patience": (_BUILTIN, "how long a live but silent supervisor is waited for"),
    "patience_tick": (_BUILTIN, "progress line interval while waiting (patience)"),
    "reprobe_window": (_BUILTIN, "--fix repairs only what stays unresponsive this long"),
    "handover_wait": ("CLI", "on an upgrade: how long busy sessions are waited"
                      " for before the hand-over"),
    "upgrade_idle": (_SUP, "replace an adopted worker of another version after this long idle"),
    "auth_timeout": (_SUP, "how long a worker connection may take to authenticate"),
    "admission_wait": (_SUP, "how long a held shutdown admission is waited for at start"),
    "admission_poll": (_SUP, "poll interval while waiting for an admission"),
    "lock_poll": ("supervisor, worker", "first back-off of a lock poll"),
    "drop_notice_timeout": ("worker", "how long a dropped worker tries to tell its supervisor"),
    "notice_interval": ("worker", "the least time between two turn notices a worker sends its"
                        " supervisor (those in between coalesce)"),
    "grant_ttl": (_SUP, "how long a direct route grant is good for"),
    "status_timeout": (_SUP, "how long `sessions` waits for the workers' own counts"),
    "storage_retry_delays": ("supervisor, worker", "pauses before a failed write is retried"),
    "link_ping_interval": ("all", "silence on a busy link to a worker before it is pinged"),
    "link_ping_timeout": ("all", "how long a ping may go unanswered (then: unresponsive)"),
    "link_idle_ping_interval": (_SUP, "silence on an idle worker link before it is pinged"),
    "fork_template_restart_delay": (_SUP, "pause before a dead worker fork template is"
                                    " started again"),
}


def _timing_keys() -> list[Key]:
    import dataclasses

    out = []
    for f in dataclasses.fields(Timing):
        reader, meaning = _TIMING_MEANING[f.name]
        default = getattr(DEFAULT_TIMING, f.name)
        out.append(Key(f"timing.{f.name}", ENV_TIMING, list(default)
                       if isinstance(default, tuple) else default, reader, meaning))
    return out


KEYS: tuple[Key, ...] = (
    Key("default_agent", None, DEFAULT_AGENT, _SUP, "the agent of a new session prompted"
        " without --agent: echo, shell, exec:COMMAND or module:attr (the --agent flag wins)"),
    Key("self_heal", ENV_SELF_HEAL, True, _SUP, "restore a deleted owner record by itself"
        " (false: stay wedged until `doctor --fix`)"),
    Key("limits.max_clients", None, 1024, _SUP, "client connections served at once; one more"
        " gets resource_exhausted"),
    Key("limits.max_sessions", None, 1000, _SUP, "sessions a supervisor runs; creating one more"
        " fails with resource_exhausted"),
    Key("logs.max_bytes", ENV_LOG_MAX_BYTES, _defaults.LOG_MAX_BYTES, "supervisor, worker",
        "rotate daemon.log, worker.log and transcript.jsonl past this size (0: never)"),
    Key("logs.backups", ENV_LOG_BACKUPS, _defaults.LOG_BACKUPS, "supervisor, worker",
        "rotated files kept of each log"),
    Key("logs.output_max_bytes", ENV_OUTPUT_MAX_BYTES, _defaults.OUTPUT_MAX_BYTES, "worker",
        "a session's kept turn output files in all; past it the oldest turns' go (the newest"
        " turn's stay; 0: keep all)"),
    *_timing_keys(),
)
BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}


# --- pure: checking values -------------------------------------------------------------------


def _shown(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _whole(least: int) -> Callable[[object, str], object]:
    def check(value: object, label: str) -> object:
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{label} must be a whole number >= {least} (got {_shown(value)})")
        return value

    return check


def _boolean(value: object, label: str) -> object:
    if not isinstance(value, bool):
        raise ConfigError(f"{label} must be true or false (got {_shown(value)})")
    return value


def _agent(value: object, label: str) -> object:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{label} must be an agent spec: echo, shell, exec:COMMAND or"
                          f" module:attr (got {_shown(value)})")
    from .agents._spec import validate_agent_spec

    try:
        validate_agent_spec(value)
    except AgentdError as exc:
        raise ConfigError(f"{label}: {exc.message}") from None
    return value


_CHECKS: dict[str, Callable[[object, str], object]] = {
    "default_agent": _agent,
    "self_heal": _boolean,
    "limits.max_clients": _whole(1),
    "limits.max_sessions": _whole(1),
    "logs.max_bytes": _whole(0),
    "logs.backups": _whole(1),
    "logs.output_max_bytes": _whole(0),
}


def check_value(name: str, value: object, label: str) -> object:
    """``value`` for key ``name``, checked (a ``timing.*`` list becomes a tuple).

    Raises:
        ConfigError: ``label``, what the key must be and the value as given.
    """
    if name.startswith("timing."):
        try:
            return check_override(name.removeprefix("timing."), value, label)
        except TimingError as exc:
            raise ConfigError(exc.message) from None
    return _CHECKS[name](value, label)


def parse(doc: Mapping[str, object], where: str) -> dict[str, object]:
    """The keys a parsed config document sets (dotted names), each checked.

    Raises:
        ConfigError: ``where`` (the file), the key and what is wrong: an unknown key or table,
            a value of the wrong type, NaN or infinity, below the key's floor.
    """
    out: dict[str, object] = {}
    for top, value in doc.items():
        if isinstance(value, dict):
            for sub, inner in value.items():
                _take(out, f"{top}.{sub}", inner, where)
        else:
            _take(out, top, value, where)
    return out


def _take(out: dict[str, object], name: str, value: object, where: str) -> None:
    if name not in BY_NAME:
        table = name.partition(".")[0] + "." if "." in name else ""
        near = sorted(k for k in BY_NAME if table and k.startswith(table))
        hint = (f"; {table[:-1]} has: {', '.join(k.removeprefix(table) for k in near)}" if near
                else "; see `trio-agentd config` for every key")
        raise ConfigError(f"{where}: unknown key {name!r}{hint}")
    out[name] = check_value(name, value, f"{where}: {name}")


def from_env(environ: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    """The keys the environment sets: ``{key: (value, variable)}``.

    Raises:
        ConfigError: a variable that is set but not valid, naming it.
    """
    out: dict[str, tuple[object, str]] = {}
    raw = environ.get(ENV_TIMING)
    if raw:
        try:
            overrides = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"{ENV_TIMING} is not JSON: {exc}") from None
        if not isinstance(overrides, dict):
            raise ConfigError(f"{ENV_TIMING} must be a JSON object")
        unknown = sorted(set(overrides) - {k.name[7:] for k in KEYS if k.name[:7] == "timing."})
        if unknown:
            raise ConfigError(f"{ENV_TIMING} has unknown fields: {unknown}")
        for field, value in overrides.items():
            try:
                checked = check_override(field, value, f"{ENV_TIMING}: {field}")
            except TimingError as exc:
                raise ConfigError(exc.message) from None
            out[f"timing.{field}"] = (list(checked) if isinstance(checked, tuple) else checked,
                                      ENV_TIMING)
    heal = environ.get(ENV_SELF_HEAL)
    if heal is not None and heal.strip():
        # the words the supervisor itself knows: anything else (``off``, ``maybe``) would be
        # taken for "on" there, so it is refused here, before the supervisor starts
        word = heal.strip().lower()
        if word not in ("0", "false", "no", "1", "true", "yes"):
            raise ConfigError(f"{ENV_SELF_HEAL} must be 0, false or no (off), or 1, true or yes"
                              f" (on) (got {heal!r})")
        out["self_heal"] = (word not in ("0", "false", "no"), ENV_SELF_HEAL)
    for name, var, least in (("logs.max_bytes", ENV_LOG_MAX_BYTES, 0),
                             ("logs.backups", ENV_LOG_BACKUPS, 1),
                             ("logs.output_max_bytes", ENV_OUTPUT_MAX_BYTES, 0)):
        text = environ.get(var)
        if text is None or text == "":
            continue
        try:
            number = int(text)
        except ValueError:
            number = least - 1
        if number < least:
            raise ConfigError(f"{var} must be a whole number >= {least} (got {text!r})")
        out[name] = (number, var)
    return out


class Setting(Frozen):
    """A key's effective value and where it came from: ``default``, the config file's path,
    or ``env NAME``."""

    __slots__ = ("key", "source", "value")

    def __init__(self, key: str, value: object, source: str) -> None:
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "source", source)

    key: str
    value: object
    source: str


def resolve(
    file_values: Mapping[str, object], path: str, environ: Mapping[str, str]
) -> dict[str, Setting]:
    """Every key's effective value: environment > file > default. Pure.

    Raises:
        ConfigError: a bad environment variable.
    """
    env = from_env(environ)
    out: dict[str, Setting] = {}
    for key in KEYS:
        if key.name in env:
            value, var = env[key.name]
            out[key.name] = Setting(key.name, value, f"env {var}")
        elif key.name in file_values:
            value = file_values[key.name]
            out[key.name] = Setting(
                key.name, list(value) if isinstance(value, tuple) else value, path)
        else:
            out[key.name] = Setting(key.name, key.default, "default")
    return out


def daemon_environment(
    settings: Mapping[str, Setting], environ: Mapping[str, str]
) -> dict[str, str]:
    """The variables to set in the supervisor's environment so that it — and the workers it
    starts, which read the same variables — use the file's values: only for keys the file set
    (the environment already holds its own). Pure."""
    out: dict[str, str] = {}
    timing = {k.removeprefix("timing."): s.value for k, s in settings.items()
              if k.startswith("timing.") and s.source not in ("default",)}
    if any(s.source not in ("default", f"env {ENV_TIMING}")
           for k, s in settings.items() if k.startswith("timing.")):
        out[ENV_TIMING] = json.dumps(timing, sort_keys=True)
    for name, var in (("self_heal", ENV_SELF_HEAL), ("logs.max_bytes", ENV_LOG_MAX_BYTES),
                      ("logs.backups", ENV_LOG_BACKUPS),
                      ("logs.output_max_bytes", ENV_OUTPUT_MAX_BYTES)):
        s = settings[name]
        if s.source not in ("default", f"env {var}") and var not in environ:
            value = s.value
            out[var] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def supervisor_options(settings: Mapping[str, Setting]) -> dict[str, Any]:
    """``SupervisorConfig`` fields the settings decide (the rest come through the
    environment: see :func:`daemon_environment`)."""
    return {
        "default_agent": settings["default_agent"].value,
        "max_clients": settings["limits.max_clients"].value,
        "max_sessions": settings["limits.max_sessions"].value,
    }


# --- the I/O shell -----------------------------------------------------------------------------


def config_path(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_CONFIG_HOME/trio-agentd/config.toml``; ``~/.config`` when that is unset, empty
    or relative (as the XDG base directory spec says)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or ""
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "trio-agentd", "config.toml")


def loads(text: str, where: str) -> dict[str, object]:
    """A config file's text, parsed and checked (see :func:`parse`).

    Raises:
        ConfigError: not TOML (with TOML's own line and column), or a bad key.
    """
    import tomllib

    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    return parse(doc, where)


MAX_FILE_BYTES = 1 << 20  # a config file is a few hundred bytes; this one is something else


def _file_kind(mode: int) -> str:
    import stat

    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def read_file(path: str) -> dict[str, object] | None:
    """The checked keys of the config file at ``path``; ``None`` when there is none.

    Raises:
        ConfigError: unreadable (naming the errno), not UTF-8, not TOML, or a bad key.
    """
    import stat

    try:
        # O_NONBLOCK: a FIFO in the file's place must not hang the daemon's start; only a
        # regular file is read, and at most MAX_FILE_BYTES of it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        if os.path.islink(path):  # a symlink to nothing: a mistake, never "no file"
            raise ConfigError(f"{path}: a symlink to {os.readlink(path)!r}, which does not"
                              " exist — point it at the config file, or remove it") from None
        return None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}"
                          " — fix its permissions or remove it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: {_file_kind(st.st_mode)}, not a regular file — put the"
                              " settings in a file there, or remove it")
        if st.st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: {st.st_size} bytes, more than a config file may be"
                              f" ({MAX_FILE_BYTES} bytes) — is it the right file?")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}"
                          " — fix its permissions or remove it") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:  # it grew meanwhile
        raise ConfigError(f"{path}: more than a config file may be ({MAX_FILE_BYTES} bytes)"
                          " — is it the right file?")
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 (byte {exc.start})") from None
    return loads(text, path)


def load(environ: Mapping[str, str] | None = None) -> tuple[str, bool, dict[str, Setting]]:
    """The config file's path, whether it exists, and every key's effective value.

    Raises:
        ConfigError: a bad file or environment variable.
    """
    env = os.environ if environ is None else environ
    path = config_path(env)
    values = read_file(path)
    return path, values is not None, resolve(values or {}, path, env)


def effective_timing(environ: Mapping[str, str] | None = None) -> Timing:
    """The :class:`Timing` the config file and ``TRIO_AGENTD_TIMING`` make (for a client)."""
    import dataclasses

    _path, _found, settings = load(environ)
    changed = {k.removeprefix("timing."): tuple(s.value) if isinstance(s.value, list)
               else s.value for k, s in settings.items()
               if k.startswith("timing.") and s.source != "default"}
    return dataclasses.replace(DEFAULT_TIMING, **changed)  # type: ignore[arg-type]

