"""``python -m benchmarks.bench``: see ``benchmarks/bench/cli.py``, and ``--help``."""

import sys

from benchmarks.bench.cli import main

sys.exit(main())
