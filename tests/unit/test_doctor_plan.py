"""ps / doctor: the classifier, the repair plan, the executor and the table.

Pure and synchronous: observations are built by hand, the repair's side effects go through fake
:class:`Hooks` that record every call, and the table is printed into an :class:`io.StringIO`.
The incident these guard against (seed 000): a supervisor that answers hello but lost its owner
record was reported ``current``; doctor must call it ``ownership-lost`` and ``--fix`` must restart
only that one — never a healthy, starting, stopping or successor supervisor.
"""

from __future__ import annotations

import datetime as dt
import io
import sys
from typing import Any

import pytest

from trio_agentd._doctor import Found
from trio_agentd._doctor_plan import (
    PROBLEMS,
    REMEDY_OWNERSHIP_LOST,
    WEDGED_STEPS,
    Hello,
    Observation,
    Record,
    Repair,
    Status,
    Step,
    Verdict,
    classify,
    plan_repair,
    remedy,
)
from trio_agentd._doctor_repair import Hooks, Outcome, execute
from trio_agentd._plain import replace
from trio_agentd._report import print_table

PROTO = 1
APP = "0.1.0"
SOCK = "/run/user/1000/trio-agentd/daemon.sock"
OTHER_SOCK = "/tmp/trio-agentd-1000/other.sock"
OLD_SOCK = "/tmp/trio-agentd-1000/old.sock"
HOME = "/home/u/.local/state/trio-agentd"
GEN = "a" * 32
NEW_GEN = "b" * 32
PID = 4242
START = "boot-1:5000"
NEW_PID = 5151
NEW_START = "boot-1:9000"
TICKET = "tkt-7f3a"

HELLO = Hello(generation=GEN, pid=PID, start_id=START, protocol=PROTO, app_version=APP)
REC = Record(generation=GEN, pid=PID, start_id=START, socket=SOCK, phase="owner", alive=True)
NEW_HELLO = Hello(
    generation=NEW_GEN, pid=NEW_PID, start_id=NEW_START, protocol=PROTO, app_version=APP
)
NEW_REC = Record(
    generation=NEW_GEN, pid=NEW_PID, start_id=NEW_START, socket=SOCK, phase="owner", alive=True
)

# a supervisor that answers hello and whose record matches it
ANSWERING = Observation(
    socket=SOCK, socket_file=True, accepts=True, hello=HELLO, hello_record=REC,
    socket_records=(REC,),
)
# nothing at the path, nothing listening, no record, no workers
NOTHING = Observation(socket=SOCK, socket_file=False, accepts=False)

CURRENT = Verdict(status=Status.CURRENT, generation=GEN, pid=PID, start_id=START)
LOST = Verdict(
    status=Status.OWNERSHIP_LOST, cause="record-missing", generation=GEN, pid=PID, start_id=START
)
UNREACHABLE = Verdict(
    status=Status.UNREACHABLE, cause="accepts connections but sends no hello", generation=GEN,
    pid=PID, start_id=START,
)
ORPHAN = Verdict(status=Status.ORPHAN_FILE, cause="nobody listens on it")
STARTING = Verdict(status=Status.STARTING, generation=GEN, pid=PID, start_id=START)
STALE = Verdict(status=Status.STALE, cause="protocol 2, app 0.1.0", generation=GEN, pid=PID,
                start_id=START)

LOST_FOOTER = (
    f"! {SOCK}: supervisor lost its ownership record — run \"trio-agentd doctor --fix\" to restart"
    " it (sessions are preserved)"
)


def judge(obs: Observation) -> Verdict | None:
    return classify(obs, protocol=PROTO, app_version=APP)


# --- classify: every status ----------------------------------------------------------------------


def test_current_when_hello_matches_its_record() -> None:
    assert judge(ANSWERING) == CURRENT


def test_current_when_hello_and_record_both_lack_a_start_id() -> None:
    obs = replace(ANSWERING, hello=replace(HELLO, start_id=None),
                  hello_record=replace(REC, start_id=None), socket_records=())
    assert judge(obs) == Verdict(status=Status.CURRENT, generation=GEN, pid=PID, start_id=None)


@pytest.mark.parametrize(
    ("hello", "cause"),
    [
        (replace(HELLO, protocol=2), "protocol 2, app 0.1.0"),
        (replace(HELLO, app_version="0.2.0"), "protocol 1, app 0.2.0"),
        (replace(HELLO, generation=None), "protocol 1, app 0.1.0"),
    ],
    ids=["other-protocol", "other-app-version", "no-generation"],
)
def test_stale(hello: Hello, cause: str) -> None:
    # a stale daemon is judged by its hello alone, even when its record is gone
    obs = replace(ANSWERING, hello=hello, hello_record=None, socket_records=())
    assert judge(obs) == Verdict(status=Status.STALE, cause=cause, generation=hello.generation,
                                 pid=PID, start_id=START)


def test_ownership_lost_record_missing() -> None:
    """The seed's incident: answers hello, its owner record was deleted on disk."""
    obs = replace(ANSWERING, hello_record=None, socket_records=())
    assert judge(obs) == LOST


