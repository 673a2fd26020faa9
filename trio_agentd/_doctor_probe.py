"""What one socket shows ``ps`` and ``doctor``: a hello probe (to a peer proven ours, many at
once), and the observation of it that :func:`._doctor_plan.classify` takes.
"""

from __future__ import annotations

import _socket
import errno
import os
import sys
import time

from . import _jsonfast as json  # the stdlib json's loads/dumps, without importing json (and re)
from ._defaults import CLIENT, ClientTiming
from ._doctor_discover import read_descriptors, read_records
from ._doctor_plan import (
    Hello,
    Observation,
    Record,
)
from ._errors import AgentdError, ErrorCode
from ._identity import (
    liveness,
    proc_stat_fields,
    stat_liveness,
)
from ._paths import Layout
from ._procstate import Liveness
from ._registryfiles import (
    OWNER_FILE,
    owner_dir_name,
    tombstone_name,
)
from ._trust import prove_peer, prove_socket_dir

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (ps path)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .timing import Timing

    # (socket file exists, accepts connections, hello or None)
    ProbeResult = tuple[bool, bool, dict[str, Any] | None]


class Untrusted(Exception):
    """The socket's dir or its listening peer is not ours: nothing was read or sent."""


def probe_hello(path: str, timing: Timing | ClientTiming = CLIENT) -> ProbeResult:
    """``(socket file exists, accepts connections, hello or None)`` — no commands sent.

    Raises:
        Untrusted: the socket's dir or its peer failed the proof (the message says why).
    """
    got = probe_hellos([path], timing)[path]
    if isinstance(got, Untrusted):
        raise got
    return got


def probe_hellos(
    paths: list[str], timing: Timing | ClientTiming = CLIENT
) -> dict[str, ProbeResult | Untrusted]:
    """:func:`probe_hello` of many sockets at once: each is proven and connected first, then
    the hellos are read as they come, with one ``poll`` (no trio), so N supervisors cost
    about the wake-up of one, not N in a row. Every connection is closed before returning."""
    import select

    out: dict[str, ProbeResult | Untrusted] = {}
    pending: dict[int, tuple[str, _socket.socket, bytearray]] = {}
    try:
        for path in paths:
            try:
                got = _connect_proven(path, timing)
            except Untrusted as exc:
                out[path] = exc
                continue
            if isinstance(got, tuple):
                out[path] = got
                continue
            pending[got.fileno()] = (path, got, bytearray())
        poller = select.poll()
        for fd in pending:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timing.hello_timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            for fd, _events in poller.poll(max(1, int(left * 1000))):
                path, s, data = pending[fd]
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                data += chunk
                if chunk and b"\n" not in data:
                    continue
                poller.unregister(fd)
                del pending[fd]
                s.close()
                out[path] = (True, True, _hello_of(bytes(data)))
    finally:
        for path, s, _data in pending.values():
            s.close()
            out[path] = (True, True, None)  # accepted, but no hello in time
    return out


def _connect_proven(path: str, timing: Timing | ClientTiming) -> _socket.socket | ProbeResult:
    """A non-blocking connection to ``path`` whose dir and peer are proven ours, or the probe's
    result when there is nothing to read a hello from.

    Raises:
        Untrusted: the socket's dir or its peer failed the proof.
    """
    try:
        prove_socket_dir(os.path.dirname(path))
    except AgentdError as exc:
        if exc.code == ErrorCode.DAEMON_UNAVAILABLE:
            return False, False, None
        raise Untrusted(str(exc.details.get("untrusted", exc.message))) from None
    if not os.path.lexists(path):
        return False, False, None
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.setblocking(False)
    err = s.connect_ex(path)
    if err in (errno.EAGAIN, errno.EINPROGRESS):  # its backlog is full: wait, as one would
        s.settimeout(timing.connect_timeout)
        try:
            s.connect(path)
            err = 0
        except OSError:
            pass
        s.setblocking(False)
    if err != 0:
        s.close()
        return True, False, None
    try:
        prove_peer(s, path)
    except AgentdError as exc:
        s.close()
        raise Untrusted(str(exc.details.get("untrusted", exc.message))) from None
    # nothing will be sent: the end of our side now lets the supervisor that accepts it read
    # that end right after its hello and close, in one wake-up, not a second one (20
    # supervisors woken twice each would compete with ps for the CPU). OSError: it is gone
    # already (ENOTCONN), and reading its hello will say so.
    try:  # noqa: SIM105 - contextlib is not imported on the ps path
        s.shutdown(_socket.SHUT_WR)
    except OSError:
        pass
    return s


