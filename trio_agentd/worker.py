"""``python -m trio_agentd.worker`` — a session worker (started by the supervisor only).

With ``--template`` it is the supervisor's fork template (``_forkserver``): each worker it
forks returns from ``serve_template()`` and runs ``main()`` as an exec'd worker does.
"""

import sys

from ._worker import main

if __name__ == "__main__":
    if sys.argv[1:] == ["--template"]:
        from ._forkserver import serve_template

        serve_template()
    main()