def test_ownership_lost_record_corrupt() -> None:
    obs = replace(ANSWERING, hello_record=None, hello_record_corrupt=True, socket_records=())
    assert judge(obs) == LOST


def test_ownership_lost_record_corrupt_even_if_a_record_was_parsed() -> None:
    obs = replace(ANSWERING, hello_record_corrupt=True)
    assert judge(obs) == LOST


@pytest.mark.parametrize(
    "record",
    [
        replace(REC, pid=999),
        replace(REC, start_id="boot-1:1"),
        replace(REC, socket=OTHER_SOCK),
    ],
    ids=["other-pid", "other-start-id", "other-socket"],
)
def test_ownership_lost_record_replaced(record: Record) -> None:
    obs = replace(ANSWERING, hello_record=record, socket_records=())
    assert judge(obs) == replace(LOST, cause="record-replaced")


def test_ownership_lost_when_another_live_record_claims_the_socket() -> None:
    obs = replace(ANSWERING, socket_records=(REC, NEW_REC))
    assert judge(obs) == replace(LOST, cause="record-replaced")


@pytest.mark.parametrize(
    "record", [REC, None], ids=["record-present", "record-missing"]
)
def test_ownership_lost_revoked(record: Record | None) -> None:
    """A tombstone wins over everything else: that generation was fenced off."""
    obs = replace(ANSWERING, hello_record=record, revoked=True)
    assert judge(obs) == replace(LOST, cause="revoked")


def test_unreachable_accepts_but_no_hello() -> None:
    obs = Observation(socket=SOCK, socket_file=True, accepts=True)
    assert judge(obs) == Verdict(status=Status.UNREACHABLE,
                                 cause="accepts connections but sends no hello")


def test_unreachable_accepts_but_no_hello_names_the_live_owner() -> None:
    obs = Observation(socket=SOCK, socket_file=True, accepts=True, socket_records=(REC,))
    assert judge(obs) == UNREACHABLE


@pytest.mark.parametrize("socket_file", [True, False], ids=["file", "no-file"])
def test_unreachable_live_record_but_nothing_listening(socket_file: bool) -> None:
    obs = Observation(socket=SOCK, socket_file=socket_file, accepts=False, socket_records=(REC,))
    assert judge(obs) == Verdict(
        status=Status.UNREACHABLE, cause="its supervisor is alive but does not listen",
        generation=GEN, pid=PID, start_id=START,
    )


@pytest.mark.parametrize("socket_file", [True, False], ids=["file", "no-file"])
def test_unreachable_live_workers_but_no_supervisor(socket_file: bool) -> None:
    obs = Observation(socket=SOCK, socket_file=socket_file, accepts=False, tracked_workers=2,
                      sessions=3)
    assert judge(obs) == Verdict(status=Status.UNREACHABLE,
                                 cause="live workers but no supervisor")


def test_orphan_file() -> None:
    obs = Observation(socket=SOCK, socket_file=True, accepts=False, sessions=4)
    assert judge(obs) == ORPHAN


def test_nothing_there_is_none() -> None:
    assert judge(NOTHING) is None


def test_sessions_without_live_workers_are_not_a_supervisor() -> None:
    assert judge(replace(NOTHING, sessions=5)) is None


@pytest.mark.parametrize(
    ("status", "problem"),
    [
        (Status.CURRENT, False),
        (Status.STARTING, False),
        (Status.STOPPING, False),
        (Status.STALE, False),
        (Status.OWNERSHIP_LOST, True),
        (Status.UNREACHABLE, True),
        (Status.ORPHAN_FILE, True),
        (Status.FOREIGN, True),
    ],
)
def test_which_statuses_are_problems(status: Status, problem: bool) -> None:
    assert Verdict(status=status).problem is problem
    assert (status in PROBLEMS) is problem


def test_status_strings() -> None:
    assert [str(s) for s in Status] == [
        "current", "starting", "stopping", "stale", "ownership-lost", "unreachable",
        "orphan-file", "foreign",
    ]


# --- classify: the false-positive guards ---------------------------------------------------------


@pytest.mark.parametrize("socket_file", [True, False], ids=["bound", "not-bound"])
def test_starting_supervisor_is_starting_not_a_problem(socket_file: bool) -> None:
    rec = replace(REC, phase="starting")
    obs = Observation(socket=SOCK, socket_file=socket_file, accepts=False, socket_records=(rec,))
    verdict = judge(obs)
    assert verdict == STARTING
    assert verdict is not None
    assert not verdict.problem


def test_starting_supervisor_with_live_workers_is_still_starting() -> None:
    """A restarted supervisor's workers outlive its predecessor: it is still just starting."""
    rec = replace(REC, phase="starting")
    obs = Observation(socket=SOCK, socket_file=True, accepts=False, socket_records=(rec,),
                      tracked_workers=3)
    assert judge(obs) == STARTING


