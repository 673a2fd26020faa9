"""A stand-in session for the peer benchmarks: an idle process that lives until killed.

argv: RUN_DIR NAME — only so that the benchmark can find (and kill) exactly what it started.
"""

import signal

while True:
    signal.pause()
