"""A worker sent ``SIGKILL`` a moment ago is not handed out (trio_agentd._procops): the signal
shows pending in ``/proc/<pid>/status`` before the process has run to act on it."""

from __future__ import annotations

import os
import signal

from trio_agentd._procops import kill_pending, sigkill_in_status


def _status(sigpnd: int, shdpnd: int) -> bytes:
    return (b"Name:\tpython3\nState:\tR (running)\n"
            + f"SigQ:\t0/63470\nSigPnd:\t{sigpnd:016x}\nShdPnd:\t{shdpnd:016x}\n".encode()
            + b"SigBlk:\t0000000000000000\nSigIgn:\t0000000001001000\n")


def test_sigkill_pending_for_the_thread_or_the_process_counts() -> None:
    bit = 1 << (signal.SIGKILL - 1)
    assert sigkill_in_status(_status(bit, 0))
    assert sigkill_in_status(_status(0, bit))
    assert sigkill_in_status(_status(bit | 1 << (signal.SIGTERM - 1), 0))


def test_other_pending_signals_and_blocked_ones_do_not() -> None:
    assert not sigkill_in_status(_status(0, 0))
    assert not sigkill_in_status(_status(1 << (signal.SIGTERM - 1), 1 << (signal.SIGINT - 1)))
    # SIGKILL's bit in another field (blocked, ignored) is not a pending kill
    text = _status(0, 0).replace(b"SigBlk:\t0000000000000000", b"SigBlk:\t0000000000000100")
    assert not sigkill_in_status(text)


def test_a_malformed_status_says_no() -> None:
    assert not sigkill_in_status(b"SigPnd:\tzz\n")
    assert not sigkill_in_status(b"SigPnd:\n")
    assert not sigkill_in_status(b"")


def test_a_running_process_and_a_gone_one_have_none_pending() -> None:
    assert not kill_pending(os.getpid())
    assert not kill_pending(2**22 + 1)  # above any pid_max: no such process
