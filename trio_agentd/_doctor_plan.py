"""What ``ps`` and ``doctor`` say about each supervisor, and what ``doctor --fix`` does. Pure.

Theory of operation
-------------------
The shell (:mod:`._doctor`) observes each socket by local reads and a hello probe only — a
wedged daemon cannot serve commands, so we never send any — and hands an :class:`Observation`
to :func:`classify`. Guards against false positives live here, in one place:

* a supervisor that is still starting writes its record before it listens, so "no hello yet"
  with a live ``starting`` record is ``starting``, not a problem;
* a supervisor that is stopping fails the final pid + start-id liveness re-check and is not
  reported as wedged;
* a supervisor replaced by a newer one answers hello with the newer generation, which has its
  own record: ``current``.

:func:`plan_repair` turns a status into the ordered steps of a repair, or a refusal; the shell
executes them one by one and stops at the first that fails, so a failed kill never leads to an
unlinked socket or a second supervisor.
"""

from __future__ import annotations

from ._ownership import Cause
from ._plain import Frozen, StrEnum  # StrEnum: enum's to type checkers (ps path)


class Status(StrEnum):
    CURRENT = "current"
    STARTING = "starting"
    STOPPING = "stopping"
    STALE = "stale"
    OWNERSHIP_LOST = "ownership-lost"
    UNREACHABLE = "unreachable"
    ORPHAN_FILE = "orphan-file"
    FOREIGN = "foreign"  # its dir or its listening process is not ours: never touched


PROBLEMS = frozenset(
    {Status.OWNERSHIP_LOST, Status.UNREACHABLE, Status.ORPHAN_FILE, Status.FOREIGN}
)


class Hello(Frozen):
    __slots__ = ("app_version", "generation", "pid", "protocol", "start_id")
    generation: str | None
    pid: int
    start_id: str | None
    protocol: int
    app_version: str

    def __init__(
        self, *, generation: str | None, pid: int, start_id: str | None, protocol: int,
        app_version: str,
    ) -> None:
        s = object.__setattr__
        s(self, "generation", generation)
        s(self, "pid", pid)
        s(self, "start_id", start_id)
        s(self, "protocol", protocol)
        s(self, "app_version", app_version)


class Record(Frozen):
    """The registry record for a generation, as read from disk."""

    __slots__ = ("alive", "created_at", "generation", "phase", "pid", "socket", "start_id")
    generation: str
    pid: int
    start_id: str | None
    socket: str
    phase: str
    alive: bool  # its pid + start id name a running process
    created_at: str

    def __init__(
        self, *, generation: str, pid: int, start_id: str | None, socket: str, phase: str,
        alive: bool, created_at: str = "",
    ) -> None:
        s = object.__setattr__
        s(self, "generation", generation)
        s(self, "pid", pid)
        s(self, "start_id", start_id)
        s(self, "socket", socket)
        s(self, "phase", phase)
        s(self, "alive", alive)
        s(self, "created_at", created_at)


class Observation(Frozen):
    __slots__ = (
        "accepts",
        "hello",
        "hello_pid_alive",
        "hello_record",
        "hello_record_corrupt",
        "is_default",
        "revoked",
        "sessions",
        "socket",
        "socket_file",
        "socket_records",
        "tracked_workers",
        "untrusted",
    )
    socket: str
    is_default: bool
    socket_file: bool  # something exists at the path
    accepts: bool  # connect() succeeded
    hello: Hello | None
    # the record named by the hello's generation (None: missing), its tombstone
    hello_record: Record | None
    hello_record_corrupt: bool
    revoked: bool
    hello_pid_alive: bool  # final liveness re-check of the hello's pid + start id
    # live records that claim this socket (any generation), from the registry scan
    socket_records: tuple[Record, ...]
    # live workers whose descriptors name this socket (counted only when no hello came:
    # only then does it change the status)
    tracked_workers: int
    sessions: int  # descriptors for this socket
    # why the socket's dir or its peer is not ours (then nothing was sent to it)
    untrusted: str | None

    def __init__(
        self, *, socket: str, is_default: bool = False, socket_file: bool, accepts: bool,
        hello: Hello | None = None, hello_record: Record | None = None,
        hello_record_corrupt: bool = False, revoked: bool = False,
        hello_pid_alive: bool = True, socket_records: tuple[Record, ...] = (),
        tracked_workers: int = 0, sessions: int = 0, untrusted: str | None = None,
    ) -> None:
        s = object.__setattr__
        s(self, "socket", socket)
        s(self, "is_default", is_default)
        s(self, "socket_file", socket_file)
        s(self, "accepts", accepts)
        s(self, "hello", hello)
        s(self, "hello_record", hello_record)
        s(self, "hello_record_corrupt", hello_record_corrupt)
        s(self, "revoked", revoked)
        s(self, "hello_pid_alive", hello_pid_alive)
        s(self, "socket_records", socket_records)
        s(self, "tracked_workers", tracked_workers)
        s(self, "sessions", sessions)
        s(self, "untrusted", untrusted)