@pytest.mark.parametrize(
    "obs",
    [
        replace(ANSWERING, hello_pid_alive=False),
        replace(ANSWERING, hello_pid_alive=False, hello_record=None, socket_records=()),
        replace(ANSWERING, hello_pid_alive=False, hello_record=replace(REC, pid=999)),
    ],
    ids=["record-intact", "record-released", "record-replaced"],
)
def test_stopping_supervisor_failing_the_final_recheck_is_not_reported(obs: Observation) -> None:
    assert judge(obs) is None


def test_replaced_daemon_answering_with_the_new_generation_is_current() -> None:
    old_dead = replace(REC, alive=False)
    obs = replace(ANSWERING, hello=NEW_HELLO, hello_record=NEW_REC,
                  socket_records=(old_dead, NEW_REC))
    assert judge(obs) == Verdict(status=Status.CURRENT, generation=NEW_GEN, pid=NEW_PID,
                                 start_id=NEW_START)


def test_dead_record_never_conflicts_with_an_answering_supervisor() -> None:
    obs = replace(ANSWERING, socket_records=(REC, replace(NEW_REC, alive=False)))
    assert judge(obs) == CURRENT


@pytest.mark.parametrize(
    ("socket_file", "expected"),
    [(True, ORPHAN), (False, None)],
    ids=["file", "no-file"],
)
@pytest.mark.parametrize("phase", ["owner", "starting", "stopping"])
def test_dead_record_makes_neither_unreachable_nor_starting(
    phase: str, socket_file: bool, expected: Verdict | None
) -> None:
    dead = replace(REC, phase=phase, alive=False)
    obs = Observation(socket=SOCK, socket_file=socket_file, accepts=False, socket_records=(dead,))
    assert judge(obs) == expected


def test_stopping_supervisor_that_closed_its_listener_is_not_a_problem() -> None:
    rec = replace(REC, phase="stopping")
    obs = Observation(socket=SOCK, socket_file=False, accepts=False, socket_records=(rec,))
    verdict = judge(obs)
    assert verdict is None or not verdict.problem


# --- foreign: a socket whose dir or peer is not ours --------------------------------------------

UNTRUSTED = "is served by a process of uid 65534, not yours (uid 1000)"
FOREIGN_OBS = Observation(socket=SOCK, socket_file=True, accepts=False, untrusted=UNTRUSTED)


def test_foreign_wins_over_everything_else_it_may_claim() -> None:
    # a fake hello naming our own generation, pid and record is still someone else's socket
    obs = replace(ANSWERING, untrusted=UNTRUSTED)
    assert judge(obs) == Verdict(status=Status.FOREIGN, cause=UNTRUSTED)
    assert judge(FOREIGN_OBS) == Verdict(status=Status.FOREIGN, cause=UNTRUSTED)


def test_foreign_is_never_repaired_whatever_it_claims() -> None:
    verdict = Verdict(status=Status.FOREIGN, cause=UNTRUSTED, generation=GEN, pid=PID,
                      start_id=START)
    repair = plan_repair(SOCK, verdict, home_proven=True, home=HOME)
    assert repair is not None
    assert repair.steps == ()
    assert repair.declined is not None
    assert "not yours" in repair.declined


def test_remedy_for_foreign_says_nothing_was_sent() -> None:
    line = remedy(SOCK, Verdict(status=Status.FOREIGN, cause=UNTRUSTED))
    assert line == (
        f"! {SOCK}: not yours ({UNTRUSTED}) — nothing was sent to it and doctor never touches"
        " it; remove it if you can, or use another --socket"
    )


# --- remedy --------------------------------------------------------------------------------------


def test_remedy_ownership_lost_is_the_spec_footer() -> None:
    assert remedy(SOCK, LOST) == LOST_FOOTER
    assert remedy(SOCK, replace(LOST, cause="record-replaced")) == LOST_FOOTER
    assert REMEDY_OWNERSHIP_LOST.format(socket=SOCK) == LOST_FOOTER


@pytest.mark.parametrize("verdict", [CURRENT, STARTING], ids=["current", "starting"])
def test_no_remedy_for_healthy(verdict: Verdict) -> None:
    assert remedy(SOCK, verdict) is None


def test_remedy_other_problems() -> None:
    assert remedy(SOCK, UNREACHABLE) == (
        f"! {SOCK}: supervisor does not answer (accepts connections but sends no hello) — run"
        " \"trio-agentd doctor --fix\" to replace it (sessions are preserved)"
    )
    assert remedy(SOCK, ORPHAN) == (
        f"! {SOCK}: stale socket file — \"trio-agentd doctor --fix\" removes it"
    )
    assert remedy(SOCK, STALE) == (
        f"! {SOCK}: supervisor runs another version (protocol 2, app 0.1.0) — run"
        " `trio-agentd restart`"
    )


# --- plan_repair ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "verdict", [CURRENT, STARTING, STALE], ids=["current", "starting", "stale"]
)
@pytest.mark.parametrize("home_proven", [True, False])
def test_healthy_is_never_touched(verdict: Verdict, home_proven: bool) -> None:
    assert plan_repair(SOCK, verdict, home_proven=home_proven, home=HOME) is None


