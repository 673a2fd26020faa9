"""Every timing constant, in one frozen dataclass that tests replace.

Code never reads a bare number for a timeout or a period: it takes a :class:`Timing` (usually
:data:`DEFAULT_TIMING`) so a MockClock test can assert the exact virtual time of every step, or
a fixed constant named below (the clients' defaults are in ``_defaults``). Bounds that contain
other bounds are computed from them (``shutdown_shield`` and the rest), so they nest whatever
the overrides; ``tests/unit/test_timing_bounds.py`` checks both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import _defaults
from ._errors import AgentdError, ErrorCode


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """The schedule of the supervisor, its workers and its clients, in seconds."""

    refence_interval: float = 0.25
    # a worker that watches the registry (dnotify or inotify) re-checks on every change, and at
    # least this often in case a change was not reported
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
    # a live supervisor that has not said hello yet is waited for (progress every tick) before
    # it is called wedged; doctor --fix re-probes this long before it repairs anything
    patience: float = _defaults.PATIENCE
    patience_tick: float = _defaults.PATIENCE_TICK
    reprobe_window: float = _defaults.REPROBE_WINDOW
    # upgrades: a client of a newer version waits this long for busy sessions before it hands
    # the socket over to a supervisor of its own installation (then it says what to run) ...
    handover_wait: float = _defaults.HANDOVER_WAIT
    # ... and a supervisor replaces an adopted worker of another version once its session has
    # been idle this long (a worker with a turn running or queued declines, and is asked again)
    upgrade_idle: float = 10.0
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
    # how long ``sessions`` waits for the workers' own counts before it answers with its own
    status_timeout: float = 0.5
    # a descriptor, owner-record or transcript write that failed (ENOSPC, EDQUOT, EFBIG, EIO)
    # is logged and tried again after each of these delays, then given up on (logged again)
    storage_retry_delays: tuple[float, ...] = field(default=(0.05, 0.25, 1.0))
    # liveness of every link to a worker (the supervisor's, and a client's direct route while
    # a prompt is outstanding): while a command waits on the worker, a side whose reader has
    # waited ``link_ping_interval`` with nothing arriving from the worker (counted from the
    # command's start at the earliest) sends it a ``ping``; if nothing at all arrives within
    # ``link_ping_timeout`` of that ping, the worker is unresponsive (stopped, or its event loop
    # blocked). The supervisor then recovers it as a worker that does not answer (reconnects,
    # deferred rounds, stop and respawn); a prompt waiting on it fails ``worker_unresponsive``
    # at most ``link_ping_interval + link_ping_timeout`` after the later of its start and the
    # worker's last sign of life. A turn that is merely silent is not hung: its worker answers
    # the pings.
    link_ping_interval: float = _defaults.LINK_PING_INTERVAL
    link_ping_timeout: float = _defaults.LINK_PING_TIMEOUT
    # the supervisor's link to an idle worker (no command outstanding on it) is pinged after
    # this long with nothing from the worker: an idle hung worker is found (``sessions`` says
    # ``recovering``) at most ``link_idle_ping_interval + link_ping_timeout`` after its last
    # sign of life, and 100 idle sessions cost 100 pings per 30 s, not per 2 s
    link_idle_ping_interval: float = 30.0
    # a worker tells its supervisor of the turns clients run on direct routes (turn started /
    # done) at most once per this long: the first notice after a quiet spell goes at once,
    # those that come meanwhile coalesce into the latest, so back-to-back prompts cost the
    # supervisor a notice per interval, not two per prompt (its view lags by at most this)
    notice_interval: float = 0.05
    # a supervisor's worker fork template that died is started again after this long (doubled
    # while it keeps dying before it is ready, to 60 s); workers are exec'd meanwhile
    fork_template_restart_delay: float = 0.5


# The least value an override may set, per field (seconds). Anything run in a loop needs a
# period that cannot make it spin: 10 ms. ``lock_poll`` is a back-off start (default 5 ms).
# Waits that may be skipped (a grace period, a delay before a retry) may be 0. A field not
# listed has the default floor. NaN and infinities are refused everywhere.
DEFAULT_FLOOR = 0.01
FLOORS: dict[str, float] = {
    "lock_poll": 0.001,
    "stop_grace": 0.0,  # 0: no grace, TERM then KILL at once
    "kill_confirm_timeout": 0.0,
    "drop_notice_timeout": 0.0,  # 0: drop without telling the supervisor
    "worker_retry_delays": 0.0,  # each element; the list is bounded
    "storage_retry_delays": 0.0,  # each element; the list is bounded
    "max_deferred_recovery_rounds": 0,
    "restart_intensity": 0,
}
# fields where 0 means "off" and is allowed below the floor
ZERO_MEANS_OFF = frozenset({"idle_eviction"})


class TimingError(AgentdError, ValueError):
    """A bad ``TRIO_AGENTD_TIMING`` (an ``AgentdError`` ``config``; also a ``ValueError``)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CONFIG, message)


