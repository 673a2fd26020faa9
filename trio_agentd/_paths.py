"""Where everything lives, resolved once from flags, environment and defaults.

Path rules only: flags, environment and platform defaults in, paths out. Nothing here looks at
the filesystem: whether a home can be used (``_trust.home_problem``), directory creation and the
proofs of ownership live in ``_trust``. Kept free of trio so the CLI's warm path can import it
cheaply.
"""

from __future__ import annotations

import os
import sys

from ._errors import AgentdError, ErrorCode

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (warm path)
if TYPE_CHECKING:
    from pathlib import Path


APP_NAME = "trio-agentd"
# sockaddr_un.sun_path is 108 bytes on Linux including the terminating NUL.
SUN_PATH_MAX = 107


def normalize_socket_path(path: str | os.PathLike[str]) -> str:
    """Lexically normalise a socket path: absolute, no ``..``, no duplicate ``/``.

    Symlinks are not resolved: two spellings that differ only lexically name one socket.
    """
    text = os.path.abspath(os.fspath(path))
    norm = os.path.normpath(text)
    # POSIX normpath keeps a leading "//"; collapse it too.
    while norm.startswith("//"):
        norm = norm[1:]
    return norm


def socket_key(normalized_socket: str) -> str:
    """First 12 hex digits of sha256 of the normalized socket path."""
    return _sha256_hex(normalized_socket.encode())[:12]


def _sha256_hex(data: bytes) -> str:
    """sha256 of ``data`` in hex, from the interpreter's built-in module where there is one
    (``ps`` computes it per socket: importing ``hashlib`` loads OpenSSL, which costs more)."""
    for name in ("_sha256", "_sha2", "hashlib"):  # CPython <= 3.11, 3.12+, any
        try:
            module = __import__(name)
        except ImportError:
            continue
        return str(module.sha256(data).hexdigest())
    raise RuntimeError("no sha256")  # pragma: no cover - hashlib always has it


FIX_HOME = "set --home or TRIO_AGENTD_HOME to a directory you can write, or fix HOME"


def _state_root() -> str:
    """The per-user state dir (``$XDG_STATE_HOME`` or ``~/.local/state``, then ``trio-agentd``).

    Raises:
        AgentdError: ``config`` when there is no home to put it in (``HOME`` unset and no
            passwd entry for this uid: ``~`` stays unexpanded).
    """
    home = os.environ.get("HOME")
    why: str | None = None
    if home is not None and not os.path.isabs(home):  # "" would make it /.local/state
        why = f"HOME={home!r} is not an absolute path"
    try:
        root = _user_state_dir()
        unexpanded = not os.path.isabs(root)  # no HOME and no passwd entry: "~" stays
    except RuntimeError:  # newer platformdirs: "could not determine the home directory"
        unexpanded = True
    if why is None and unexpanded:
        why = f"HOME is unset and uid {os.getuid()} has no home in the passwd database"
    xdg = os.environ.get("XDG_STATE_HOME", "")
    if why is not None and not os.path.isabs(xdg):
        raise AgentdError(
            ErrorCode.CONFIG,
            f"no directory to keep state in: {why} — {FIX_HOME}"
            " (and TRIO_AGENTD_REGISTRY_DIR)",
            {"home": None},
        )
    if unexpanded:  # pragma: no cover - XDG_STATE_HOME absolute: platformdirs used it
        raise AgentdError(ErrorCode.CONFIG, f"no directory to keep state in — {FIX_HOME}")
    return root


