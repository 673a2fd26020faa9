"""Workers forked from the supervisor's template, end to end: real supervisors, templates and
workers, ``kill -9``, ``/proc``.

- a new session's worker is forked from the template: no child of the supervisor, the leader
  of its own session, holding only its own descriptors (none of the supervisor's lease, log or
  sockets, none of the template's);
- its agent gets the creating client's environment, not the supervisor's;
- it survives the template's ``kill -9`` and the supervisor's, and the next supervisor adopts
  it; the template itself dies with its supervisor;
- while the template is dead workers are exec'd; it is started again and forks again;
- ``shutdown`` leaves no process behind; ``restart`` keeps the workers, not the template.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from .harness import DaemonEnv, wait_for

CLI = str(Path(sys.executable).parent / "trio-agentd")


def cli(env: DaemonEnv, *args: str, extra: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *args], env={**env.env, **(extra or {})}, capture_output=True, text=True,
        timeout=60, stdin=subprocess.DEVNULL, cwd=cwd,
    )


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _ppid(pid: int) -> int:
    return int(_stat(pid)[1])


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def _alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


def _templates(env: DaemonEnv, supervisor: int) -> list[int]:
    """The supervisor's live fork templates (its children started ``--template``)."""
    return [p for p in env.our_pids()
            if _alive(p) and _ppid(p) == supervisor and _argv(p)[-1] == "--template"]


def _template(env: DaemonEnv, supervisor: int) -> int:
    found: list[int] = wait_for(lambda: _templates(env, supervisor), timeout=30,
                                what="the supervisor's fork template")
    assert len(found) == 1, found
    return found[0]


def _worker(env: DaemonEnv, session: str) -> int:
    return int(next(d["pid"] for d in env.descriptors() if d["session"] == session))


def _forked(pid: int, supervisor: int) -> bool:
    """Forked by a template: the template's command line, no child of the supervisor."""
    return _argv(pid)[-1] == "--template" and _ppid(pid) != supervisor


def _fds(pid: int) -> dict[int, str]:
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
    return out


def _socket_inodes(pid: int) -> set[str]:
    return {t for t in _fds(pid).values() if t.startswith("socket:")}


def test_a_new_worker_is_forked_and_holds_only_its_own_descriptors(denv: DaemonEnv) -> None:
    assert denv.prompt("hi", session="a") == "[echo turn 1] hi"
    assert denv.prompt("hi", session="b") == "[echo turn 1] hi"
    sup = denv.owner()["pid"]
    template = _template(denv, sup)
    for session in ("a", "b"):
        pid = _worker(denv, session)
        assert _forked(pid, sup), (_argv(pid), _ppid(pid), sup)
        stat = _stat(pid)
        assert int(stat[2]) == pid
        assert int(stat[3]) == pid
        fds = _fds(pid)
        assert fds[0] == fds[1] == "/dev/null"
        assert fds[2] == str(denv.home / "sessions" / session / "worker.log")
        for fd, target in fds.items():
            assert not target.endswith((".lock", "daemon.log", "owner.json")), (fd, target)
        # none of the supervisor's sockets, none of the template's
        assert not _socket_inodes(pid) & (_socket_inodes(sup) | _socket_inodes(template))
    # the template holds its socket, /dev/null and the daemon log: no lease, no listener
    # (while it rehearses a session in its idle moments it holds that one's scratch files and
    # socket pairs too: they are closed once the rehearsal is over)
    def settled() -> dict[int, str]:
        fds = _fds(template)
        return fds if len(fds) == 4 else {}

    tfds = wait_for(settled, timeout=30, what="the template's rehearsal to end")
    assert tfds[0] == tfds[1] == "/dev/null"
    assert tfds[2].endswith("daemon.log")
    (own,) = (t for fd, t in tfds.items() if fd > 2)
    assert own.startswith("socket:")