def _hello_of(data: bytes) -> dict[str, Any] | None:
    """The hello in the first line of ``data``, or ``None`` (no whole line, not a hello)."""
    if b"\n" not in data:
        return None
    try:
        obj = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and obj.get("type") == "hello" else None


class LivenessOnce:
    """:func:`._identity.liveness` that reads each pid's ``/proc/<pid>/stat`` once: ``ps``
    asks about a supervisor's pid for its record and again for its hello. Made after the
    hellos are read, so each answer is as fresh as the final re-check needs."""

    def __init__(self) -> None:
        self._tails: dict[int, list[bytes] | None] = {}
        self._linux = sys.platform.startswith("linux")

    def __call__(self, pid: int, start_id: str | None) -> Liveness:
        if pid <= 0 or not self._linux:
            return liveness(pid, start_id)
        if pid not in self._tails:
            self._tails[pid] = proc_stat_fields(pid)
        return stat_liveness(pid, start_id, self._tails[pid])


def observe(
    socket: str, layout: Layout, *, timing: Timing | ClientTiming = CLIENT,
    records: list[Record] | None = None, descriptors: list[dict[str, Any]] | None = None,
    probed: ProbeResult | Untrusted | None = None,
    liveness_of: Callable[[int, str | None], Liveness] = liveness,
) -> tuple[Observation, Record | None]:
    """What is known of one socket; ``probed``: its :func:`probe_hello` result, if taken;
    ``liveness_of``: how a pid's liveness is read (a :class:`LivenessOnce` shares the reads
    of one survey)."""
    try:
        if probed is None:
            probed = probe_hello(socket, timing)
        if isinstance(probed, Untrusted):
            raise probed
        exists, accepts, raw = probed
    except Untrusted as exc:
        obs = Observation(socket=socket, is_default=(socket == layout.socket),
                          socket_file=os.path.lexists(socket), accepts=False,
                          untrusted=str(exc))
        return obs, None
    records = read_records(layout.registry_dir) if records is None else records
    by_gen = {r.generation: r for r in records}
    hello: Hello | None = None
    hello_record: Record | None = None
    corrupt = revoked = False
    hello_alive = True
    if raw is not None:
        gen = raw.get("generation")
        hello = Hello(
            generation=str(gen) if gen else None, pid=int(raw.get("pid", 0) or 0),
            start_id=raw.get("start_id"), protocol=int(raw.get("protocol", 0) or 0),
            app_version=str(raw.get("app_version", "")),
        )
        if hello.generation:
            hello_record = by_gen.get(hello.generation)
            registry = layout.registry_dir
            owner_json = os.path.join(registry, owner_dir_name(hello.generation), OWNER_FILE)
            corrupt = hello_record is None and os.path.exists(owner_json)
            revoked = os.path.exists(os.path.join(registry, tombstone_name(hello.generation)))
        # final liveness re-check: a supervisor that is stopping is not wedged
        hello_alive = liveness_of(hello.pid, hello.start_id) is not Liveness.DEAD
    if descriptors is None:
        descriptors = read_descriptors(layout.home_dir)
    descs = [d for d in descriptors if d.get("socket") == socket]
    # the live workers tell only when no hello came (classify reads them only then): a
    # supervisor that answers costs no /proc read per session
    tracked = 0 if hello is not None else sum(
        1 for d in descs
        if isinstance(d.get("pid"), int) and liveness_of(int(d["pid"]), d.get("start_id"))
        is not Liveness.DEAD
    )
    obs = Observation(
        socket=socket, is_default=(socket == layout.socket), socket_file=exists,
        accepts=accepts, hello=hello, hello_record=hello_record, hello_record_corrupt=corrupt,
        revoked=revoked, hello_pid_alive=hello_alive,
        socket_records=tuple(r for r in records if r.socket == socket and r.alive),
        tracked_workers=tracked, sessions=len(descs),
    )
    return obs, hello_record
