"""Widgets for JupyterLab, one module per widget: watch memory, step through backward, explore
schedules.

* :class:`MemoryDashboard` (``dashboard``): toggle checkpointing on a small Transformer
  and watch what one training step holds, op by op.
* :class:`BackwardStepper` (``stepper``): one training step replayed event by event,
  every saved tensor on the autograd graph in its state at that moment.
* :class:`ScheduleExplorer` (``schedules``): a checkpointing schedule for a chain of
  layers, its picture, its measured peak and forward calls beside the theory's.
* :class:`PolicyExplorer` (``policies``): tick the ops of a Transformer block whose
  outputs a selective checkpoint keeps; bytes kept and rerun time against the extremes.

Each widget is plain Python state plus ``ipywidgets`` controls: set a control's
``.value`` and read the widget's attributes, in a test as in a notebook.
"""
from ckptlib.widgets.dashboard import MemoryDashboard
from ckptlib.widgets.policies import PolicyExplorer
from ckptlib.widgets.schedules import ScheduleExplorer
from ckptlib.widgets.stepper import BackwardStepper

__all__ = ["MemoryDashboard", "BackwardStepper", "ScheduleExplorer", "PolicyExplorer"]
