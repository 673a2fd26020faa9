"""Importing trio without running ``ldconfig``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trio_agentd._trioimport import pthread_library


@pytest.mark.parametrize(("libc", "name"), [
    ("glibc 2.36", "libc.so.6"), ("glibc 2.34", "libc.so.6"), ("glibc 2.31", "libpthread.so.0"),
    ("glibc 3.0", "libc.so.6"), (None, None), ("", None), ("musl 1.2", None),
    ("glibc x.y", None), ("glibc", None),
])
def test_the_pthread_library_is_known_on_glibc_only(libc: str | None, name: str | None) -> None:
    assert pthread_library(libc) == name


_NO_CHILDREN = """
import subprocess, sys
def refuse(*args, **kwargs):
    raise AssertionError(f"a child process was started: {args[:1]}")
subprocess.Popen.__init__ = refuse
from trio_agentd._trioimport import import_trio
trio = import_trio()
import ctypes.util
from trio._core import _thread_cache
assert _thread_cache.set_os_thread_name is not None  # threads are still named
assert ctypes.util.find_library.__module__ == "ctypes.util"  # put back as it was
print("ok")
"""


@pytest.mark.skipif(pthread_library(getattr(__import__("os"), "confstr", lambda _: None)(
    "CS_GNU_LIBC_VERSION")) is None, reason="not glibc")
def test_import_trio_starts_no_process_and_trio_still_names_its_threads() -> None:
    cp = subprocess.run([sys.executable, "-c", _NO_CHILDREN], capture_output=True, text=True,
                        timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "ok"
