from __future__ import annotations

import signal

# Tests send SIGINT (Ctrl-C) to the processes they start. A test run started in the background
# by a non-interactive shell (`.ci/run &`) inherits SIGINT ignored, and every process it starts
# would inherit that too, so a CLI under test could not be interrupted: give the run, and so
# its children, the default disposition.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
