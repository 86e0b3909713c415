"""``python -m ckptlib.bench``: see ``ckptlib/bench/cli.py``, and ``--help``."""
import sys

from ckptlib.bench.cli import main

sys.exit(main())
