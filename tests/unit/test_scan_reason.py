"""When ps/doctor add the process scan to what the files said (``scan_reason``). Pure.

The scan reads every process's ``/proc`` entry: it is the last line of discovery, for a
supervisor that lost the files that name it, and runs only when what the files and the
listening sockets say leaves room for one.
"""

from __future__ import annotations

from trio_agentd._doctor_plan import PROBLEMS, Status, scan_reason

OURS = ("/run/u/trio-agentd/daemon.sock", True, "ours")


def test_a_consistent_picture_is_not_scanned() -> None:
    assert scan_reason([Status.CURRENT], [OURS]) is None
    assert scan_reason([Status.CURRENT, Status.STARTING, Status.STOPPING, Status.STALE],
                       [OURS]) is None
    assert scan_reason([Status.CURRENT], []) is None  # e.g. another network namespace


def test_nothing_found_by_the_files_is_scanned() -> None:
    assert scan_reason([], [OURS]) == "no supervisor found by its files"
    assert scan_reason([], None) == "no supervisor found by its files"


def test_every_problem_is_scanned() -> None:
    for status in PROBLEMS:
        assert scan_reason([Status.CURRENT, status], [OURS]) == "a supervisor is not healthy"


def test_listeners_that_cannot_be_listed_are_scanned() -> None:
    assert scan_reason([Status.CURRENT], None) == "the listening sockets cannot be listed"


def test_a_listener_whose_socket_file_is_gone_is_scanned() -> None:
    gone = ("/tmp/x/other.sock", False, "gone")
    assert scan_reason([Status.CURRENT], [OURS, gone]) == (
        "a socket listens at /tmp/x/other.sock, whose file is gone")
    named_gone = ("/tmp/x/other.sock", True, "gone")
    assert scan_reason([Status.CURRENT], [named_gone]) is not None


def test_two_listeners_on_one_path_are_scanned() -> None:
    # the first one's file was deleted and the path bound again by a second supervisor
    assert scan_reason([Status.CURRENT], [OURS, OURS]) == (
        f"more than one socket listens at {OURS[0]}")


def test_a_socket_of_ours_that_no_file_names_is_scanned() -> None:
    unnamed = ("/elsewhere/other.sock", False, "ours")
    assert scan_reason([Status.CURRENT], [OURS, unnamed]) == (
        "a socket of ours listens at /elsewhere/other.sock, which no file names")


def test_another_users_socket_is_not_a_reason() -> None:
    theirs = ("/var/run/docker.sock", False, "foreign")
    assert scan_reason([Status.CURRENT], [OURS, theirs]) is None