def floor_of(name: str) -> float:
    return FLOORS.get(name, DEFAULT_FLOOR)


DEFAULT_TIMING = Timing()


def timing_from_env(base: Timing = DEFAULT_TIMING) -> Timing:
    """``base`` with overrides from ``TRIO_AGENTD_TIMING`` (a JSON object of field: seconds).

    For operators and end-to-end tests, e.g. ``TRIO_AGENTD_TIMING='{"self_check_interval": 60}'``.
    Unknown fields, NaN, infinities and values below a field's floor (:data:`FLOORS`) raise
    :class:`TimingError` (``config``, a ``ValueError``) naming the field and the floor.
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
        raise TimingError(f"TRIO_AGENTD_TIMING is not JSON: {exc}") from None
    if not isinstance(overrides, dict):
        raise TimingError("TRIO_AGENTD_TIMING must be a JSON object")
    names = {f.name for f in dataclasses.fields(Timing)}
    unknown = set(overrides) - names
    if unknown:
        raise TimingError(f"TRIO_AGENTD_TIMING has unknown fields: {sorted(unknown)}")
    checked = {name: check_override(name, value, f"TRIO_AGENTD_TIMING: {name}", base)
               for name, value in overrides.items()}
    return dataclasses.replace(base, **checked)  # type: ignore[arg-type]


def check_override(name: str, value: object, label: str, base: Timing = DEFAULT_TIMING) -> object:
    """``value`` as field ``name`` of a :class:`Timing` takes it (a tuple for a list of delays,
    a float for seconds, an int for a count), checked against the field's floor.

    Pure; shared by ``TRIO_AGENTD_TIMING`` and the config file's ``[timing]`` table.

    Raises:
        TimingError: ``label`` (where the value came from), what the field must be, and the
            value as given. NaN, infinities and booleans are refused.
    """
    import json

    default = getattr(base, name)
    floor = floor_of(name)
    shown = json.dumps(value) if isinstance(value, bool | int | float | str | list) else repr(value)
    if isinstance(default, tuple):
        if not isinstance(value, list) or not all(_seconds_ok(v, floor) for v in value):
            raise TimingError(
                f"{label} must be a list of finite seconds, each >= {floor:g} (got {shown})"
            )
        return tuple(float(v) for v in value)
    if type(default) is int:
        if not isinstance(value, int) or isinstance(value, bool) or value < floor:
            raise TimingError(f"{label} must be a whole number >= {floor:g} (got {shown})")
        return value
    off = name in ZERO_MEANS_OFF and _is_number(value) and value == 0
    if not off and not _seconds_ok(value, floor):
        also = " (or 0: off)" if name in ZERO_MEANS_OFF else ""
        raise TimingError(
            f"{label} must be a finite number of seconds >= {floor:g}{also} (got {shown})"
        )
    assert isinstance(value, int | float)
    return float(value)


def _seconds_ok(value: object, floor: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and (
        math.isfinite(value) and value >= floor
    )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- bounds computed from a Timing (they nest: see tests/unit/test_timing_bounds.py) --------

def worker_stop_bound(t: Timing) -> float:
    """The longest one worker's stop takes (``SessionHandle._stop``): ``stop_grace`` for the
    ``stop`` command, closing its link, TERM then ``stop_grace``, KILL then
    ``kill_confirm_timeout``."""
    return 2 * t.stop_grace + LINK_CLOSE_TIMEOUT + t.kill_confirm_timeout


def kill_answer_bound(t: Timing) -> float:
    """How long ``kill`` waits for the victim's stop before it answers anyway: the stop's own
    bound and ``STOP_MARGIN`` (the forgetting after it)."""
    return worker_stop_bound(t) + STOP_MARGIN


def workers_stop_bound(t: Timing) -> float:
    """How long a supervisor's shutdown waits for all its workers to stop: they stop as one
    batch (one grace for them all), so one worker's bound and ``STOP_MARGIN``."""
    return worker_stop_bound(t) + STOP_MARGIN


