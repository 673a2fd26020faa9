"""The ownership registry's files: their names, and the two writes every revoker makes.

``<registry>/<generation>.owner/`` holds a supervisor's ``owner.json`` and ``scope.json``;
``<generation>.revoked`` is the tombstone that tells it (and its workers) it was revoked;
``.guard`` serialises every mutation and ``shutdown.lock`` is the shutdown admission. A name
that starts with ``.`` is never a record (candidates, records moved aside). The supervisor's
``Registry`` and the trio-free ``doctor``/``ps`` read the same names from here, and revoke the
same way. No trio: ``ps`` runs this on every call.
"""

from __future__ import annotations

import os

from . import _fs

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from typing import Any

OWNER_SUFFIX = ".owner"
OWNER_FILE = "owner.json"
SCOPE_FILE = "scope.json"
TOMBSTONE_SUFFIX = ".revoked"
GUARD_FILE = ".guard"
SHUTDOWN_LOCK_FILE = "shutdown.lock"


def owner_dir_name(generation: str) -> str:
    return f"{generation}{OWNER_SUFFIX}"


def tombstone_name(generation: str) -> str:
    return f"{generation}{TOMBSTONE_SUFFIX}"


def generation_of(name: str) -> str | None:
    """The generation whose record directory ``name`` is; ``None`` for any other entry."""
    if not name.endswith(OWNER_SUFFIX) or name.startswith("."):
        return None
    return name[: -len(OWNER_SUFFIX)]


def record_names(root: str | os.PathLike[str]) -> list[str]:
    """The record directories in the registry, sorted (none if it does not exist).

    Raises:
        OSError: the registry cannot be listed (not ours to read, not a directory).
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if generation_of(n) is not None)


def move_aside(root: str | os.PathLike[str], name: str) -> None:
    """Take ``name`` out of the registry at once (a rename to a hidden name), then delete it."""
    src = os.path.join(root, name)
    dst = os.path.join(root, f".dead-{name}-{os.urandom(4).hex()}")
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return
    import shutil  # here: ps imports this module on every call, and never removes anything

    shutil.rmtree(dst, ignore_errors=True)


def write_tombstone(root: str | os.PathLike[str], generation: str, note: dict[str, Any]) -> None:
    """Revoke ``generation`` (its supervisor exits at its next check). Run under the guard."""
    _fs.atomic_write_json(os.path.join(root, tombstone_name(generation)),
                          {"generation": generation, **note})
