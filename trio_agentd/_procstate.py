"""Whether a process incarnation still runs, as a verdict. Pure: a value, no probe.

``_identity.liveness`` makes the probe (signal 0 and the start id); the pure rules that weigh
it (``_ownership``, ``_doctor_plan``) import only this, never the OS layer.
"""

from __future__ import annotations

import enum


class Liveness(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"  # exists but identity unreadable: counts as alive, never signalled