class Verdict(Frozen):
    __slots__ = ("cause", "generation", "pid", "start_id", "status")
    status: Status
    cause: str | None
    generation: str | None  # the supervisor generation the verdict is about
    pid: int | None
    start_id: str | None

    def __init__(
        self, *, status: Status, cause: str | None = None, generation: str | None = None,
        pid: int | None = None, start_id: str | None = None,
    ) -> None:
        s = object.__setattr__
        s(self, "status", status)
        s(self, "cause", cause)
        s(self, "generation", generation)
        s(self, "pid", pid)
        s(self, "start_id", start_id)

    @property
    def problem(self) -> bool:
        return self.status in PROBLEMS


def classify(obs: Observation, *, protocol: int, app_version: str) -> Verdict | None:
    """The status of one socket, or ``None`` when nothing of ours is there."""
    live = [r for r in obs.socket_records if r.alive]
    if obs.untrusted is not None:
        return Verdict(status=Status.FOREIGN, cause=obs.untrusted)
    if obs.hello is not None:
        h = obs.hello
        if h.protocol != protocol or h.app_version != app_version or h.generation is None:
            return Verdict(status=Status.STALE, cause=f"protocol {h.protocol}, app {h.app_version}",
                           generation=h.generation, pid=h.pid, start_id=h.start_id)
        if not obs.hello_pid_alive:
            # it answered, then exited: a supervisor stopping, not a wedged one
            return None
        rec = obs.hello_record
        cause: Cause | None = None
        if obs.revoked:
            cause = Cause.REVOKED
        elif rec is None or obs.hello_record_corrupt:
            cause = Cause.MISSING
        elif (rec.pid, rec.start_id, rec.socket) != (h.pid, h.start_id, obs.socket) or any(
            r.generation != h.generation for r in live
        ):
            cause = Cause.REPLACED
        if cause is not None:
            return Verdict(status=Status.OWNERSHIP_LOST, cause=str(cause),
                           generation=h.generation, pid=h.pid, start_id=h.start_id)
        return Verdict(status=Status.CURRENT, generation=h.generation, pid=h.pid,
                       start_id=h.start_id)
    # no hello
    owner = live[0] if live else None
    if owner is not None and owner.phase in ("starting", "stopping"):
        # its record is written before it listens and says "stopping" before it stops
        # listening: no hello is expected in either phase
        status = Status.STARTING if owner.phase == "starting" else Status.STOPPING
        return Verdict(status=status, generation=owner.generation, pid=owner.pid,
                       start_id=owner.start_id)
    if obs.accepts or owner is not None or obs.tracked_workers:
        why = "accepts connections but sends no hello" if obs.accepts else (
            "its supervisor is alive but does not listen" if owner is not None
            else "live workers but no supervisor")
        return Verdict(
            status=Status.UNREACHABLE, cause=why,
            generation=owner.generation if owner else None,
            pid=owner.pid if owner else None, start_id=owner.start_id if owner else None,
        )
    if obs.socket_file:
        return Verdict(status=Status.ORPHAN_FILE, cause="nobody listens on it")
    return None


# --- when the process scan is worth its cost ---------------------------------------------------


def scan_reason(
    statuses: list[Status], listeners: list[tuple[str, bool, str]] | None,
) -> str | None:
    """Why ``ps``/``doctor`` should also scan this user's processes for supervisors (the last
    line of discovery, for one that lost the files that name it), or ``None`` when what the
    files said is consistent, so the scan would find nothing new.

    ``statuses``: the verdicts of every socket the files named. ``listeners``: the listening
    Unix sockets of this network namespace that look like a supervisor's (a ``*.sock`` that is
    not a worker's ``w-*.sock``), each as ``(path, named, file)``: ``named`` if the files named
    it; ``file`` is ``"ours"`` (a socket file of this user is at the path), ``"foreign"`` (a
    socket file of another user) or ``"gone"`` (none, or not a socket: it was deleted).
    ``None``: they could not be listed.
    """
    if not statuses:
        return "no supervisor found by its files"
    if any(s in PROBLEMS for s in statuses):
        return "a supervisor is not healthy"
    if listeners is None:
        return "the listening sockets cannot be listed"
    seen: set[str] = set()
    for path, named, file in listeners:
        if file == "gone":
            return f"a socket listens at {path}, whose file is gone"
        if path in seen:
            return f"more than one socket listens at {path}"
        seen.add(path)
        if file == "ours" and not named:
            return f"a socket of ours listens at {path}, which no file names"
    return None


