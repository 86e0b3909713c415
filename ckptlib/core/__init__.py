"""The mechanism: a hook-based, non-reentrant checkpoint, read in this order.

- ``checkpoint.py``: Holder, Frame (pack, unpack, recompute, rerun with ``fill``, release) and
  ``checkpoint()``, in the names and order of notebook 03; it calls its guards by name and its
  other observers (``observers.py``) at the same named points;
- ``inputs.py`` and ``autocast.py``: how the frame keeps its arguments for the rerun, and the
  forward's autocast state it reruns under;
- ``guards.py``: the observer that refuses a rerun which would differ from its forward, with
  ``keys.py`` (what each saved tensor is) and ``reads.py`` (what the region reads from outside);
- ``trace.py``: the observer that records what happened, as typed events;
- ``peek.py``: looking at what a checkpoint stored without recomputing it;
- ``compile.py``: running eagerly under ``torch.compile``;
- ``region.py`` and ``errors.py``: how a region is named, and what a user sees when it goes wrong.

RNG capture and replay is ``ckptlib/rng.py``; argument checks are ``ckptlib/_arguments.py``.
"""