def test_the_agent_gets_the_creating_clients_environment(denv: DaemonEnv, tmp_path: Path
                                                         ) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "envagent.py").write_text(
        "import os\n"
        "class Agent:\n"
        "    replayable = True\n"
        "    async def turn(self, prompt, ctx):\n"
        "        yield os.environ.get(prompt, '-') + '\\n'\n"
        "def make():\n"
        "    return Agent()\n"
    )
    # the supervisor (and its template) start with FS_WHO=daemon
    assert cli(denv, "-p", "-s", "first", "hi", extra={"FS_WHO": "daemon"}).returncode == 0
    sup = denv.owner()["pid"]
    _template(denv, sup)
    client = {"FS_WHO": "client", "TZ": "UTC"}
    cp = cli(denv, "-p", "-s", "sh", "--agent", "shell",
             "echo $FS_WHO; env | grep ^TRIO_AGENTD_ | cut -d= -f1 | sort", extra=client)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.split() == ["client", "TRIO_AGENTD_SESSION", "TRIO_AGENTD_TURN"]
    cp = cli(denv, "-p", "-s", "py", "--agent", "envagent:make", "FS_WHO", extra=client,
             cwd=proj)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == "client\n"
    cp = cli(denv, "-p", "-s", "py", "TRIO_AGENTD_HOME", cwd=proj)
    assert cp.stdout == "-\n"
    # an environment bigger than a socket buffer travels whole
    big = {f"FS_BIG{i}": str(i) * 100_000 for i in range(4)}
    cp = cli(denv, "-p", "-s", "big", "--agent", "shell",
             "echo ${#FS_BIG0} ${#FS_BIG3}", extra=big)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == "100000 100000\n"
    for session in ("sh", "py", "big"):
        assert _forked(_worker(denv, session), sup)


def test_a_forked_worker_survives_the_template_and_the_supervisor_and_is_adopted(
    denv: DaemonEnv,
) -> None:
    assert denv.prompt("one", session="w") == "[echo turn 1] one"
    sup = denv.owner()["pid"]
    template = _template(denv, sup)
    worker = _worker(denv, "w")
    assert _forked(worker, sup)
    os.kill(template, signal.SIGKILL)
    wait_for(lambda: not _alive(template), timeout=10, what="the template to die")
    assert _alive(worker)
    assert denv.prompt("two", session="w") == "[echo turn 2] two"
    template = _template(denv, sup)  # started again
    os.kill(sup, signal.SIGKILL)
    # the template goes with its supervisor; the worker stays
    wait_for(lambda: not _alive(template), timeout=10, what="the template to exit")
    assert _alive(worker)
    assert denv.prompt("three", session="w") == "[echo turn 3] three"
    assert denv.owner()["pid"] != sup
    assert _worker(denv, "w") == worker
    rows = json.loads(denv.run("sessions", "--json").stdout)
    assert [(r["session"], r["pid"], r["restarts"]) for r in rows] == [("w", worker, 0)]


def test_workers_are_execd_while_the_template_is_dead(denv: DaemonEnv) -> None:
    timing = {"TRIO_AGENTD_TIMING": json.dumps({"fork_template_restart_delay": 3600})}
    assert cli(denv, "-p", "-s", "a", "hi", extra=timing).returncode == 0
    sup = denv.owner()["pid"]
    template = _template(denv, sup)
    os.kill(template, signal.SIGKILL)
    wait_for(lambda: not _alive(template), timeout=10, what="the template to die")
    assert denv.prompt("hi", session="b") == "[echo turn 1] hi"
    b = _worker(denv, "b")
    assert _ppid(b) == sup
    assert _argv(b)[-2:] == ["-m", "trio_agentd.worker"]
    # a forked worker that crashes is respawned the same way
    a = _worker(denv, "a")
    os.kill(a, signal.SIGKILL)
    assert denv.prompt("again", session="a") == "[echo turn 2] again"
    assert _ppid(_worker(denv, "a")) == sup
    assert _templates(denv, sup) == []


def test_the_template_is_started_again_and_forks_again(denv: DaemonEnv) -> None:
    assert denv.prompt("hi", session="a") == "[echo turn 1] hi"
    sup = denv.owner()["pid"]
    first = _template(denv, sup)
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: not _alive(first), timeout=10, what="the template to die")
    second = wait_for(lambda: [p for p in _templates(denv, sup) if p != first], timeout=30,
                      what="a new template")[0]
    # once it is ready (the supervisor alone sees that), new sessions' workers come from it
    made: list[str] = []

    def next_is_forked() -> bool:
        session = f"n{len(made)}"
        made.append(session)
        assert denv.prompt("hi", session=session) == "[echo turn 1] hi"
        return _forked(_worker(denv, session), sup)

    wait_for(next_is_forked, timeout=30, what="a worker forked by the new template")
    assert _templates(denv, sup) == [second]