@pytest.mark.parametrize("home_proven", [True, False])
def test_orphan_file_plan(home_proven: bool) -> None:
    repair = plan_repair(SOCK, ORPHAN, home_proven=home_proven, home=HOME)
    assert repair == Repair(socket=SOCK, verdict=ORPHAN,
                            steps=(Step.REPROBE_DEAD, Step.REMOVE_SOCKET))
    assert repair.describe() == f"{SOCK}: reprobe-dead → remove-socket"


@pytest.mark.parametrize("verdict", [LOST, UNREACHABLE], ids=["ownership-lost", "unreachable"])
def test_wedged_plan_is_the_spec_sequence(verdict: Verdict) -> None:
    repair = plan_repair(SOCK, verdict, home_proven=True, home=HOME)
    assert repair == Repair(socket=SOCK, verdict=verdict, steps=WEDGED_STEPS)
    assert repair.steps == (
        Step.PROVE_HOME, Step.TAKE_ADMISSION, Step.REPROBE_SAME, Step.REVOKE, Step.KILL,
        Step.REMOVE_SOCKET, Step.RELAUNCH, Step.WAIT_HELLO, Step.RELEASE_ADMISSION,
    )
    assert repair.describe() == (
        f"{SOCK}: prove-home → take-admission → reprobe-same → revoke → kill → remove-socket"
        " → relaunch → wait-hello → release-admission"
    )


NO_IDENTITY = (
    "no supervisor record names it, so there is no identity to kill safely — stop its process"
    " by hand"
)


@pytest.mark.parametrize(
    "verdict",
    [
        replace(LOST, generation=None),
        replace(LOST, pid=None),
        Verdict(status=Status.UNREACHABLE, cause="live workers but no supervisor"),
        Verdict(status=Status.UNREACHABLE, cause="accepts connections but sends no hello"),
    ],
    ids=["no-generation", "no-pid", "workers-only", "listener-without-record"],
)
@pytest.mark.parametrize("home_proven", [True, False])
def test_declines_without_an_identity(verdict: Verdict, home_proven: bool) -> None:
    repair = plan_repair(SOCK, verdict, home_proven=home_proven, home=HOME)
    assert repair == Repair(socket=SOCK, verdict=verdict, declined=NO_IDENTITY)
    assert repair.describe() == f"{SOCK}: not repaired — {NO_IDENTITY}"


@pytest.mark.parametrize("verdict", [LOST, UNREACHABLE], ids=["ownership-lost", "unreachable"])
def test_declines_an_unreadable_start_id(verdict: Verdict) -> None:
    v = replace(verdict, start_id=None)
    repair = plan_repair(SOCK, v, home_proven=True, home=HOME)
    assert repair == Repair(socket=SOCK, verdict=v, declined=(
        f"the identity of pid {PID} cannot be read, so it is never signalled"))


@pytest.mark.parametrize("verdict", [LOST, UNREACHABLE], ids=["ownership-lost", "unreachable"])
def test_declines_a_home_not_proven(verdict: Verdict) -> None:
    repair = plan_repair(SOCK, verdict, home_proven=False, home=HOME)
    assert repair is not None
    assert repair.steps == ()
    assert repair.declined == (
        f"generation {GEN} does not belong to home {HOME} (no generations/<g>/ there) — run"
        " doctor with the --home it was started with"
    )
    assert "--home it was started with" in repair.describe()


# --- execute -------------------------------------------------------------------------------------


NEW_HELLO_MSG: dict[str, Any] = {
    "type": "hello", "generation": NEW_GEN, "pid": NEW_PID, "start_id": NEW_START,
    "protocol": PROTO, "app_version": APP,
}


class FakeHooks:
    """Records every hook call (and every ``on_step``) in one ordered list."""

    def __init__(
        self,
        *,
        reprobe: Verdict | None = LOST,
        kill_ok: bool = True,
        ticket: str | None = TICKET,
        new_hello: dict[str, Any] | None = NEW_HELLO_MSG,
        launch_error: Exception | None = None,
    ) -> None:
        self._reprobe = reprobe
        self._kill_ok = kill_ok
        self._ticket = ticket
        self._new_hello = new_hello
        self._launch_error = launch_error
        self.calls: list[tuple[object, ...]] = []
        self.steps: list[tuple[Step, str]] = []

    def reprobe(self, sock: str) -> Verdict | None:
        self.calls.append(("reprobe", sock))
        return self._reprobe

    def kill(self, pid: int, start_id: str | None) -> bool:
        self.calls.append(("kill", pid, start_id))
        return self._kill_ok

    def launch(self, sock: str, ticket: str) -> None:
        self.calls.append(("launch", sock, ticket))
        if self._launch_error is not None:
            raise self._launch_error

    def wait_hello(self, sock: str, old_generation: str) -> dict[str, Any] | None:
        self.calls.append(("wait_hello", sock, old_generation))
        return self._new_hello

    def revoke(self, generation: str) -> None:
        self.calls.append(("revoke", generation))

    def remove_socket(self, sock: str) -> None:
        self.calls.append(("remove_socket", sock))

    def take_admission(self) -> str | None:
        self.calls.append(("take_admission",))
        return self._ticket

    def release_admission(self) -> None:
        self.calls.append(("release_admission",))

    def on_step(self, step: Step, text: str) -> None:
        self.calls.append(("on_step", step, text))
        self.steps.append((step, text))

    def hooks(self) -> Hooks:
        return Hooks(
            reprobe=self.reprobe, kill=self.kill, launch=self.launch, wait_hello=self.wait_hello,
            revoke=self.revoke, remove_socket=self.remove_socket,
            take_admission=self.take_admission, release_admission=self.release_admission,
        )

    def run(self, repair: Repair) -> Outcome:
        return execute(repair, self.hooks(), on_step=self.on_step)

    @property
    def hook_calls(self) -> list[tuple[object, ...]]:
        return [c for c in self.calls if c[0] != "on_step"]


