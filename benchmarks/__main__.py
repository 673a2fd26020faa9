"""``python -m benchmarks [--quick]``: every figure, then ``docs/benchmarks.md`` (see ``run``)."""

import sys

from .run import main

sys.exit(main())