def shutdown_shield(t: Timing) -> float:
    """The shielded bound of a supervisor's stop: the workers' stop, then the descriptors made
    durable and the phase written, in ``SHUTDOWN_MARGIN``."""
    return workers_stop_bound(t) + SHUTDOWN_MARGIN


def shutdown_bound(t: Timing) -> float:
    """The longest a supervisor takes from a ``shutdown`` to its exit: commands in flight drain
    for ``stop_grace``, then its shielded stop, then its ownership record is released."""
    return t.stop_grace + shutdown_shield(t) + OWNERSHIP_RELEASE_TIMEOUT


# --- fixed bounds of the daemon's own steps (not part of ``Timing``) --------------------------

# closing a stream or link (a worker's, a client's, a subprocess's pipes) in a shielded scope,
# and sending the one line that refuses a connection (cap reached, frame too large): a peer that
# does not read is given up on after this long
LINK_CLOSE_TIMEOUT = _defaults.CLOSE_TIMEOUT
# beyond a worker's own stop bound: ``kill`` forgetting its victim, a shutdown's batch of stops
STOP_MARGIN = 1.0
# beyond the workers' stop inside a supervisor's shielded shutdown: descriptors made durable,
# the generation's directory removed
SHUTDOWN_MARGIN = 2.0
# a clean shutdown's removal of its ownership record (under the registry lock)
OWNERSHIP_RELEASE_TIMEOUT = 3.0
# the registry guard is held this long at most while a supervisor gives its claim up
REGISTRY_RELEASE_TIMEOUT = 2.0
# a supervisor run in-process (``open_supervisor``) is waited for this long at exit beyond
# its own shutdown bound
IN_PROCESS_EXIT_MARGIN = 1.0
# the least a loop that wakes at a computed time sleeps (never spins on a time in the past),
# and the poll of a process's exit where there is no pidfd to wait on
MIN_WAKE = 0.01
# a lock held by another process is polled from ``lock_poll``, doubling to this at most
LOCK_POLL_MAX = 0.05


# --- resource exhaustion and caps ------------------------------------------------------------
# Not part of ``Timing`` (no TRIO_AGENTD_TIMING override): fixed, documented defaults.

