"""What autograd saved, as rows and totals: :class:`SavedTensor`, :class:`ModuleTotals` and
:class:`SavedTensorsReport`, printed as a table. Both ways of looking fill the same report.

Counting
========

A tensor is saved once per node that needs it, but memory holds storages: the
output of a ReLU saved by the ReLU and by the next Linear is one storage. Rows
list every save; totals count each storage once, at its full size (a saved
view keeps its whole base alive). Parameters and buffers are marked and left
out of the totals: they live anyway. Under a ckptlib checkpoint a save is
"dropped" (the checkpoint keeps only a handle) and the region's inputs are
"kept" as ``checkpoint`` / ``input`` rows; ``dropped_bytes`` counts the
storages that only dropped saves referenced, i.e. what the checkpoints freed.
Saves made under some other saved-tensor hook are "hooked": what is kept is up
to that hook.

Everything printed is deterministic: storages are numbered ``s0, s1, ...`` in
order of first appearance and checkpoint regions ``name#0, name#1, ...``
(:mod:`ckptlib.inspect.labels`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from ckptlib._arguments import got, integer
from ckptlib.core.errors import dims_text
from ckptlib.memory import format_bytes

__all__ = ["SavedTensor", "ModuleTotals", "SavedTensorsReport", "STATE"]

STATE = ("parameter", "buffer")  # saved, but alive anyway: left out of the totals


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved for backward (one row of a :class:`SavedTensorsReport`)."""

    module: str  # path of the module that was running ("" at top level or unknown)
    op: str  # torch function that saved it ("linear"); "" when unknown
    node: str  # autograd node holding it ("AddmmBackward0"); "?" when not found
    attribute: str  # name on the node (node._saved_mat1 -> "mat1")
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # this tensor's own elements
    storage: str  # "s0", "s1", ...: same label, same memory
    storage_bytes: int  # the whole storage it views (what keeping it costs)
    kind: str  # "activation", "parameter", "buffer", or "unknown" (see the notes)
    status: str  # "kept", "dropped" or "hooked"
    region: str = ""  # the checkpoint region it belongs to, if any

    def as_dict(self) -> dict[str, Any]:
        """The row with plain values (shape as a list, dtype as a string), e.g. for JSON."""
        row = dataclasses.asdict(self)
        row["shape"], row["dtype"] = list(self.shape), str(self.dtype).replace("torch.", "")
        return row


@dataclass(frozen=True)
class ModuleTotals:
    """Activation bytes saved while one module ran (each storage counted once)."""

    kept_bytes: int
    dropped_bytes: int
    tensors: int

    def __str__(self) -> str:
        return (
            f"kept {format_bytes(self.kept_bytes)}, dropped {format_bytes(self.dropped_bytes)} "
            f"({self.tensors} saves)"
        )


class SavedTensorsReport:
    """Rows of :class:`SavedTensor` with totals; ``print(report)`` shows a table.

    >>> import torch
    >>> from ckptlib.inspect import saved_tensors_report
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = x.relu()
    >>> z = (y * y).sum()             # y is saved twice (as self and as other): one storage
    >>> report = saved_tensors_report(z)
    >>> [(row.node, row.attribute, row.storage) for row in report.rows]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('MulBackward0', 'other', 's0'), ('MulBackward0', 'self', 's0'),
     ('ReluBackward0', 'result', 's0')]
    >>> report.kept_bytes             # 4 x 8 float32, once
    128
    """

    def __init__(self, rows: Sequence[SavedTensor] = ()) -> None:
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
            raise TypeError(
                f"SavedTensorsReport: rows must be a list of SavedTensor rows, {got(rows)}."
            )
        self.rows: list[SavedTensor] = list(rows)
        for position, row in enumerate(self.rows):
            if not isinstance(row, SavedTensor):
                raise TypeError(
                    f"SavedTensorsReport: rows must be SavedTensor rows (as saved_tensors_report "
                    f"makes them), but rows[{position}] is {got(row)[4:]}."
                )

    def _storages(self, status: str) -> dict[str, int]:
        """Storages of activations (not parameters or buffers) with a save of this status ->
        bytes."""
        return {
            row.storage: row.storage_bytes
            for row in self.rows
            if row.kind not in STATE and row.status == status
        }

    @property
    def kept_bytes(self) -> int:
        """Activation memory the saved tensors hold (each storage once)."""
        return sum(self._storages("kept").values())

    @property
    def dropped_bytes(self) -> int:
        """Activation memory only dropped saves referenced: what the checkpoints freed."""
        kept = self._storages("kept")
        return sum(
            size for storage, size in self._storages("dropped").items() if storage not in kept
        )

    @property
    def state_bytes(self) -> int:
        """Parameters and buffers that were saved (not in the totals: they live anyway)."""
        return sum(
            {row.storage: row.storage_bytes for row in self.rows if row.kind in STATE}.values()
        )

    def by_module(self, depth: int | None = None) -> dict[str, ModuleTotals]:
        """Totals per module path, cut to its first ``depth`` parts (``depth=2``: ``blocks.0``).

        A storage counts for the module whose save of it came first.
        """
        if depth is not None:
            integer(depth, "depth", least=1, where="by_module")
        owner: dict[str, str] = {}
        saves: dict[str, int] = {}
        for row in self.rows:
            if row.kind in STATE:
                continue
            module = ".".join(row.module.split(".")[:depth]) if depth is not None else row.module
            owner.setdefault(row.storage, module)
            saves[module] = saves.get(module, 0) + 1
        kept, dropped = self._storages("kept"), self._storages("dropped")
        totals = {}
        for module, count in saves.items():
            mine = [storage for storage, where in owner.items() if where == module]
            totals[module] = ModuleTotals(
                sum(kept[s] for s in mine if s in kept),
                sum(dropped[s] for s in mine if s in dropped and s not in kept),
                count,
            )
        return totals

    def records(self) -> list[dict[str, Any]]:
        """Machine-readable rows (plain values), in the order autograd saved them."""
        return [row.as_dict() for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        columns = [
            "module",
            "op",
            "node",
            "saved",
            "shape",
            "dtype",
            "bytes",
            "storage",
            "kind",
            "status",
        ]
        with_region = any(row.region for row in self.rows)
        if with_region:
            columns.append("region")
        table = [columns]
        for row in self.rows:
            cells = [
                row.module or "-",
                row.op or "-",
                row.node,
                row.attribute,
                dims_text(row.shape),
                str(row.dtype).replace("torch.", ""),
                format_bytes(row.nbytes),
                row.storage,
                row.kind,
                row.status,
            ]
            table.append(cells + [row.region or "-"] if with_region else cells)
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
            for line in table
        ]
        kept = self._storages("kept")
        lines.append(f"activations kept: {format_bytes(self.kept_bytes)} in {len(kept)} storages")
        if any(row.status == "dropped" for row in self.rows):
            lines.append(f"activations dropped by checkpoints: {format_bytes(self.dropped_bytes)}")
        if self.state_bytes:
            lines.append(
                f"parameters and buffers saved: {format_bytes(self.state_bytes)} "
                "(not counted: they live anyway)"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"SavedTensorsReport({len(self.rows)} saved tensors, "
            f"kept {format_bytes(self.kept_bytes)}, "
            f"dropped {format_bytes(self.dropped_bytes)})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Jupyter shows the table when the report is a cell's last expression.
        printer.text(str(self))
