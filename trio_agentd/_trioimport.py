"""``import trio`` without the ``ldconfig -p`` it runs.

trio's thread cache names its threads through ``pthread_setname_np``, found at import with
``ctypes.util.find_library("pthread")``, which on Linux runs ``/sbin/ldconfig -p`` in a child
process and scans what it prints: a fork, an exec and a parse (3-18 ms of a loaded 2-core
machine, measured) in every process that imports trio. The supervisor and the fork template
both import trio on the way to the first prompt's answer. On glibc the library's name is
known without asking (``libc.so.6`` from 2.34 on, where libpthread was merged into it;
``libpthread.so.0`` before), so :func:`import_trio` answers that one question itself while
trio is imported; anything else (another libc, another name) goes to ``find_library``.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType


def pthread_library(glibc: str | None) -> str | None:
    """The pthread library's name for the C library ``glibc`` names (``os.confstr``'s
    ``CS_GNU_LIBC_VERSION``, e.g. ``"glibc 2.36"``); ``None`` when that is not glibc."""
    parts = (glibc or "").split()
    if len(parts) != 2 or parts[0] != "glibc":
        return None
    try:
        version = tuple(int(x) for x in parts[1].split(".")[:2])
    except ValueError:
        return None
    return "libc.so.6" if version >= (2, 34) else "libpthread.so.0"


def import_trio() -> ModuleType:
    """``import trio``, and return it; the pthread library's name, when it is known, is not
    looked for with ``ldconfig``."""
    if "trio" in sys.modules:
        return sys.modules["trio"]
    try:
        known = pthread_library(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):  # no such name here: not glibc
        known = None
    if known is None:
        import trio

        return trio
    import ctypes.util

    real = ctypes.util.find_library

    def find_library(name: str) -> str | None:
        return known if name == "pthread" else real(name)

    ctypes.util.find_library = find_library
    try:
        import trio
    finally:
        ctypes.util.find_library = real
    return trio
