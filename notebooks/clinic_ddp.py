"""Two DDP ranks on this machine for the clinic's DDP case (notebook 10): gloo over 127.0.0.1.

The ranks are fresh processes (``torch.multiprocessing``, start method "spawn"): forking a
Jupyter kernel that has already run torch can hang the children. They meet through a file in a
temporary folder (``FileStore``), not a TCP port: no port to find free, no store server thread.
A spawned process cannot receive a function defined in the notebook, so each variant travels as
its source text: a function ``run_block(block, x)`` (any name) that runs ``block`` on ``x``,
written with ``torch``, ``nn``, ``F``, ``ckptlib`` and ``torch_checkpoint`` only.

For example ``run_ddp({"plain": plain_block, "mine": my_block})``, with functions defined in the
notebook, gives ``[rank 0's results, rank 1's]``, each ``{"plain": [gradients], "mine": ...}``
(tests/notebooks/test_nb10.py runs it).
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import sys
import tempfile
import textwrap
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckptlib

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 30   # a collective waiting on a failed peer ends instead of hanging


class DDPNet(nn.Module):
    """stem -> block (run by ``run_block``, e.g. under a checkpoint) -> head."""

    def __init__(self, run_block: Callable):
        super().__init__()
        torch.manual_seed(0)   # the same weights in every rank and every variant
        self.stem, self.head = nn.Linear(8, 8), nn.Linear(8, 1)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.run_block = run_block

    def forward(self, x):
        return self.head(self.run_block(self.block, self.stem(x)))


def source_of(fn: Callable | str) -> str:
    """A variant as source text: a string as it is, a function by its source."""
    return fn if isinstance(fn, str) else textwrap.dedent(inspect.getsource(fn))


def _compiled(source: str) -> Callable:
    """The one function the source defines, with the names a variant may use."""
    given = {"torch": torch, "nn": nn, "F": F, "ckptlib": ckptlib,
             "torch_checkpoint": torch_checkpoint}
    namespace = dict(given)
    exec(compile(source, "<variant>", "exec"), namespace)
    defined = [value for key, value in namespace.items()
               if key not in given and inspect.isfunction(value)]
    if len(defined) != 1:
        raise ValueError("a variant's source must define one function, "
                         f"it defines {len(defined)}:\n{source}")
    return defined[0]


def _worker(rank: int, variants: dict[str, str], out_dir: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "store"),
                            rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    results: dict[str, object] = {}
    try:
        # put a failing variant last: its ranks may be out of step
        for name, source in variants.items():
            try:
                model = nn.parallel.DistributedDataParallel(DDPNet(_compiled(source)),
                                                            find_unused_parameters=True)
                torch.manual_seed(rank)   # each rank its own batch
                model(torch.randn(4, 8)).sum().backward()
                results[name] = [p.grad.clone() for p in model.parameters()]
            except RuntimeError as error:
                results[name] = str(error).split(". ")[0]
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    # The results are on disk and the group is gone: leave without the interpreter's teardown.
    # There, with a TCP store, 3 runs in 120 had a rank abort after every line above had run
    # ("terminate called without an active exception": a C++ thread torch had not joined).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _quiet_ranks():
    """The ranks inherit this process's stderr, which a notebook shows: keep torch's C++ warnings
    (DDP's "find_unused_parameters=True was specified ...") out of it. Read when torch starts."""
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = before


def run_ddp(variants: dict[str, Callable | str], timeout_s: float = 120) -> list[dict[str, object]]:
    """Run each variant in 2 gloo ranks; per rank, {name: parameter gradients, or the error's first
    sentence}."""
    sources = {name: source_of(fn) for name, fn in variants.items()}
    with tempfile.TemporaryDirectory() as out_dir, _quiet_ranks():
        ranks = mp.start_processes(_worker, args=(sources, out_dir),
                                   nprocs=WORLD_SIZE, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ranks.join(timeout=1):
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    if process.is_alive():
                        process.terminate()
                raise TimeoutError(f"the {WORLD_SIZE} ranks did not finish within "
                                   f"{timeout_s:.0f} s; terminated them")
        return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(WORLD_SIZE)]