def test_shutdown_leaves_nothing_behind(denv: DaemonEnv) -> None:
    for s in ("a", "b"):
        assert denv.prompt("hi", session=s) == "[echo turn 1] hi"
    sup = denv.owner()["pid"]
    template = _template(denv, sup)
    cp = denv.run("shutdown")
    assert cp.returncode == 0, cp.stderr
    wait_for(lambda: not denv.our_pids(), timeout=30, what="every process to exit")
    assert not _alive(template)
    assert "Traceback" not in denv.log_text()


def test_restart_keeps_forked_workers_and_ends_the_old_template(denv: DaemonEnv) -> None:
    assert denv.prompt("hi", session="a") == "[echo turn 1] hi"
    sup = denv.owner()["pid"]
    template = _template(denv, sup)
    worker = _worker(denv, "a")
    cp = denv.run("restart")
    assert cp.returncode == 0, cp.stderr
    wait_for(lambda: not _alive(sup) and not _alive(template), timeout=30,
             what="the old supervisor and its template to exit")
    assert denv.prompt("hi", session="a") == "[echo turn 2] hi"
    assert _worker(denv, "a") == worker
    assert "Traceback" not in denv.log_text()


def test_an_agents_atexit_handlers_run_when_its_worker_ends_forked_or_execd(
    denv: DaemonEnv, tmp_path: Path,
) -> None:
    """A worker leaves with ``os._exit`` (no interpreter teardown), after the ``atexit``
    handlers: an agent's run whether it was stopped by ``kill``, by a TERM or by a shutdown,
    and whether its worker was forked by the template or exec'd."""
    runs = tmp_path / "runs.log"
    # the supervisor (autostarted by the first prompt) never restarts a dead template
    extra = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TA_FIXTURE_FILE": str(runs),
             "TRIO_AGENTD_TIMING": json.dumps({"fork_template_restart_delay": 3600})}
    agent = "tests.fixture_agents:at_exit"

    def start(session: str) -> int:
        cp = cli(denv, "-p", "-s", session, "--agent", agent, "hi", extra=extra)
        assert cp.returncode == 0, cp.stderr
        assert cp.stdout == "[echo turn 1] hi\n"
        return _worker(denv, session)

    def ran_atexit(pid: int) -> bool:
        return runs.exists() and f"atexit {pid}" in runs.read_text().splitlines()

    killed = start("k")
    sup = denv.owner()["pid"]
    assert _forked(killed, sup)
    assert cli(denv, "kill", "k").returncode == 0
    wait_for(lambda: not _alive(killed), timeout=30, what="the killed worker to exit")
    assert ran_atexit(killed)

    termed = start("t")
    os.kill(termed, signal.SIGTERM)  # an operator's TERM: a clean stop
    wait_for(lambda: not _alive(termed), timeout=30, what="the TERMed worker to exit")
    assert ran_atexit(termed)

    # with the template dead, the next worker is exec'd; a shutdown ends it
    template = _template(denv, sup)
    os.kill(template, signal.SIGKILL)
    wait_for(lambda: not _alive(template), timeout=10, what="the template to die")
    execd = start("e")
    assert _argv(execd)[-2:] == ["-m", "trio_agentd.worker"]
    assert denv.run("shutdown").returncode == 0
    wait_for(lambda: not _alive(execd), timeout=30, what="the exec'd worker to exit")
    assert ran_atexit(execd)
    assert "Traceback" not in denv.log_text()


