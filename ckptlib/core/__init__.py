"""The mechanism: a hook-based, non-reentrant checkpoint. One checkpoint call reads in four files:

- ``checkpoint.py``: notebook 03's checkpoint, step by step (its opening comment maps the
  notebook's cell to the code): Holder, Frame (pack, unpack, recompute with ``Fill``, release),
  the observers, ``checkpoint()``;
- ``../rng.py``: capture and replay of the random-number generators (step 3);
- ``checks.py``: the checks that refuse a rerun which would differ (step 6), and ``reachable``,
  the one walk of what a function can reach;
- ``errors.py``: the exception and every message.

Beside them, used only when asked for: ``trace.py`` (the observer that records what happened),
``peek.py`` (reading what a checkpoint stored without recomputing), ``compile.py`` (running
eagerly under ``torch.compile``).
"""