REMEDY_OWNERSHIP_LOST = (
    '! {socket}: supervisor lost its ownership record — run "trio-agentd doctor --fix" to'
    " restart it (sessions are preserved)"
)


def remedy(socket: str, verdict: Verdict) -> str | None:
    match verdict.status:
        case Status.OWNERSHIP_LOST:
            return REMEDY_OWNERSHIP_LOST.format(socket=socket)
        case Status.UNREACHABLE:
            return (f'! {socket}: supervisor does not answer ({verdict.cause}) — run'
                    ' "trio-agentd doctor --fix" to replace it (sessions are preserved)')
        case Status.ORPHAN_FILE:
            return f'! {socket}: stale socket file — "trio-agentd doctor --fix" removes it'
        case Status.STALE:
            return (f"! {socket}: supervisor runs another version ({verdict.cause}) — run"
                    " `trio-agentd restart`")
        case Status.FOREIGN:
            return (f"! {socket}: not yours ({verdict.cause}) — nothing was sent to it and"
                    " doctor never touches it; remove it if you can, or use another --socket")
        case Status.CURRENT | Status.STARTING | Status.STOPPING:
            return None


# --- the repair plan --------------------------------------------------------------------------


class Step(StrEnum):
    PROVE_HOME = "prove-home"  # generations/<g>/ exists under this home
    TAKE_ADMISSION = "take-admission"
    REPROBE_SAME = "reprobe-same"  # the same generation is still wedged (never kill a successor)
    REVOKE = "revoke"  # tombstone + record moved aside
    KILL = "kill"  # SIGKILL by pid + start id, exit confirmed
    REMOVE_SOCKET = "remove-socket"
    RELAUNCH = "relaunch"  # same socket, standard launch path
    WAIT_HELLO = "wait-hello"  # a new generation answers
    RELEASE_ADMISSION = "release-admission"
    REPROBE_DEAD = "reprobe-dead"  # orphan file: still nobody listening


class Repair(Frozen):
    __slots__ = ("declined", "socket", "steps", "verdict")
    socket: str
    verdict: Verdict
    steps: tuple[Step, ...]
    declined: str | None  # why no repair is attempted

    def __init__(
        self, *, socket: str, verdict: Verdict, steps: tuple[Step, ...] = (),
        declined: str | None = None,
    ) -> None:
        s = object.__setattr__
        s(self, "socket", socket)
        s(self, "verdict", verdict)
        s(self, "steps", steps)
        s(self, "declined", declined)

    def describe(self) -> str:
        if self.declined:
            return f"{self.socket}: not repaired — {self.declined}"
        return f"{self.socket}: " + " → ".join(self.steps)


WEDGED_STEPS = (
    Step.PROVE_HOME,
    Step.TAKE_ADMISSION,
    Step.REPROBE_SAME,
    Step.REVOKE,
    Step.KILL,
    Step.REMOVE_SOCKET,
    Step.RELAUNCH,
    Step.WAIT_HELLO,
    Step.RELEASE_ADMISSION,
)


def plan_repair(socket: str, verdict: Verdict, *, home_proven: bool, home: str) -> Repair | None:
    """The repair for one problem (``None`` for a healthy daemon: never touched)."""
    match verdict.status:
        case Status.ORPHAN_FILE:
            return Repair(socket=socket, verdict=verdict,
                          steps=(Step.REPROBE_DEAD, Step.REMOVE_SOCKET))
        case Status.OWNERSHIP_LOST | Status.UNREACHABLE:
            if verdict.pid is None or verdict.generation is None:
                return Repair(socket=socket, verdict=verdict, declined=(
                    "no supervisor record names it, so there is no identity to kill safely"
                    " — stop its process by hand"))
            if verdict.start_id is None:
                return Repair(socket=socket, verdict=verdict, declined=(
                    f"the identity of pid {verdict.pid} cannot be read, so it is never signalled"))
            if not home_proven:
                return Repair(socket=socket, verdict=verdict, declined=(
                    f"generation {verdict.generation} does not belong to home {home}"
                    " (no generations/<g>/ there) — run doctor with the --home it was started"
                    " with"))
            return Repair(socket=socket, verdict=verdict, steps=WEDGED_STEPS)
        case Status.FOREIGN:
            return Repair(socket=socket, verdict=verdict, declined=(
                f"it is not yours ({verdict.cause}): trio-agentd never signals, removes or"
                " talks to what another user may control"))
        case Status.CURRENT | Status.STARTING | Status.STOPPING | Status.STALE:
            return None
