"""One colour vocabulary for every picture: widgets, ckptlib.graph, plan diagrams and figures/.

A learner who has learnt "purple means recomputed" in one picture must be able to read it in
every other. So each meaning has one colour, defined here and nowhere else:

- phases of a training step: ``FORWARD`` (blue), ``BACKWARD`` (orange), ``RECOMPUTE``
  (purple: the rerun of a checkpointed forward);
- what happens to a saved tensor: ``SAVED`` (green: kept by autograd), ``DROPPED`` (drawn
  hollow with a dashed ``DROPPED`` border: a checkpoint did not keep it), ``RECOMPUTED``
  (light purple: brought back by a rerun), ``RELEASED`` (light grey: freed after its use);
- ``LIMIT`` (red) is a memory limit and nothing else; ``HIGHLIGHT`` marks "this one" (the
  current setting, the cursor); ``MUTED`` is for references and context.

Values are hex strings, so matplotlib, Graphviz and HTML all take them as they are.
"""
from __future__ import annotations

FORWARD = "#4C72B0"
BACKWARD = "#DD8452"
RECOMPUTE = "#8172B3"

SAVED = "#55A868"
DROPPED = "#8C8C8C"
RECOMPUTED = "#CDBCE6"
RELEASED = "#E3E3E3"

LIMIT = "#C44E52"
HIGHLIGHT = "#222222"
MUTED = "#8C8C8C"

PHASES = {"forward": FORWARD, "backward": BACKWARD, "recompute": RECOMPUTE}
STATES = {"saved": SAVED, "dropped": DROPPED, "recomputed": RECOMPUTED, "released": RELEASED}

# One font family for every picture (matplotlib and Graphviz both have DejaVu Sans here).
FONT_FAMILY = "DejaVu Sans"