def test_a_stop_signal_to_a_worker_that_is_leaving_does_not_cut_its_atexit_handlers_short(
    denv: DaemonEnv, tmp_path: Path,
) -> None:
    """A worker TERMed again while it is leaving (as its supervisor does to a worker that said
    it stopped) still runs its ``atexit`` handlers to their end: once it leaves, the stop
    signals no longer have their default action."""
    runs, fifo = tmp_path / "runs.log", tmp_path / "let-go"
    os.mkfifo(fifo)
    extra = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TA_FIXTURE_FILE": str(runs),
             "TA_FIXTURE_FIFO": str(fifo)}
    cp = cli(denv, "-p", "-s", "w", "--agent", "tests.fixture_agents:at_exit_waits", "hi",
             extra=extra)
    assert cp.returncode == 0, cp.stderr
    worker = _worker(denv, "w")

    def lines() -> list[str]:
        return runs.read_text().splitlines() if runs.exists() else []

    os.kill(worker, signal.SIGTERM)  # an operator's TERM: a clean stop
    wait_for(lambda: f"leaving {worker}" in lines(), timeout=30,
             what="the worker to run its atexit handlers")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        os.kill(worker, sig)

    def let_go() -> bool:
        """Open the FIFO (the handler then goes on) once the handler has it open."""
        assert _alive(worker), "a stop signal ended the worker while it was leaving"
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no reader yet
                return False
            raise
        os.close(fd)
        return True

    wait_for(let_go, timeout=30, what="the worker's atexit handler to open the FIFO")
    wait_for(lambda: not _alive(worker), timeout=30, what="the worker to exit")
    assert f"atexit {worker}" in lines()


def _spare_pids(env: DaemonEnv) -> list[int]:
    """The spares the supervisor says it keeps parked (``status``)."""
    from trio_agentd._paths import Layout
    from trio_agentd._syncclient import SyncClient

    client = SyncClient(Layout.resolve(socket=env.socket, home=str(env.home),
                                       registry=str(env.registry)), autostart=False)
    try:
        pids = client.request("status")["spare_pids"]
    finally:
        client.close()
    assert isinstance(pids, list)
    return [int(p) for p in pids]


def test_a_spare_is_parked_holding_nothing_and_a_respawn_takes_it(denv: DaemonEnv) -> None:
    assert denv.prompt("hi", session="a") == "[echo turn 1] hi"
    sup = denv.owner()["pid"]
    template = _template(denv, sup)
    (spare,) = wait_for(lambda: _spare_pids(denv), timeout=30, what="a parked spare")
    assert denv.spare_workers() == [spare]  # what /proc shows: no session's worker
    stat = _stat(spare)
    assert int(stat[1]) == template
    assert int(stat[2]) == int(stat[3]) == spare  # its own session and group
    fds = _fds(spare)
    assert sorted(fds) == [0, 1, 2, 3], fds
    assert fds[0] == fds[1] == fds[2] == "/dev/null"
    assert fds[3].startswith("socket:")  # its end of the supervisor's private socketpair
    assert not _socket_inodes(spare) & (_socket_inodes(sup) | _socket_inodes(template))
    # a crash's respawn takes the spare (no fork), and another is parked in its place
    os.kill(_worker(denv, "a"), signal.SIGKILL)
    assert denv.prompt("again", session="a") == "[echo turn 2] again"
    assert _worker(denv, "a") == spare
    # two starts in the demand window: two spares are parked now, neither the one taken
    def two() -> list[int]:
        pids = _spare_pids(denv)
        return pids if len(pids) == 2 else []

    others = wait_for(two, timeout=30, what="two new spares")
    assert spare not in others
    # a spare serves one session only: the next new session gets one of the new ones
    assert denv.prompt("hi", session="b") == "[echo turn 1] hi"
    assert _worker(denv, "b") in others
    assert _worker(denv, "a") == spare


def test_spares_exit_with_their_supervisor_on_kill9_and_on_shutdown(denv: DaemonEnv) -> None:
    assert denv.prompt("hi", session="a") == "[echo turn 1] hi"
    sup = denv.owner()["pid"]
    spares = wait_for(lambda: _spare_pids(denv), timeout=30, what="a parked spare")
    os.kill(sup, signal.SIGKILL)
    # its end of each spare's socket closed with it: no spare is left behind
    wait_for(lambda: not any(_alive(p) for p in spares), timeout=10, what="the spares to exit")
    assert denv.prompt("two", session="a") == "[echo turn 2] two"  # adopted, not respawned
    now = wait_for(lambda: _spare_pids(denv), timeout=30, what="the new supervisor's spare")
    assert not set(now) & set(spares)
    cp = denv.run("shutdown")
    assert cp.returncode == 0, cp.stderr
    wait_for(lambda: not denv.our_pids(), timeout=30, what="every process to exit")