def _user_state_dir() -> str:
    """``$XDG_STATE_HOME/trio-agentd``, else ``~/.local/state/trio-agentd``: the XDG base
    directory rule (a relative ``XDG_STATE_HOME`` is ignored), as ``platformdirs`` applies it
    on Linux and the BSDs. Written out here
    because importing ``platformdirs`` (``tempfile``, ``random``, ``shutil`` with it) cost
    ``ps`` and a cold ``-p`` more than the rest of finding the home; other systems (macOS,
    Windows: their own conventions) still ask ``platformdirs``.

    Raises:
        RuntimeError: (``platformdirs``, newer versions) no home directory to expand.
    """
    if sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
        xdg = os.environ.get("XDG_STATE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.expanduser("~/.local/state")
        return os.path.join(base, APP_NAME)
    import platformdirs

    return platformdirs.user_state_dir(APP_NAME)


def default_home() -> Path:
    from pathlib import Path

    return Path(_default_home())


def _default_home() -> str:
    """:func:`default_home` as a string (no ``pathlib`` for ``ps``)."""
    env = os.environ.get("TRIO_AGENTD_HOME")
    if env:
        return os.path.abspath(env)
    return _state_root()


def default_registry_dir() -> Path:
    from pathlib import Path

    return Path(_default_registry_dir())


def _default_registry_dir() -> str:
    """:func:`default_registry_dir` as a string (no ``pathlib`` for ``ps``)."""
    env = os.environ.get("TRIO_AGENTD_REGISTRY_DIR")
    if env:
        return os.path.abspath(env)
    return os.path.join(_state_root(), "supervisor-owners")


def default_socket_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, APP_NAME)
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"{APP_NAME}-{os.getuid()}")


def default_socket() -> str:
    env = os.environ.get("TRIO_AGENTD_SOCKET")
    if env:
        return normalize_socket_path(env)
    return normalize_socket_path(os.path.join(default_socket_dir(), "daemon.sock"))


