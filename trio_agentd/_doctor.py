"""``ps``'s survey: every supervisor found, probed and classified (the I/O shell's entry).

Everything the doctor does is synchronous and trio-free (plain sockets, flock, signals), so
``ps`` stays cheap. Decisions are :mod:`._doctor_plan`'s; where a supervisor may be is
:mod:`._doctor_discover`, what one socket shows is :mod:`._doctor_probe`, executing a repair
is :mod:`._doctor_repair`.
"""

from __future__ import annotations

import os
import time

from ._defaults import CLIENT, ClientTiming
from ._doctor_discover import (
    discover,
    flock_holders,
    listening_sockets,
    pid_supervisor_socket,
    read_descriptors,
    read_records,
    scanned_sockets,
    socket_lease_holder,
)
from ._doctor_plan import (
    Observation,
    Record,
    Verdict,
    classify,
    remedy,
    scan_reason,
)
from ._doctor_probe import LivenessOnce, observe, probe_hellos
from ._paths import Layout, normalize_socket_path, socket_key
from ._plain import Frozen, replace
from ._procstate import Liveness
from ._version import APP_VERSION, PROTOCOL_VERSION

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from typing import Any

    from .timing import Timing


class Found(Frozen):
    """One supervisor (or its remains) as ps/doctor report it."""

    __slots__ = ("home_proven", "observation", "record", "socket", "verdict")
    socket: str
    verdict: Verdict
    observation: Observation
    record: Record | None
    home_proven: bool

    def __init__(
        self, *, socket: str, verdict: Verdict, observation: Observation, record: Record | None,
        home_proven: bool,
    ) -> None:
        s = object.__setattr__
        s(self, "socket", socket)
        s(self, "verdict", verdict)
        s(self, "observation", observation)
        s(self, "record", record)
        s(self, "home_proven", home_proven)

    def as_json(self, *, now: float | None = None) -> dict[str, Any]:
        """The row of ``ps --json``; its uptime counts to ``now`` (epoch seconds; default: the
        wall clock at the call)."""
        v, rec, hello = self.verdict, self.record, self.observation.hello
        now = time.time() if now is None else now
        return {
            "socket": self.socket,
            "status": str(v.status),
            "cause": v.cause,
            "pid": v.pid,
            "generation": v.generation,
            "app_version": hello.app_version if hello else None,
            "protocol": hello.protocol if hello else None,
            "sessions": self.observation.sessions,
            "uptime_s": _uptime(rec.created_at, now) if rec and rec.created_at else None,
            "is_default": self.observation.is_default,
            "remedy": remedy(self.socket, v),
        }


def _uptime(created_at: str, now: float) -> float | None:
    """Seconds from ``created_at`` (ISO 8601) to ``now`` (epoch seconds). Pure."""
    epoch = utc_epoch(created_at)
    if epoch is None:  # another shape of ISO 8601: datetime parses it (or refuses it)
        try:
            import datetime as _dt

            created = _dt.datetime.fromisoformat(created_at.replace("Z", "+00:00"))
        except ValueError:
            return None
        if created.tzinfo is None:
            return None  # a time without its zone is no instant
        epoch = created.timestamp()
    return round(now - epoch, 1)


def utc_epoch(text: str) -> float | None:
    """Seconds since the epoch of ``YYYY-MM-DDTHH:MM:SS[.fraction](Z|+00:00)`` — the shape
    records carry — without importing ``datetime``; ``None`` for anything else. Pure."""
    if text.endswith("Z"):
        t = text[:-1]
    elif text.endswith("+00:00"):
        t = text[:-6]
    else:
        return None
    frac = t[19:]
    fields = (t[0:4], t[5:7], t[8:10], t[11:13], t[14:16], t[17:19])
    if (len(t) < 19 or (t[4], t[7], t[10], t[13], t[16]) != ("-", "-", "T", ":", ":")
            or not all(f.isascii() and f.isdigit() for f in fields)
            or (frac and (frac[0] != "." or not (frac[1:].isascii() and frac[1:].isdigit())))):
        return None
    y, m, d, hh, mm, ss = (int(f) for f in fields)
    if not (1 <= m <= 12 and 1 <= d <= _month_days(y, m) and hh < 24 and mm < 60 and ss < 60):
        return None
    # days from 1970-01-01 to y-m-d in the proleptic Gregorian calendar
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    days = era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468
    return days * 86400 + hh * 3600 + mm * 60 + ss + (float("0" + frac) if frac else 0.0)


def _month_days(y: int, m: int) -> int:
    if m == 2:
        return 29 if y % 4 == 0 and (y % 100 != 0 or y % 400 == 0) else 28
    return 30 if m in (4, 6, 9, 11) else 31


