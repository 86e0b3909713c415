"""What autograd saves for backward: per node, per module, in bytes.

>>> import torch
>>> x = torch.randn(4, 8, requires_grad=True)
>>> saved_tensors_report(x.relu().sum()).kept_bytes     # relu keeps its 4 x 8 float32 output
128

Two ways to look, one report:

- :mod:`~ckptlib.inspect.report`: :class:`SavedTensor` (one row), :class:`ModuleTotals` and
  :class:`SavedTensorsReport`, the table ``print(report)`` shows, and how its totals count
  storages (each once; parameters and buffers left out; what checkpoints dropped);
- :mod:`~ckptlib.inspect.labels`: what both ways call what they find (a tensor's kind, the
  attribute, a region numbered per report);
- :mod:`~ckptlib.inspect.recording`: :func:`record_saved`, which watches a forward pass with a
  pack hook, module hooks and a ``TorchFunctionMode``, so each row names its module and torch
  function;
- :mod:`~ckptlib.inspect.walking`: :func:`saved_tensors_report`, which records a function, or
  walks a graph that already exists from its outputs (with :mod:`ckptlib.autograd_walk`, the
  walker :mod:`ckptlib.graph` draws with).

The layers import downwards only: ``report``, ``labels`` <- ``recording`` <- ``walking``.
"""

from ckptlib.inspect.recording import record_saved
from ckptlib.inspect.report import ModuleTotals, SavedTensor, SavedTensorsReport
from ckptlib.inspect.walking import Outputs as Outputs
from ckptlib.inspect.walking import saved_tensors_report

__all__ = [
    "SavedTensor",
    "SavedTensorsReport",
    "ModuleTotals",
    "record_saved",
    "saved_tensors_report",
]