WEDGED_LOST = Repair(socket=SOCK, verdict=LOST, steps=WEDGED_STEPS)
WEDGED_UNREACHABLE = Repair(socket=SOCK, verdict=UNREACHABLE, steps=WEDGED_STEPS)
ORPHAN_REPAIR = Repair(socket=SOCK, verdict=ORPHAN, steps=(Step.REPROBE_DEAD, Step.REMOVE_SOCKET))

SUCCESS_STEPS: list[tuple[Step, str]] = [
    (Step.PROVE_HOME, f"generation {GEN} belongs to this home"),
    (Step.TAKE_ADMISSION, "held"),
    (Step.REPROBE_SAME, f"generation {GEN} still ownership-lost"),
    (Step.REVOKE, f"tombstone written for generation {GEN}"),
    (Step.KILL, f"killed pid {PID}, exit confirmed"),
    (Step.REMOVE_SOCKET, "socket file removed"),
    (Step.RELAUNCH, "new supervisor launched on the same socket"),
    (Step.WAIT_HELLO, f"new supervisor pid {NEW_PID} answers (sessions are re-adopted)"),
    (Step.RELEASE_ADMISSION, "released"),
]


def test_wedged_repair_calls_the_hooks_in_order() -> None:
    fake = FakeHooks()
    outcome = fake.run(WEDGED_LOST)
    assert fake.hook_calls == [
        ("take_admission",),
        ("reprobe", SOCK),
        ("revoke", GEN),
        ("kill", PID, START),
        ("remove_socket", SOCK),
        ("launch", SOCK, TICKET),
        ("wait_hello", SOCK, GEN),
        ("release_admission",),
    ]
    assert outcome.ok is True
    assert outcome.failed is None


def test_wedged_repair_reports_each_step_as_it_completes() -> None:
    fake = FakeHooks()
    outcome = fake.run(WEDGED_LOST)
    assert fake.steps == SUCCESS_STEPS
    assert outcome.done == SUCCESS_STEPS
    # each on_step follows its own hook call, before the next step's hook
    assert fake.calls == [
        ("on_step", *SUCCESS_STEPS[0]),
        ("take_admission",), ("on_step", *SUCCESS_STEPS[1]),
        ("reprobe", SOCK), ("on_step", *SUCCESS_STEPS[2]),
        ("revoke", GEN), ("on_step", *SUCCESS_STEPS[3]),
        ("kill", PID, START), ("on_step", *SUCCESS_STEPS[4]),
        ("remove_socket", SOCK), ("on_step", *SUCCESS_STEPS[5]),
        ("launch", SOCK, TICKET), ("on_step", *SUCCESS_STEPS[6]),
        ("wait_hello", SOCK, GEN), ("on_step", *SUCCESS_STEPS[7]),
        ("release_admission",), ("on_step", *SUCCESS_STEPS[8]),
    ]


def test_wedged_unreachable_repair_accepts_a_still_unreachable_reprobe() -> None:
    fake = FakeHooks(reprobe=UNREACHABLE)
    outcome = fake.run(WEDGED_UNREACHABLE)
    assert outcome.ok is True
    assert outcome.done[2] == (Step.REPROBE_SAME, f"generation {GEN} still unreachable")
    assert [c[0] for c in fake.hook_calls] == [
        "take_admission", "reprobe", "revoke", "kill", "remove_socket", "launch", "wait_hello",
        "release_admission",
    ]


def test_wedged_repair_reprobe_may_see_the_same_generation_under_another_status() -> None:
    fake = FakeHooks(reprobe=replace(UNREACHABLE, cause="its supervisor is alive but does not"
                                     " listen"))
    assert fake.run(WEDGED_LOST).ok is True


def test_outcome_takes_the_new_identity_from_wait_hello() -> None:
    outcome = FakeHooks().run(WEDGED_LOST)
    assert (outcome.new_pid, outcome.new_generation) == (NEW_PID, NEW_GEN)


def test_kill_that_does_not_confirm_exit_aborts_before_the_socket() -> None:
    fake = FakeHooks(kill_ok=False)
    outcome = fake.run(WEDGED_LOST)
    failure = f"pid {PID} survived SIGKILL: socket and workers left as they are"
    assert fake.hook_calls == [
        ("take_admission",),
        ("reprobe", SOCK),
        ("revoke", GEN),
        ("kill", PID, START),
        ("release_admission",),
    ]
    assert outcome.failed == (Step.KILL, failure)
    assert outcome.ok is False
    assert outcome.done == SUCCESS_STEPS[:4]
    assert fake.steps[-1] == (Step.KILL, f"FAILED: {failure}")
    assert (outcome.new_pid, outcome.new_generation) == (None, None)


