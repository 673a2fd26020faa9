"""The client's timing defaults, importable without the dataclasses module.

``trio_agentd.timing.Timing`` takes its client defaults from here, so there is one source of
truth; the CLI's blocking client reads them from here so its warm path stays lean.
"""

STARTUP_TIMEOUT = 30.0
PROBE_INTERVAL = 0.025
HELLO_TIMEOUT = 1.5
CONNECT_TIMEOUT = 0.3
# liveness of a link to a worker (the supervisor's, and a client's direct route while a prompt
# is outstanding): after this long with nothing from the worker, ping it ...
LINK_PING_INTERVAL = 2.0
# ... and if nothing at all arrives this long after the ping, the worker is unresponsive
LINK_PING_TIMEOUT = 3.0
# a supervisor process that is alive but has not said hello yet (busy, swapped out, paused) is
# waited for this long in all, with a progress line every PATIENCE_TICK, before a client calls
# it wedged and advises a repair
PATIENCE = 15.0
PATIENCE_TICK = 3.0
# doctor --fix repairs only what stays unresponsive across this many seconds of re-probing
REPROBE_WINDOW = 3.0
# a client of a newer version that meets an older supervisor hands over to a supervisor of its
# own installation once no session is busy: it waits at most this long for busy sessions
HANDOVER_WAIT = 15.0
# closing a stream (a client's connection, a link to a worker, a subprocess's pipes) in a
# shielded scope gives up on a peer that does not read after this long
CLOSE_TIMEOUT = 1.0
# ``trio-agentd shutdown`` (and ``shutdown --all``) waits this long for each supervisor it asked
# to exit, polling every EXIT_POLL; longer than a supervisor's own shutdown bound at the default
# timing (``timing.shutdown_bound``: drain, stop the workers, release its record)
SHUTDOWN_EXIT_WAIT = 25.0
EXIT_POLL = 0.02
# ``trio-agentd restart`` waits this long for the new supervisor's hello, probing every
# PROBE_INTERVAL
RESTART_WAIT = 30.0
# a command lost with its connection is resent (same id) for this long in all, after delays
# that start at RESEND_DELAY and double up to RESEND_DELAY_MAX; ``logs -f`` reattaches on the
# same schedule (its session poll starts at FOLLOW_RETRY_DELAY)
RETRY_FOR = 60.0
RESEND_DELAY = 0.025
RESEND_DELAY_MAX = 1.0
FOLLOW_RETRY_DELAY = 0.05
# after Ctrl-C on a prompt, the blocking client keeps trying to reach the worker with the
# cancel this long (a worker slow to say hello under load, or one respawning), this long
# between tries
CANCEL_REACH = 10.0
CANCEL_RETRY_DELAY = 0.1
# a route grant this close to its expiry is renewed (async client) or not used from the route
# cache (blocking client) instead
GRANT_MARGIN = 5.0
# the autostart helper process is given startup_timeout and this long before it is abandoned
AUTOSTART_HELPER_MARGIN = 5.0
# an old supervisor asked to release its socket for a handover has this long to exit; while
# busy sessions hold the handover up, they are looked at again every HANDOVER_POLL
HANDOVER_EXIT_GRACE = 20.0
HANDOVER_POLL = 0.1


class ClientTiming:
    """The client constants, duck-typed like :class:`trio_agentd.timing.Timing`."""

    startup_timeout = STARTUP_TIMEOUT
    probe_interval = PROBE_INTERVAL
    hello_timeout = HELLO_TIMEOUT
    connect_timeout = CONNECT_TIMEOUT
    link_ping_interval = LINK_PING_INTERVAL
    link_ping_timeout = LINK_PING_TIMEOUT
    patience = PATIENCE
    patience_tick = PATIENCE_TICK
    reprobe_window = REPROBE_WINDOW
    handover_wait = HANDOVER_WAIT


CLIENT = ClientTiming()

# size-bounded logs, as supervisord's 50 MB x 10: daemon.log, each worker.log and each
# transcript.jsonl move to NAME.1 (NAME.1 to NAME.2, ...) once past LOG_MAX_BYTES; the oldest
# beyond LOG_BACKUPS is deleted. Environment: TRIO_AGENTD_LOG_MAX_BYTES, TRIO_AGENTD_LOG_BACKUPS
# (whole numbers; LOG_MAX_BYTES 0 turns rotation off).
LOG_MAX_BYTES = 50 * 1024 * 1024
ENV_LOG_MAX_BYTES = "TRIO_AGENTD_LOG_MAX_BYTES"
ENV_LOG_BACKUPS = "TRIO_AGENTD_LOG_BACKUPS"
LOG_BACKUPS = 10
# a session keeps its turns' spilled output files (sessions/<s>/output/) up to this many bytes
# in all: past it, the oldest turns' files go (the newest turn's stay whatever their size).
# Environment: TRIO_AGENTD_OUTPUT_MAX_BYTES (a whole number; 0 keeps every file).
OUTPUT_MAX_BYTES = 2 * 1024 * 1024 * 1024
ENV_OUTPUT_MAX_BYTES = "TRIO_AGENTD_OUTPUT_MAX_BYTES"
# a `logs -f` follower may be this many bytes of live output behind before the worker drops it
# (the turn never waits for a follower)
FOLLOW_MAX_BYTES = 4 * 1024 * 1024

# --- doctor's and shutdown's own waits (trio-free, blocking) ----------------------------------
# after the SIGKILL of a wedged supervisor, how often doctor --fix looks whether it is gone
KILL_POLL_INTERVAL = 0.005
# how long doctor --fix waits for the shutdown admission lock (another shutdown or doctor
# holds it), and how often it tries again meanwhile
ADMISSION_WAIT = 5.0
ADMISSION_POLL_INTERVAL = 0.02
# after the SIGTERM of an orphan worker, how often shutdown looks whether it is gone
ORPHAN_EXIT_POLL_INTERVAL = 0.01
