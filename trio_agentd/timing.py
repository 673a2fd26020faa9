"""Every timing constant of SPEC §6, in one frozen dataclass that tests replace.

Code never reads a bare number for a timeout or a period: it takes a :class:`Timing` (usually
:data:`DEFAULT_TIMING`) so a MockClock test can assert the exact virtual time of every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _defaults


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """The schedule of the supervisor, its workers and its clients, in seconds."""

    refence_interval: float = 0.25
    # a worker that watches the registry (inotify) re-checks on every change, and at least
    # this often in case a change was not reported
    refence_fallback: float = 5.0
    self_check_interval: float = 0.25
    worker_connect_timeout: float = 30.0
    adopt_connect_timeout: float = 2.0
    worker_retry_delays: tuple[float, ...] = field(default=(0.25, 1.0, 5.0))
    deferred_recovery_recheck: float = 5.0
    max_deferred_recovery_rounds: int = 10
    stop_grace: float = 5.0
    kill_confirm_timeout: float = 2.0
    restart_intensity: int = 5
    restart_window: float = 60.0
    idle_eviction: float = 90 * 60.0
    idle_sweep_period: float = 60.0
    # client side (defaults live in _defaults so the CLI's warm path need not import this)
    startup_timeout: float = _defaults.STARTUP_TIMEOUT
    probe_interval: float = _defaults.PROBE_INTERVAL
    hello_timeout: float = _defaults.HELLO_TIMEOUT
    connect_timeout: float = _defaults.CONNECT_TIMEOUT
    # worker auth: how long a freshly accepted worker connection may take to authenticate
    auth_timeout: float = 2.0
    # how long a supervisor waits for a held shutdown admission before giving up on startup
    admission_wait: float = 30.0
    admission_poll: float = 0.05
    lock_poll: float = 0.005
    # how long a worker tries to tell a supervisor it is being dropped before closing anyway
    drop_notice_timeout: float = 0.2
    # how long a route grant (a client's permission to talk to a worker directly) is good for;
    # it is also bound to the supervisor's generation, so a replaced supervisor's grants die
    # with it whatever their expiry
    grant_ttl: float = 600.0


DEFAULT_TIMING = Timing()


def timing_from_env(base: Timing = DEFAULT_TIMING) -> Timing:
    """``base`` with overrides from ``TRIO_AGENTD_TIMING`` (a JSON object of field: seconds).

    For operators and end-to-end tests, e.g. ``TRIO_AGENTD_TIMING='{"self_check_interval": 60}'``.
    Unknown fields or bad values raise ``ValueError`` naming them.
    """
    import os

    raw = os.environ.get("TRIO_AGENTD_TIMING")
    if not raw:
        return base
    import dataclasses
    import json

    try:
        overrides = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"TRIO_AGENTD_TIMING is not JSON: {exc}") from None
    if not isinstance(overrides, dict):
        raise ValueError("TRIO_AGENTD_TIMING must be a JSON object")
    names = {f.name for f in dataclasses.fields(Timing)}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"TRIO_AGENTD_TIMING has unknown fields: {sorted(unknown)}")
    checked: dict[str, object] = {}
    for name, value in overrides.items():
        default = getattr(base, name)
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(_is_number(v) for v in value):
                raise ValueError(f"TRIO_AGENTD_TIMING: {name} must be a list of seconds")
            checked[name] = tuple(float(v) for v in value)
        elif type(default) is int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TRIO_AGENTD_TIMING: {name} must be a whole number >= 0")
            checked[name] = value
        else:
            if not _is_number(value) or value < 0:
                raise ValueError(f"TRIO_AGENTD_TIMING: {name} must be a number of seconds >= 0")
            checked[name] = float(value)
    return dataclasses.replace(base, **checked)  # type: ignore[arg-type]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
