"""ckptlib.memory: exact byte counts on cases worked out by hand, and the meter's mechanics.

The MLPChain formulas
=====================

``MLPChain(depth=D, width=W)`` on a batch of B rows, float32. Two sizes:

    a = 4*B*W          one activation (B x W)
    g = 4*W*W + 4*W    one layer's gradients (weight and bias)

What autograd keeps per block: ``Linear`` saves its input (mat1 of addmm) and
``ReLU`` saves its output, which is the next Linear's input: one storage of
``a`` bytes per block. The Linear's own output dies as soon as ReLU has read it.

Forward with the output kept (``out = model(x)``; x was made outside the block):

* plain: peak ``(D+1)*a`` (the D ReLU outputs, plus the last Linear's output
  while the last ReLU writes), then ``D*a`` stay.
* ``ckptlib.checkpoint`` over segments of k >= 2 blocks: each segment keeps
  only its input, so after segment j the kept inputs are ``(j-1)*a`` plus its
  output. Inside a segment three activations meet: the block input (held by
  ``nn.Sequential``'s loop variable, as nothing saves it), the Linear output and
  the ReLU output. Peak ``(D/k + 2)*a`` in the last segment; ``(D/k)*a`` stay.

A training step (``F.mse_loss(model(x), target).backward()``):

* ``mse_loss`` returns its 0-d loss inside the B x W buffer it reduced, so the
  loss holds ``a`` bytes until the step ends; backward starts with a 4-byte
  seed (``ones_like``) and ``mse_loss_backward`` makes an ``a``-byte gradient.
* plain, reaching layer i's ``threshold_backward`` (its ReLU gradient):
  ReLU outputs 1..i, the loss, the gradient arriving from above, the new one,
  the seed, and the gradients of layers i+1..D:
  ``(i+3)*a + 4 + (D-i)*g``. When ``a >= g`` (B > W) the first of these,
  i = D, is the peak: ``(D+3)*a + 4``. When ``g >= 2*a`` the peak is the very
  end, all gradients made: ``D*g + 2*a + 4`` (loss, the last ReLU gradient, seed).
* segments of k: backward reruns segment j (from the last) at the moment it
  is reached: kept inputs ``(j-1)*a``, the loss, the arriving gradient, the k
  recomputed ReLU outputs plus the last Linear output (early stop drops it only
  after the last ReLU output is packed), the seed and ``(D - j*k)`` layers of
  gradients: ``(j+k+2)*a + 4 + (D-j*k)*g``; with ``a >= k*g`` the last segment
  (j = D/k) is the peak: ``(D/k + k + 2)*a + 4``. k = sqrt(D) minimises it.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ckptlib import checkpoint
from ckptlib.memory import MemoryMeter, MemoryReport, TimelineEntry, format_bytes, measure
from ckptlib.models import MLPChain, TinyTransformer


def sizes(depth: int, width: int, batch: int) -> tuple[int, int]:
    return 4 * batch * width, 4 * width * width + 4 * width


def segmented(model: MLPChain, x: torch.Tensor, k: int, checkpoint_fn=checkpoint) -> torch.Tensor:
    for start in range(0, model.depth, k):
        x = checkpoint_fn(model.blocks[start : start + k], x)
    return x


def torch_non_reentrant(fn, x):
    return torch_checkpoint(fn, x, use_reentrant=False)


# ---------------------------------------------------------------------------
# exact peaks on MLPChain
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth, width, batch", [(6, 8, 64), (8, 4, 64), (4, 32, 8), (3, 16, 4)])
def test_plain_forward_keeps_one_activation_per_block(depth, width, batch):
    a, _ = sizes(depth, width, batch)
    model = MLPChain(depth, width)
    x, _ = model.example_batch(batch)
    kept = []
    report = measure(lambda: kept.append(model(x)))
    assert report.peak_bytes == (depth + 1) * a
    assert report.retained_bytes == depth * a


@pytest.mark.parametrize("depth, k", [(6, 2), (6, 3), (8, 4), (12, 3)])
def test_segmented_forward_keeps_segment_inputs(depth, k):
    width, batch = 8, 16
    a, _ = sizes(depth, width, batch)
    model = MLPChain(depth, width)
    x, _ = model.example_batch(batch)
    kept = []
    report = measure(lambda: kept.append(segmented(model, x, k)))
    assert report.peak_bytes == (depth // k + 2) * a
    assert report.retained_bytes == (depth // k) * a


@pytest.mark.parametrize("depth, width, batch", [(6, 8, 64), (8, 4, 64), (12, 4, 128)])
def test_plain_training_step_peak_activation_bound(depth, width, batch):
    a, g = sizes(depth, width, batch)
    assert a >= g
    model = MLPChain(depth, width)
    step = model.example_batch(batch)
    report = measure(lambda: model.training_step(step))
    assert report.peak_bytes == (depth + 3) * a + 4
    assert report.retained_bytes == depth * g  # the gradients stay after the step


@pytest.mark.parametrize("depth, width, batch", [(3, 16, 4), (4, 32, 8), (6, 64, 8)])
def test_plain_training_step_peak_gradient_bound(depth, width, batch):
    a, g = sizes(depth, width, batch)
    assert g >= 2 * a
    model = MLPChain(depth, width)
    step = model.example_batch(batch)
    assert measure(lambda: model.training_step(step)).peak_bytes == depth * g + 2 * a + 4


def _segmented_step_peak(checkpoint_fn, depth, width, batch, k) -> int:
    model = MLPChain(depth, width)
    x, target = model.example_batch(batch)

    def step():
        model.zero_grad(set_to_none=True)
        F.mse_loss(segmented(model, x, k, checkpoint_fn), target).backward()

    return measure(step).peak_bytes


SEGMENTED_CASES = [(6, 8, 64, 2), (6, 8, 64, 3), (8, 4, 64, 2), (12, 4, 128, 3), (12, 4, 128, 4)]


@pytest.mark.parametrize(
    "checkpoint_fn", [checkpoint, torch_non_reentrant], ids=["ckptlib", "torch"]
)
@pytest.mark.parametrize("depth, width, batch, k", SEGMENTED_CASES)
def test_segmented_training_step_peak(checkpoint_fn, depth, width, batch, k):
    a, g = sizes(depth, width, batch)
    assert a >= k * g
    peak = _segmented_step_peak(checkpoint_fn, depth, width, batch, k)
    assert peak == (depth // k + k + 2) * a + 4


def test_checkpointing_a_whole_chain_recomputes_it_all():
    # One segment (k = D): the rerun rebuilds every activation, as plain autograd kept them.
    depth, width, batch = 6, 8, 64
    a, _ = sizes(depth, width, batch)
    assert _segmented_step_peak(checkpoint, depth, width, batch, depth) == (depth + 3) * a + 4


def test_sqrt_segments_minimise_the_step_peak():
    depth, width, batch = 12, 4, 128
    peaks = {
        k: _segmented_step_peak(torch_non_reentrant, depth, width, batch, k)
        for k in (2, 3, 4, 6, 12)
    }
    assert min(peaks, key=peaks.get) in (3, 4)  # sqrt(12) = 3.46
    assert peaks[3] < peaks[2] < peaks[12] and peaks[4] < peaks[6] < peaks[12]


# ---------------------------------------------------------------------------
# what counts as an allocation
# ---------------------------------------------------------------------------


def test_views_and_inplace_results_allocate_nothing():
    x = torch.randn(64, 32)
    with MemoryMeter() as meter:
        x.t().reshape(32, 64)[3:5].unsqueeze(0).expand(4, 2, 64)
        x.view(-1).narrow(0, 0, 10).mul_(2.0)
        torch.ops.aten._unsafe_view(x, [2048])  # aliases x though its schema does not say so
        x.detach()
    assert meter.peak_bytes == 0
    assert {entry.live_bytes for entry in meter.timeline} == {0}


def test_a_copy_allocates_its_storage_once():
    x = torch.randn(64, 32)
    with MemoryMeter() as meter:
        y = x.t().contiguous()  # one 8 KiB copy
        z = y.view(-1)  # same storage: not counted again
    assert meter.peak_bytes == meter.live_bytes == 64 * 32 * 4
    del y, z


def test_outputs_of_multi_output_ops_are_all_counted():
    x = torch.randn(10, 3)
    with MemoryMeter() as meter:
        values, indices = torch.max(x, dim=0)
    assert meter.live_bytes == 3 * 4 + 3 * 8  # float32 values, int64 indices
    del values, indices


def test_storage_bytes_not_element_bytes_are_counted():
    # mse_loss's 0-d result lives in the full-size buffer it reduced: the meter reports
    # the memory held (256 bytes), not the one element the tensor shows.
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    with MemoryMeter() as meter:
        loss = F.mse_loss(x, y)
    assert loss.numel() == 1 and meter.live_bytes == 4 * 16 * 4


def test_tensors_made_before_the_block_are_invisible():
    x = torch.randn(1000)
    with MemoryMeter() as meter:
        del x  # frees memory the meter never counted
        gc.collect()
    assert meter.baseline_bytes == 0 and meter.peak_bytes == 0 and meter.live_bytes == 0


def test_meta_tensors_take_no_memory():
    with MemoryMeter() as meter:
        t = torch.empty(1 << 20, device="meta") * 2
    assert t.device.type == "meta" and meter.peak_bytes == 0


def test_device_filter_counts_only_that_device():
    with MemoryMeter(device="cpu") as on_cpu, MemoryMeter(device="meta") as on_meta:
        t = torch.ones(100)
    assert (on_cpu.live_bytes, on_meta.live_bytes) == (400, 0)
    del t


def test_measure_drops_the_result_and_reports_peak():
    x = torch.randn(1000)
    report = measure(lambda: x.exp().sum())
    assert isinstance(report, MemoryReport)
    assert report.peak_bytes == 4004 and report.retained_bytes == 0
    assert [entry.op for entry in report.timeline] == ["exp", "sum"]


# ---------------------------------------------------------------------------
# phases and the timeline
# ---------------------------------------------------------------------------


def test_phases_plain_vs_ckptlib_vs_torch_checkpoint():
    model = MLPChain(4, 8)
    batch = model.example_batch(16)
    phases = {}
    for mode in ("none", "block", "torch"):
        model.checkpointing = mode
        report = measure(lambda: model.training_step(batch))
        phases[mode] = {entry.phase for entry in report.timeline}
    assert phases["none"] == {"forward", "backward"}
    assert phases["block"] == {"forward", "backward", "recompute"}
    # torch.utils.checkpoint gives no public "recomputing" flag: its reruns show as backward.
    assert phases["torch"] == {"forward", "backward"}


def test_recompute_entries_rerun_the_forward_ops():
    model = MLPChain(3, 8, checkpointing="block")
    batch = model.example_batch(4)
    report = measure(lambda: model.training_step(batch))
    recomputed = [entry.op for entry in report.timeline if entry.phase == "recompute"]
    assert recomputed.count("addmm") == 3 and recomputed.count("relu") == 3


def test_timeline_is_indexed_and_peak_is_its_maximum():
    model = MLPChain(4, 16)
    batch = model.example_batch(8)
    report = measure(lambda: model.training_step(batch))
    assert [entry.index for entry in report.timeline] == list(range(len(report.timeline)))
    assert max(entry.live_bytes for entry in report.timeline) == report.peak_bytes
    assert report.peak_by_phase["backward"] == report.peak_bytes
    assert report.peak_by_phase["forward"] < report.peak_bytes


def test_timeline_grows_while_the_block_runs_and_on_op_sees_each_entry():
    seen: list[TimelineEntry] = []
    x = torch.randn(100)
    with MemoryMeter(on_op=seen.append) as meter:
        y = x * 2
        length_inside = len(meter.timeline)
        live_inside = meter.live_bytes
        z = y + 1
    assert length_inside == 1 and live_inside == 400
    assert seen == meter.timeline and [entry.op for entry in seen] == ["mul", "add"]
    del y, z


def test_peaks_fall_with_checkpointing():
    model = TinyTransformer(depth=4, d_model=32, heads=2, seq=32, vocab=64)
    batch = model.example_batch(batch=8)
    peaks = {}
    for mode in ("none", "block", "torch", "sqrt"):
        model.checkpointing = mode
        peaks[mode] = measure(lambda: model.training_step(batch)).peak_bytes
    assert peaks["block"] < 0.6 * peaks["none"]
    assert peaks["torch"] < 0.6 * peaks["none"]
    assert peaks["sqrt"] < peaks["none"]


# ---------------------------------------------------------------------------
# baseline, re-entry, nesting, clean exit
# ---------------------------------------------------------------------------


def test_baseline_of_a_reentered_meter_is_what_it_still_sees():
    model = MLPChain(3, 8)
    batch = model.example_batch(16)
    _, g = sizes(3, 8, 16)
    meter = MemoryMeter()
    with meter:
        model.training_step(batch)
    first = meter.report()
    assert first.baseline_bytes == 0 and first.retained_bytes == 3 * g
    with meter:
        model.training_step(batch)  # zero_grad frees the old gradients
    second = meter.report()
    assert second.baseline_bytes == 3 * g  # the first step's gradients, still alive
    assert second.retained_bytes == 0  # new gradients replaced them, byte for byte
    assert second.peak_bytes == first.peak_bytes - 3 * g


def test_nested_meters_both_count():
    x = torch.randn(256)
    with MemoryMeter() as outer:
        a = x * 2
        with MemoryMeter() as inner:
            b = x * 3
        del a
    assert (outer.peak_bytes, inner.peak_bytes) == (2048, 1024)
    assert (outer.live_bytes, inner.live_bytes) == (1024, 1024)
    del b


def test_meter_leaves_no_mode_behind_after_an_error():
    with pytest.raises(ZeroDivisionError):
        with MemoryMeter():
            torch.ones(3) * 2
            1 / 0
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_running_meter_cannot_be_entered_twice():
    meter = MemoryMeter()
    with meter:
        with pytest.raises(RuntimeError, match="already running"):
            meter.__enter__()


def test_bad_backends_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="'allocator' .*'tensors'"):
        MemoryMeter(backend="psutil")
    with pytest.raises(ValueError, match="device='cuda'"):
        MemoryMeter(backend="allocator")


def test_report_str_and_format_bytes():
    report = measure(lambda: torch.ones(256).sum())
    assert str(report) == (
        "peak 1.00 KiB above a baseline of 0 B; 0 B still live at the end "
        "(tensors meter on all devices; ops: 2 forward)"
    )
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(-2048) == "-2.00 KiB"


# ---------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------


def test_backward_on_cpu_runs_in_the_calling_thread_and_is_seen():
    x = torch.randn(32, 32, requires_grad=True)
    with MemoryMeter() as meter:
        x.sin().sum().backward()
    backward_ops = [entry.op for entry in meter.timeline if entry.phase == "backward"]
    assert "mul" in backward_ops or "cos" in backward_ops
    del x.grad


def test_storages_freed_in_another_thread_are_subtracted():
    with MemoryMeter() as meter:
        box = [torch.ones(1000)]
        worker = threading.Thread(target=box.clear)
        worker.start()
        worker.join()
    assert meter.peak_bytes == 4000 and meter.live_bytes == 0


def test_ops_in_a_thread_without_the_meter_are_not_seen():
    # Dispatch modes are thread-local: a backward started from another Python thread runs
    # without the meter (autograd only carries modes into its own worker threads). What that
    # thread frees is still subtracted, so the live count stays right.
    x = torch.randn(64, requires_grad=True)
    with MemoryMeter() as meter:
        y = x.exp()  # saves its result: 256 bytes
        ops_before = len(meter.timeline)
        worker = threading.Thread(target=lambda: y.sum().backward())  # noqa: F821 (y is deleted after)
        worker.start()
        worker.join()
        del y  # the graph was freed by that backward
    assert len(meter.timeline) == ops_before
    assert meter.live_bytes == 0
    assert x.grad is not None


# ---------------------------------------------------------------------------
# CUDA: the allocator backend against the tensor meter (skipped without a GPU)
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocator_and_tensor_meter_agree_on_cuda():
    torch.cuda.init()
    model = TinyTransformer().cuda()
    batch = model.example_batch()
    model.training_step(batch)
    for mode in ("none", "block"):
        model.checkpointing = mode
        allocator = measure(lambda: model.training_step(batch), device="cuda")
        tensors = measure(lambda: model.training_step(batch), device="cuda", backend="tensors")
        assert allocator.backend == "allocator" and tensors.backend == "tensors"
        assert abs(allocator.peak_bytes - tensors.peak_bytes) <= 0.02 * allocator.peak_bytes
        assert {entry.phase for entry in allocator.timeline} >= {"forward", "backward"}