def survey(
    layout: Layout, timing: Timing | ClientTiming = CLIENT, *, scan: bool | None = None
) -> list[Found]:
    """ps: every supervisor found, classified, ordered by socket.

    First every socket the files name (:func:`discover`); then, last, the command lines of
    this user's running supervisors of this home (:func:`scanned_sockets`), which find one
    that lost the files that name it. The scan reads every process's ``/proc`` entry, so it
    runs only when it may find something (``scan=None``: :func:`._doctor_plan.scan_reason`
    on what the files gave and on the listening sockets — nothing found, anything unhealthy,
    a socket file deleted under its listener, a socket of ours no file names); ``scan=True``
    always, ``scan=False`` never.
    """
    # their liveness is read after the hellos, once per pid (_classified)
    records = read_records(layout.registry_dir, check_alive=False)
    descs = read_descriptors(layout.home_dir)  # read once, not once per socket
    named = discover(layout, records=records, descriptors=descs)
    more: set[str] = set()
    listeners: list[tuple[str, bool, str]] | None = None
    if scan is not True:
        listeners = listening_sockets(set(named))
        if listeners is not None:
            listeners = _resolve_unnamed(listeners, layout.home_dir, more)
    found = _classified(sorted({*named, *more}), layout, timing, records, descs)
    if scan is None:
        scan = scan_reason([f.verdict.status for f in found], listeners) is not None
    if scan:
        scanned = {normalize_socket_path(s) for s in scanned_sockets(layout.home_dir)}
        rest = scanned - set(named) - more
        if rest:
            found += _classified(sorted(rest), layout, timing, records, descs)
            found.sort(key=lambda f: f.socket)
    return found


def _resolve_unnamed(
    listeners: list[tuple[str, bool, str]], home: str | os.PathLike[str], into: set[str]
) -> list[tuple[str, bool, str]]:
    """A socket of ours that no file names is asked who holds its lease (``<socket>.lock``),
    and that one process whether it is a supervisor of this home on that socket (the scan's
    test, for one pid): if so the socket goes ``into`` the sockets to observe; if it is no
    supervisor of this home it is left out. For a socket with no lease file (another
    program's, most often) the supervisors of this home that hold a flock go ``into`` them,
    as the scan would find them: every one that listens holds its lease's flock, so one of
    them serves it or no supervisor of this home does. Only when neither tells
    (``/proc/locks`` unreadable, a lease naming no pid) is it left unnamed: then the whole
    scan runs."""
    uid = os.getuid()
    want = os.path.normpath(os.fspath(home))
    locking: set[str] | None = None  # the sockets of this home's flock holders, read once
    out = []
    for path, named, file in listeners:
        if file == "ours" and not named:
            pid = socket_lease_holder(path)
            if pid is not None:
                sock = pid_supervisor_socket(str(pid), uid, want)
                if sock is None:
                    named = True  # another home's supervisor (or none): not ours to list
                elif normalize_socket_path(sock) == normalize_socket_path(path):
                    into.add(normalize_socket_path(path))
                    named = True
            elif not os.path.lexists(f"{path}.lock"):
                if locking is None:
                    locking = _locking_supervisors(uid, want)
                    # all of them, as the scan would find them: one may name its socket by
                    # another path than the listener's
                    into.update(locking or ())
                if locking is not None:
                    named = True  # a supervisor of this home serves it, or none does
        out.append((path, named, file))
    return out


def _locking_supervisors(uid: int, home: str) -> set[str] | None:
    """The sockets (normalised) of the supervisors of ``home`` among the processes that hold a
    flock, or ``None`` if those cannot be listed."""
    pids = flock_holders()
    if pids is None:
        return None
    out = set()
    for pid in pids:
        sock = pid_supervisor_socket(str(pid), uid, home)
        if sock is not None:
            out.add(normalize_socket_path(sock))
    return out


def _classified(
    sockets: list[str], layout: Layout, timing: Timing | ClientTiming,
    records: list[Record], descs: list[dict[str, Any]],
) -> list[Found]:
    found = []
    probes = probe_hellos(sockets, timing)  # all at once
    # after the hellos, one /proc read per pid: for a supervisor's record and its hello alike
    live = LivenessOnce()
    records = [replace(r, alive=live(r.pid, r.start_id) is not Liveness.DEAD) for r in records]
    for sock in sockets:
        obs, rec = observe(sock, layout, timing=timing, records=records, descriptors=descs,
                           probed=probes[sock], liveness_of=live)
        verdict = classify(obs, protocol=PROTOCOL_VERSION, app_version=APP_VERSION)
        if verdict is None:
            continue
        if rec is None and verdict.generation:
            rec = next((r for r in records if r.generation == verdict.generation), None)
        # generations/<g>/ under this home's state dir of that socket
        home_proven = bool(verdict.generation) and os.path.isdir(os.path.join(
            layout.home_dir, "daemons", socket_key(sock), "generations", str(verdict.generation)))
        found.append(Found(socket=sock, verdict=verdict, observation=obs, record=rec,
                           home_proven=home_proven))
    return found