@pytest.mark.parametrize(
    ("pid", "start_id"), [(NEW_PID, NEW_START), (PID, START)], ids=["new-pid", "same-pid"]
)
def test_successor_on_the_socket_is_never_killed(pid: int, start_id: str) -> None:
    """A different generation is a successor, even under the same pid (e.g. one that re-exec'd)."""
    successor = replace(LOST, generation=NEW_GEN, pid=pid, start_id=start_id)
    fake = FakeHooks(reprobe=successor)
    outcome = fake.run(WEDGED_LOST)
    assert fake.hook_calls == [("take_admission",), ("reprobe", SOCK), ("release_admission",)]
    assert outcome.failed == (Step.REPROBE_SAME, (
        f"a different supervisor is there now (generation {NEW_GEN}): never kill a successor"))
    assert outcome.ok is False


def test_same_generation_under_another_pid_is_not_killed() -> None:
    fake = FakeHooks(reprobe=replace(LOST, pid=NEW_PID))
    outcome = fake.run(WEDGED_LOST)
    assert fake.hook_calls == [("take_admission",), ("reprobe", SOCK), ("release_admission",)]
    assert outcome.failed == (Step.REPROBE_SAME, (
        f"a different supervisor is there now (generation {GEN}): never kill a successor"))


@pytest.mark.parametrize(
    ("again", "word"),
    [
        (CURRENT, "current"),
        (replace(CURRENT, generation=NEW_GEN, pid=NEW_PID, start_id=NEW_START), "current"),
        (STARTING, "starting"),
        (STALE, "stale"),
        (ORPHAN, "orphan-file"),
        (None, "gone"),
    ],
    ids=["healed", "successor-current", "starting", "stale", "orphan-file", "gone"],
)
def test_no_longer_wedged_is_left_alone(again: Verdict | None, word: str) -> None:
    fake = FakeHooks(reprobe=again)
    outcome = fake.run(WEDGED_LOST)
    assert fake.hook_calls == [("take_admission",), ("reprobe", SOCK), ("release_admission",)]
    assert outcome.failed == (Step.REPROBE_SAME, f"no longer wedged ({word}): left alone")
    assert fake.steps[-1] == (Step.REPROBE_SAME, f"FAILED: no longer wedged ({word}): left alone")


def test_admission_held_elsewhere_stops_everything() -> None:
    fake = FakeHooks(ticket=None)
    outcome = fake.run(WEDGED_LOST)
    text = "another shutdown or doctor --fix holds the admission"
    assert fake.hook_calls == [("take_admission",)]
    assert outcome.failed == (Step.TAKE_ADMISSION, text)
    assert outcome.done == SUCCESS_STEPS[:1]
    assert fake.steps == [SUCCESS_STEPS[0], (Step.TAKE_ADMISSION, f"FAILED: {text}")]
    assert outcome.ok is False


def test_new_supervisor_that_never_answers_is_reported_and_admission_released() -> None:
    fake = FakeHooks(new_hello=None)
    outcome = fake.run(WEDGED_LOST)
    assert fake.hook_calls[-3:] == [
        ("launch", SOCK, TICKET), ("wait_hello", SOCK, GEN), ("release_admission",)
    ]
    assert fake.hook_calls.count(("release_admission",)) == 1
    assert outcome.failed == (Step.WAIT_HELLO,
                              "the new supervisor did not answer (see its daemon.log)")
    assert (outcome.new_pid, outcome.new_generation) == (None, None)


def test_a_hook_that_raises_still_releases_the_admission() -> None:
    fake = FakeHooks(launch_error=OSError("no such file"))
    with pytest.raises(OSError, match="no such file"):
        fake.run(WEDGED_LOST)
    assert fake.hook_calls[-2:] == [("launch", SOCK, TICKET), ("release_admission",)]
    assert ("wait_hello", SOCK, GEN) not in fake.hook_calls


def test_admission_is_released_exactly_once_on_success() -> None:
    fake = FakeHooks()
    fake.run(WEDGED_LOST)
    assert fake.hook_calls.count(("release_admission",)) == 1
    assert fake.hook_calls[-1] == ("release_admission",)


@pytest.mark.parametrize("repair", [
    Repair(socket=SOCK, verdict=replace(LOST, pid=None), declined=NO_IDENTITY),
    Repair(socket=SOCK, verdict=LOST, steps=WEDGED_STEPS, declined="home not proven"),
], ids=["declined", "declined-with-steps"])
def test_declined_repair_calls_no_hook(repair: Repair) -> None:
    fake = FakeHooks()
    outcome = fake.run(repair)
    assert fake.calls == []
    assert outcome.done == []
    assert outcome.failed is None
    assert outcome.ok is False


