"""Processes as values: whether an incarnation still runs, and a process group named safely.
Pure: values, no probe.

``_identity`` makes the probes and sends the signals (signal 0, the start id, ``killpg``); the
pure rules that weigh them (``_ownership``, ``_doctor_plan``, ``_journal``) and the agents'
interface import only this, never the OS layer.
"""

from __future__ import annotations

from ._plain import Enum, Frozen  # Enum: enum.Enum to type checkers, without importing it


class Liveness(Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"  # exists but identity unreadable: counts as alive, never signalled


class GroupIdentity(Frozen):
    """A process group named safely: its id and its leader's incarnation ``(pid, start_id)``.

    The runner starts every turn's leader in a new session, so ``pgid == pid``.
    """

    __slots__ = ("pgid", "pid", "start_id")
    pgid: int
    pid: int
    start_id: str | None

    def __init__(self, pgid: int, pid: int, start_id: str | None) -> None:
        object.__setattr__(self, "pgid", pgid)
        object.__setattr__(self, "pid", pid)
        object.__setattr__(self, "start_id", start_id)