class Layout:
    """Every path one supervisor (or a client of it) uses. Immutable.

    A plain slotted class rather than a dataclass, and ``home``/``registry`` are resolved on
    first use: the CLI's warm path only needs the socket path, and should not pay for
    ``dataclasses``, ``pathlib`` or ``platformdirs``.
    """

    __slots__ = ("_home", "_key", "_registry", "home_source", "socket")

    socket: str
    _home: str | None
    _registry: str | None
    _key: str | None
    # what set the home explicitly ("--home", "TRIO_AGENTD_HOME", "home="; set by ``resolve``),
    # None otherwise: only an explicit home is checked against the home a supervisor serves
    home_source: str | None

    def __init__(
        self,
        *,
        home: str | os.PathLike[str] | None,
        socket: str,
        registry: str | os.PathLike[str] | None,
        home_source: str | None = None,
    ) -> None:
        object.__setattr__(self, "socket", socket)
        object.__setattr__(self, "home_source", home_source)
        object.__setattr__(self, "_home", None if home is None else os.fspath(home))
        object.__setattr__(self, "_registry", None if registry is None else os.fspath(registry))
        object.__setattr__(self, "_key", None)  # socket_key(socket), on first use

    @classmethod
    def resolve(
        cls,
        *,
        socket: str | os.PathLike[str] | None = None,
        home: str | os.PathLike[str] | None = None,
        registry: str | os.PathLike[str] | None = None,
        home_flag: str = "--home",
    ) -> Layout:
        """Flags first, then the environment, then the per-user defaults.

        ``home_flag`` names the explicit ``home`` in errors (``--home`` for the CLI)."""
        env_home = os.environ.get("TRIO_AGENTD_HOME")
        env_registry = os.environ.get("TRIO_AGENTD_REGISTRY_DIR")
        source = home_flag if home is not None else ("TRIO_AGENTD_HOME" if env_home else None)
        home = home if home is not None else (env_home or None)
        registry = registry if registry is not None else (env_registry or None)
        return cls(
            home=None if home is None else os.path.abspath(home),
            socket=normalize_socket_path(socket) if socket is not None else default_socket(),
            registry=None if registry is None else os.path.abspath(registry),
            home_source=source,
        )

    def home_origin(self) -> str:
        """What chose the home, for errors: the flag or variable to fix."""
        if self.home_source is not None:
            return self.home_source
        if os.environ.get("XDG_STATE_HOME"):
            return f"XDG_STATE_HOME={os.environ['XDG_STATE_HOME']}"
        return f"HOME={os.environ['HOME']}" if "HOME" in os.environ else "HOME (unset)"

    @property
    def registry_explicit(self) -> bool:
        """The registry dir was given (flag or ``TRIO_AGENTD_REGISTRY_DIR``), not defaulted."""
        return self._registry is not None

    def check_served_home(self, served: object) -> None:
        """Refuse a supervisor that serves another home than the one set explicitly here.

        ``served`` is the ``home`` of its hello (absent from an older supervisor's: no check).

        Raises:
            AgentdError: ``config``, naming both homes and what set ours.
        """
        if self.home_source is None or not isinstance(served, str) or not served:
            return
        mine = self.home_dir
        if mine == served or os.path.realpath(mine) == os.path.realpath(served):
            return
        raise AgentdError(
            ErrorCode.CONFIG,
            f"the supervisor on {self.socket} serves home {served}, not {mine} (set by"
            f" {self.home_source}) — one socket serves one home: use the supervisor's home,"
            " or another --socket for this one",
            {"served_home": served, "home": mine},
        )

    @property
    def home(self) -> Path:
        from pathlib import Path

        if self._home is None:
            object.__setattr__(self, "_home", _default_home())
        return Path(str(self._home))

    @property
    def home_dir(self) -> str:
        """:attr:`home` as a string, without importing ``pathlib`` when the home is set."""
        if self._home is None:
            object.__setattr__(self, "_home", _default_home())
        return str(self._home)

    @property
    def registry_dir(self) -> str:
        """:attr:`registry` as a string, without importing ``pathlib`` when it is set."""
        if self._registry is None:
            object.__setattr__(self, "_registry", _default_registry_dir())
        return str(self._registry)

    @property
    def registry(self) -> Path:
        from pathlib import Path

        if self._registry is None:
            object.__setattr__(self, "_registry", _default_registry_dir())
        return Path(str(self._registry))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Layout is immutable (tried to set {name})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (self.home, self.socket, self.registry) == (other.home, other.socket, other.registry)

    def __hash__(self) -> int:
        return hash((self.home, self.socket, self.registry))

    def __repr__(self) -> str:
        return f"Layout(home={self.home!r}, socket={self.socket!r}, registry={self.registry!r})"

    @property
    def key(self) -> str:
        # every state path is under it: computed once (a supervisor asks for it per write)
        key: str | None = self._key
        if key is None:
            key = socket_key(self.socket)
            object.__setattr__(self, "_key", key)
        return key

    @property
    def socket_dir(self) -> str:
        return os.path.dirname(self.socket)

    @property
    def lease_path(self) -> str:
        return self.socket + ".lock"

    @property
    def state_dir(self) -> Path:
        from pathlib import Path

        return Path(self.state_dir_name)

    @property
    def state_dir_name(self) -> str:
        """:attr:`state_dir` as a string, without importing ``pathlib`` (a cold prompt's
        autostart needs only it and :attr:`log_file`)."""
        return os.path.join(self.home_dir, "daemons", self.key)

    @property
    def log_file(self) -> str:
        """:attr:`log_path` as a string, without importing ``pathlib``."""
        return os.path.join(self.state_dir_name, "daemon.log")

    @property
    def workers_dir(self) -> Path:
        return self.state_dir / "workers"

    @property
    def journal_dir(self) -> Path:
        return self.state_dir / "journal"

    @property
    def generations_dir(self) -> Path:
        return self.state_dir / "generations"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "daemon.log"

    @property
    def sessions_dir(self) -> Path:
        return self.home / "sessions"

    def session_dir(self, session_id: str) -> Path:
        return self.sessions_dir / session_id

    def descriptor_path(self, session_id: str) -> Path:
        return self.workers_dir / f"{session_id}.json"

    def token_path(self, session_id: str) -> Path:
        return self.workers_dir / f"{session_id}.token"

    def journal_path(self, session_id: str) -> Path:
        return self.journal_dir / f"{session_id}.jsonl"

    def worker_socket(self, session_id: str) -> str:
        """A short path next to the public socket (sun_path is small; the home may be long)."""
        import hashlib

        digest = hashlib.sha256(session_id.encode()).hexdigest()[:10]
        return os.path.join(self.socket_dir, f"w-{self.key[:8]}-{digest}.sock")


def check_socket_path(path: str) -> None:
    """Refuse a socket path longer than the platform's ``sun_path`` limit."""
    size = len(os.fsencode(path))
    if size > SUN_PATH_MAX:
        raise AgentdError(
            ErrorCode.CONFIG,
            f"socket path is {size} bytes, over the {SUN_PATH_MAX}-byte sun_path limit: {path}"
            " — choose a shorter --socket",
            {"limit": SUN_PATH_MAX, "length": size},
        )