@pytest.mark.parametrize("again", [None, ORPHAN], ids=["gone", "still-orphan"])
def test_orphan_file_reprobe_then_remove(again: Verdict | None) -> None:
    fake = FakeHooks(reprobe=again)
    outcome = fake.run(ORPHAN_REPAIR)
    assert fake.hook_calls == [("reprobe", SOCK), ("remove_socket", SOCK)]
    assert fake.steps == [
        (Step.REPROBE_DEAD, "still nobody listening"),
        (Step.REMOVE_SOCKET, "socket file removed"),
    ]
    assert outcome.ok is True


@pytest.mark.parametrize(
    "again",
    [CURRENT, STARTING, LOST, UNREACHABLE, STALE],
    ids=["current", "starting", "ownership-lost", "unreachable", "stale"],
)
def test_orphan_file_is_not_removed_when_something_is_there_now(again: Verdict) -> None:
    fake = FakeHooks(reprobe=again)
    outcome = fake.run(ORPHAN_REPAIR)
    assert fake.hook_calls == [("reprobe", SOCK)]
    assert outcome.failed == (Step.REPROBE_DEAD, f"now {again.status}: left alone")
    assert outcome.ok is False


def test_outcome_as_json_success() -> None:
    outcome = FakeHooks().run(WEDGED_LOST)
    assert outcome.as_json() == {
        "steps": [{"step": str(s), "result": r} for s, r in SUCCESS_STEPS],
        "failed": None,
        "declined": None,
        "new_pid": NEW_PID,
        "new_generation": NEW_GEN,
    }
    assert outcome.as_json()["steps"][0] == {
        "step": "prove-home", "result": f"generation {GEN} belongs to this home"
    }


def test_outcome_as_json_failure() -> None:
    outcome = FakeHooks(kill_ok=False).run(WEDGED_LOST)
    assert outcome.as_json() == {
        "steps": [
            {"step": "prove-home", "result": f"generation {GEN} belongs to this home"},
            {"step": "take-admission", "result": "held"},
            {"step": "reprobe-same", "result": f"generation {GEN} still ownership-lost"},
            {"step": "revoke", "result": f"tombstone written for generation {GEN}"},
        ],
        "failed": {"step": "kill",
                   "result": f"pid {PID} survived SIGKILL: socket and workers left as they are"},
        "declined": None,
        "new_pid": None,
        "new_generation": None,
    }


def test_outcome_as_json_declined() -> None:
    repair = Repair(socket=SOCK, verdict=replace(LOST, pid=None), declined=NO_IDENTITY)
    assert FakeHooks().run(repair).as_json() == {
        "steps": [], "failed": None, "declined": NO_IDENTITY, "new_pid": None,
        "new_generation": None,
    }


# --- Found.as_json -------------------------------------------------------------------------------


# the instant ps reports at: every uptime is counted to it, never to the wall clock
NOW = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)


def _iso_ago(seconds: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds)).isoformat()


def test_found_as_json_shape() -> None:
    obs = replace(ANSWERING, is_default=True, hello_record=None, socket_records=(), sessions=2)
    found = Found(socket=SOCK, verdict=LOST, observation=obs, record=None, home_proven=True)
    assert found.as_json() == {
        "socket": SOCK,
        "status": "ownership-lost",
        "cause": "record-missing",
        "pid": PID,
        "generation": GEN,
        "app_version": APP,
        "protocol": PROTO,
        "sessions": 2,
        "uptime_s": None,
        "is_default": True,
        "remedy": LOST_FOOTER,
    }


def test_found_as_json_without_hello() -> None:
    obs = Observation(socket=OLD_SOCK, socket_file=True, accepts=False, sessions=1)
    found = Found(socket=OLD_SOCK, verdict=ORPHAN, observation=obs, record=None,
                  home_proven=False)
    assert found.as_json() == {
        "socket": OLD_SOCK, "status": "orphan-file", "cause": "nobody listens on it",
        "pid": None, "generation": None, "app_version": None, "protocol": None, "sessions": 1,
        "uptime_s": None, "is_default": False,
        "remedy": f"! {OLD_SOCK}: stale socket file — \"trio-agentd doctor --fix\" removes it",
    }


def test_found_as_json_uptime_from_the_record() -> None:
    rec = replace(REC, created_at=_iso_ago(90.25))
    found = Found(socket=SOCK, verdict=CURRENT, observation=ANSWERING, record=rec,
                  home_proven=True)
    assert found.as_json(now=NOW.timestamp())["uptime_s"] == 90.2
    assert found.as_json(now=NOW.timestamp() + 10)["uptime_s"] == 100.2