# accept() failing for lack of resources (EMFILE, ENFILE, ENOMEM, ENOBUFS) is tried again after
# this pause, as trio.serve_listeners does (its SLEEP_TIME)
ACCEPT_BACKOFF = 0.1
# a repeated cause (the same error again and again) is logged at most once per this interval,
# with a count of the lines suppressed since the last one
LOG_RATE_INTERVAL = 10.0
# a service task (accept loop, self-check, idle sweep, signals) that raised something
# unexpected is logged and started again after this pause
SERVICE_RESTART_DELAY = 0.5
# the most client connections a supervisor serves at once: one more is answered with one
# ``resource_exhausted`` line and closed
MAX_CLIENT_CONNECTIONS = 1024
# the most sessions a supervisor runs: creating one more fails with ``resource_exhausted``
MAX_SESSIONS = 1000
# the most worker starts a supervisor runs at once (fork, start gate, ready, connect): a launch
# of many sessions goes this many at a time, so the first answer early and the machine is
# not asked to start every worker at the same moment
MAX_PARALLEL_SPAWNS = 16
# spare workers: the fork template keeps this many at most forked and parked ahead of need,
# one while nothing starts, as many as the worker starts of the last SPARE_DEMAND_WINDOW
# seconds otherwise; a respawn or a new session's first start then takes one (no fork)
MAX_SPARE_WORKERS = 4
SPARE_DEMAND_WINDOW = 10.0
# a spare that could not be forked (no descriptors, no processes) is tried again after this
SPARE_RETRY_DELAY = 1.0
# the fork template may take this long to start (a Python start and the imports), and this
# long to answer a request (silent longer: wedged, killed); its restart delay doubles to
# FORK_TEMPLATE_MAX_RESTART_DELAY while it keeps dying before it is ready
FORK_TEMPLATE_READY_TIMEOUT = 30.0
FORK_TEMPLATE_REQUEST_TIMEOUT = 5.0
FORK_TEMPLATE_MAX_RESTART_DELAY = 60.0
# a rehearsal run (see _rehearsal) that takes longer than this ends the template's rehearsal:
# a request may wait for one run, and a run takes about 3 ms
FORK_TEMPLATE_REHEARSAL_RUN_MAX = 0.25
# ... and a run starts only once no request has come for this long: a burst of starts (the
# first prompt's worker and the spares after it) is served first, and a cold start's worker
# does not share the processor with the rehearsal (measured: +8 ms at 0, +2 ms at 20 ms)
FORK_TEMPLATE_REHEARSAL_QUIET = 0.02
# the template's exit is waited for this long when its supervisor is done with it; with no
# pidfd to spare (EMFILE) its exit is polled this often
FORK_TEMPLATE_EXIT_WAIT = 2.0
FORK_TEMPLATE_EXIT_POLL = 0.05

# --- the real-daemon test fixture (``trio_agentd.testing.DaemonEnv``) --------------------------
# Not part of ``Timing``: limits of a test's own waits on real processes, never the daemon's.

# one CLI command a test runs (``DaemonEnv.run``) is killed after this long
TEST_CLI_TIMEOUT = 60.0
# at teardown, ``trio-agentd shutdown`` (which itself waits up to 20 s for the supervisor to
# exit) is given this long before the processes left are killed
TEST_SHUTDOWN_TIMEOUT = 30.0
# after SIGKILL, how long teardown waits for each round of the test's processes to be gone
TEST_KILL_CONFIRM_TIMEOUT = 5.0
# ``open_fake_supervisor`` (and its fixture) fail a test still running after this much trio
# time: a supervisor in the test process takes SIGALRM, so pytest-timeout cannot end it
TEST_VIRTUAL_TIME_LIMIT = 24 * 3600.0

# --- running under a service manager (systemd) ------------------------------------------------

# the longest one sd_notify datagram may take to send (a full notify socket): then it is given
# up on, logged once, and the supervisor goes on
SD_NOTIFY_TIMEOUT = 1.0
# ``WatchdogSec=`` of the unit ``trio-agentd service install`` writes: the supervisor pings
# every half of it, from its self-check loop (every ``self_check_interval``, 0.25 s), so a
# supervisor whose loop is wedged, or whose ownership check or socket stays broken, is
# restarted by systemd this long after its last healthy check
SERVICE_WATCHDOG_SEC = 30

# --- the worker's own waits -------------------------------------------------------------------

# an agent's chunk generator is given this long to close (its processes end) when a turn ends
# early; the close is shielded, so a cancelled turn still waits for it, at most this long
AGENT_CLOSE_TIMEOUT = 10.0