def test_found_as_json_uptime_accepts_z_and_ignores_garbage() -> None:
    rec_z = replace(REC, created_at=(NOW - dt.timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ"))
    found = Found(socket=SOCK, verdict=CURRENT, observation=ANSWERING, record=rec_z,
                  home_proven=True)
    assert found.as_json(now=NOW.timestamp())["uptime_s"] == 7200.0
    # another ISO 8601 shape (an offset other than UTC) is parsed too
    rec_offset = replace(REC, created_at="2026-03-01T11:00:00+01:00")
    assert replace(found, record=rec_offset).as_json(now=NOW.timestamp())["uptime_s"] == 7200.0
    for garbage in ("yesterday", "2026-03-01T10:00:00"):  # no zone: no instant
        bad = replace(found, record=replace(REC, created_at=garbage))
        assert bad.as_json(now=NOW.timestamp())["uptime_s"] is None


# --- print_table ---------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _table_found() -> list[Found]:
    current = Found(
        socket=SOCK, verdict=CURRENT,
        observation=replace(ANSWERING, is_default=True, sessions=3),
        record=replace(REC, created_at=_iso_ago(3 * 3600 + 30)), home_proven=True,
    )
    lost_hello = replace(HELLO, pid=77)
    lost = Found(
        socket=OTHER_SOCK, verdict=replace(LOST, pid=77),
        observation=Observation(socket=OTHER_SOCK, socket_file=True, accepts=True,
                                hello=lost_hello),
        record=None, home_proven=True,
    )
    orphan = Found(
        socket=OLD_SOCK, verdict=ORPHAN,
        observation=Observation(socket=OLD_SOCK, socket_file=True, accepts=False),
        record=None, home_proven=False,
    )
    return [current, lost, orphan]


def _row(*cells: str) -> str:
    # widths chosen by hand for _table_found(): the widest cell of each column
    widths = (1, 38, 4, 7, 34, 8, 6)
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


EXPECTED_TABLE = [
    _row("", "SOCKET", "PID", "VERSION", "STATUS", "SESSIONS", "UPTIME"),
    _row("*", SOCK, "4242", "0.1.0", "current", "3", "3h"),
    _row("", OTHER_SOCK, "77", "0.1.0", "ownership-lost (record-missing)", "0", "-"),
    _row("", OLD_SOCK, "-", "-", "orphan-file (nobody listens on it)", "0", "-"),
    f"! {OTHER_SOCK}: supervisor lost its ownership record — run \"trio-agentd doctor --fix\""
    " to restart it (sessions are preserved)",
    f"! {OLD_SOCK}: stale socket file — \"trio-agentd doctor --fix\" removes it",
]


def test_table_columns_marker_and_footers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    buf = io.StringIO()
    print_table(_table_found(), now=NOW.timestamp(), out=buf)
    assert buf.getvalue() == "\n".join(EXPECTED_TABLE) + "\n"


def test_table_is_aligned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    buf = io.StringIO()
    print_table(_table_found(), now=NOW.timestamp(), out=buf)
    lines = buf.getvalue().splitlines()
    header, rows = lines[0], lines[1:4]
    for column, values in [
        ("SOCKET", [SOCK, OTHER_SOCK, OLD_SOCK]),
        ("PID", ["4242", "77", "-"]),
        ("STATUS", ["current", "ownership-lost", "orphan-file"]),
        ("UPTIME", ["3h", "-", "-"]),
    ]:
        at = header.index(column)
        for row, value in zip(rows, values, strict=True):
            assert row[at:at + len(value)] == value
    assert [r[0] for r in rows] == ["*", " ", " "]


def test_table_writes_nothing_to_stdout_when_given_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stdout = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    print_table(_table_found(), now=NOW.timestamp(), out=io.StringIO())
    print_table([], out=io.StringIO())
    assert stdout.getvalue() == ""


def test_empty_table() -> None:
    buf = io.StringIO()
    print_table([], out=buf)
    assert buf.getvalue() == "no trio-agentd supervisor found\n"


def test_no_ansi_when_not_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.delenv("NO_COLOR", raising=False)
    buf = io.StringIO()
    print_table(_table_found(), now=NOW.timestamp(), out=buf)
    assert "\033" not in buf.getvalue()


def test_colour_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = _Tty()
    monkeypatch.setattr(sys, "stdout", tty)
    monkeypatch.delenv("NO_COLOR", raising=False)
    print_table(_table_found(), now=NOW.timestamp(), out=tty)
    lines = tty.getvalue().splitlines()
    assert "\033[32m" + "current".ljust(34) + "\033[0m" in lines[1]
    assert "\033[31m" + "ownership-lost (record-missing)".ljust(34) + "\033[0m" in lines[2]
    assert "\033[33m" + "orphan-file (nobody listens on it)" + "\033[0m" in lines[3]
    assert lines[4:] == [f"\033[31m{line}\033[0m" for line in EXPECTED_TABLE[4:]]


def test_no_colour_sets_no_ansi_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = _Tty()
    monkeypatch.setattr(sys, "stdout", tty)
    monkeypatch.setenv("NO_COLOR", "1")
    print_table(_table_found(), now=NOW.timestamp(), out=tty)
    assert tty.getvalue() == "\n".join(EXPECTED_TABLE) + "\n"


def test_no_ansi_into_a_non_tty_out_even_if_stdout_is_a_tty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "stdout", _Tty())
    monkeypatch.delenv("NO_COLOR", raising=False)
    buf = io.StringIO()
    print_table(_table_found(), now=NOW.timestamp(), out=buf)
    assert buf.getvalue() == "\n".join(EXPECTED_TABLE) + "\n"
