"""BackwardStepper without a browser: frames, states and live bytes of one replayed training
step."""

from __future__ import annotations

import base64
import re

import pytest
import torch

from ckptlib import palette

from ckptlib import apply_checkpointing, checkpoint, measure, revolve
from ckptlib.memory import MemoryMeter
from ckptlib.models import MLPChain, TinyTransformer
from ckptlib.widgets import BackwardStepper
from tests._models import hf_gpt2, hf_llama

FRAME_KEYS = {"event", "phase", "text", "live_bytes", "tensor", "region", "op", "states"}
TRACE_KINDS = {"pack", "forward_done", "recompute", "early_stop", "unpack", "release"}
OP_EVENTS = {"forward_op", "recompute_op", "backward_op"}


def step_peak(model: torch.nn.Module, batch: int = 2) -> int:
    data = model.example_batch(batch=batch)
    return measure(lambda: model.training_step(data)).peak_bytes


def histories(stepper: BackwardStepper) -> dict[str, list[str]]:
    """Each saved tensor's states, in order, without repeats."""
    seen: dict[str, list[str]] = {}
    for frame in stepper.frames:
        for label, state in frame["states"].items():
            if not seen.get(label) or seen[label][-1] != state:
                seen.setdefault(label, []).append(state)
    return seen


@pytest.fixture(scope="module")
def blocks():
    model = MLPChain(depth=3, width=16, checkpointing="block")
    return model, BackwardStepper(model, batch=2)


def test_frames_have_the_documented_keys_and_kinds(blocks):
    _, stepper = blocks
    assert stepper.frames and all(set(frame) == FRAME_KEYS for frame in stepper.frames)
    assert {frame["event"] for frame in stepper.frames} <= TRACE_KINDS | OP_EVENTS
    assert {frame["phase"] for frame in stepper.frames} == {"forward", "recompute", "backward"}
    assert all(isinstance(frame["live_bytes"], int) for frame in stepper.frames)
    assert all(
        state in ("saved", "dropped", "recomputed", "released")
        for frame in stepper.frames
        for state in frame["states"].values()
    )


def test_per_block_checkpointing_reruns_each_block_once_and_releases_everything(blocks):
    model, stepper = blocks
    recomputes = [frame for frame in stepper.frames if frame["event"] == "recompute"]
    assert [frame["region"] for frame in recomputes] == ["block 2", "block 1", "block 0"]
    assert len(recomputes) == len(model.blocks)
    assert any("recomputed" in frame["states"].values() for frame in stepper.frames)
    assert "recomputed" not in stepper.frames[-1]["states"].values()
    assert set(stepper.frames[-1]["states"].values()) == {"released"}
    # Every tensor a checkpoint drops comes back once and is released after its single use.
    for label, states in histories(stepper).items():
        if "#" in label and label.startswith("block"):
            assert states == ["dropped", "recomputed", "released"], label


def test_the_largest_live_bytes_is_the_meters_peak_for_the_same_step(blocks):
    model, stepper = blocks
    assert (
        max(frame["live_bytes"] for frame in stepper.frames)
        == stepper.peak_bytes
        == step_peak(model)
    )


def test_rerun_packs_sit_inside_their_rerun_between_its_ops(blocks):
    _, stepper = blocks
    frames = stepper.frames
    start = next(i for i, frame in enumerate(frames) if frame["event"] == "recompute")
    end = next(
        i
        for i in range(start, len(frames))
        if frames[i]["event"] == "unpack" and frames[i]["phase"] == "backward"
    )
    rerun = frames[start:end]
    packs = [frame for frame in rerun if frame["event"] == "pack"]
    assert [frame["text"] for frame in packs] == [
        "block 2 rerun: packs tensor #0, 2x16 float32, 128 B",
        "block 2 rerun: packs tensor #1, 16x16 float32, 1.00 KiB",
        "block 2 rerun: packs tensor #2, 2x16 float32, 128 B",
    ]
    # relu saves its output: that pack comes after the rerun's relu, which made it.
    events = [frame["op"] or frame["event"] for frame in rerun]
    assert events.index("relu") < events.index("pack", events.index("addmm"))


def test_without_checkpointing_nothing_is_dropped_and_saved_tensors_are_released_in_backward():
    model = MLPChain(depth=3, width=16, checkpointing="none")
    stepper = BackwardStepper(model, batch=2)
    assert all("dropped" not in frame["states"].values() for frame in stepper.frames)
    assert not any(frame["event"] in ("recompute", "early_stop") for frame in stepper.frames)
    for label, states in histories(stepper).items():
        assert states == ["saved", "released"], label
    for frame in stepper.frames:
        if frame["event"] == "release":
            assert frame["phase"] == "backward"
    assert (
        stepper.peak_bytes
        == max(frame["live_bytes"] for frame in stepper.frames)
        == step_peak(model)
    )


def test_schedules_with_nested_checkpoints_place_every_rerun_pack():
    model = MLPChain(depth=4, width=16, checkpointing=revolve(4, 2))
    stepper = BackwardStepper(model, batch=2)
    texts = [frame["text"] for frame in stepper.frames]
    assert not any("not known" in text for text in texts)
    # The nested checkpoint is run again inside its parent's rerun, keeping nothing.
    assert any(
        text.startswith("layers[1:2] (rerun's copy) forward: drops tensor #0") for text in texts
    )
    assert any(
        text.startswith("layers[1:2] rerun: loads its input, layers[1:3] #0") for text in texts
    )
    assert set(stepper.frames[-1]["states"].values()) == {"released"}
    assert stepper.peak_bytes == step_peak(model)


def test_a_transformer_block_replays_with_the_same_peak():
    model = TinyTransformer(depth=2, d_model=16, heads=2, seq=8, vocab=20, checkpointing="block")
    stepper = BackwardStepper(model, batch=2, collapse="module")
    assert sum(frame["event"] == "recompute" for frame in stepper.frames) == 2
    assert stepper.peak_bytes == step_peak(model)
    assert "<svg" in stepper.svg(len(stepper.frames) // 2)


def test_a_function_with_a_checkpoint_inside():
    x = torch.randn(3, requires_grad=True)

    def fn(t):
        return checkpoint(lambda u: u.sin().exp(), t).cos()

    stepper = BackwardStepper(fn, x)
    events = [frame["event"] for frame in stepper.frames if frame["region"] == "<lambda>"]
    assert events[:3] == ["pack", "pack", "pack"] and events.count("recompute") == 1
    assert stepper.frames[0]["text"] == "<lambda> starts: keeps its input, 3 float32, 12 B"
    # The step ran for real: x.grad is d/dx cos(exp(sin x)).
    assert torch.allclose(x.grad, -(x.sin().exp().sin()) * x.sin().exp() * x.cos())
    x.grad = None
    assert stepper.peak_bytes == measure(lambda: fn(x).sum().backward()).peak_bytes


def test_a_selective_rerun_skips_ops_so_its_packs_are_shown_together_and_say_so():
    model = MLPChain(depth=2, width=8, checkpointing="selective")
    stepper = BackwardStepper(model, batch=2)
    reruns = [
        frame
        for frame in stepper.frames
        if frame["event"] == "pack" and frame["phase"] == "recompute"
    ]
    assert reruns and all(
        frame["text"].endswith(
            "(where in the rerun is not known: its ops differ from the forward's)"
        )
        for frame in reruns
    )
    assert set(stepper.frames[-1]["states"].values()) == {"released"}
    assert stepper.peak_bytes == step_peak(model)


def test_every_op_can_get_a_frame_and_the_curve_keeps_its_peak(blocks):
    model, folded = blocks
    everything = BackwardStepper(model, batch=2, all_ops=True)
    assert len(everything.frames) > len(folded.frames)
    assert max(f["live_bytes"] for f in everything.frames) == max(
        f["live_bytes"] for f in folded.frames
    )
    assert [f["text"] for f in everything.frames if not f["event"].endswith("_op")] == [
        f["text"] for f in folded.frames if not f["event"].endswith("_op")
    ]


def test_the_stepper_leaves_nothing_alive_but_the_gradients():
    # The forward-only pass drops its graph without a backward: a pack hook that stored the
    # tensor itself would keep saved outputs alive through a reference cycle.
    model = MLPChain(depth=3, width=16)
    with MemoryMeter() as meter:
        stepper = BackwardStepper(model, batch=2)
    gradient_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert meter.live_bytes == gradient_bytes
    stepper.close()


def test_position_drives_the_view(blocks):
    _, stepper = blocks
    last = len(stepper.frames) - 1
    assert (stepper.position.min, stepper.position.max, stepper.play.max) == (0, last, last)
    # The caption numbers events from 1 ("28/53"); a slider readout would show 27 beside it.
    assert not stepper.position.readout
    assert stepper.prev_button.disabled and not stepper.next_button.disabled
    first_graph, first_caption = stepper.graph_view.value, stepper.caption.value
    recomputed = next(
        i for i, frame in enumerate(stepper.frames) if "recomputed" in frame["states"].values()
    )
    stepper.position.value = recomputed
    assert stepper.frames[recomputed]["text"].replace(">", "&gt;") in stepper.caption.value
    assert f"<b>{recomputed + 1}/{last + 1}</b>" in stepper.caption.value
    assert (
        stepper.graph_view.value != first_graph
        and ": recomputed</title>" in stepper.graph_view.value
    )
    assert f'fill="{palette.RECOMPUTED}"' in stepper.graph_view.value
    stepper.next_button.click()
    assert stepper.position.value == recomputed + 1
    stepper.prev_button.click()
    stepper.prev_button.click()
    assert stepper.position.value == recomputed - 1
    stepper.position.value = last
    stepper.next_button.click()
    assert stepper.position.value == last and stepper.next_button.disabled
    stepper.position.value = 0
    assert stepper.caption.value == first_caption


def test_the_graph_at_a_frame_shows_each_saved_tensor_in_its_state(blocks):
    _, stepper = blocks
    last = stepper.graph_at(len(stepper.frames) - 1)
    statuses = {saved.status for node in last.nodes for saved in node.saved}
    assert statuses == {"freed"}
    regions = {saved.region for node in last.nodes for saved in node.saved if saved.region}
    assert regions == {"block 0", "block 1", "block 2"}
    first = stepper.graph_at(0)
    assert all(not node.saved for node in first.nodes)  # nothing is packed before the first event
    # The picture is the one layout, restyled: the same frame gives the same SVG.
    assert stepper.svg(3) == stepper.svg(3) != stepper.svg(len(stepper.frames) - 1)


def test_what_the_stepper_cannot_replay_is_a_clear_error():
    with pytest.raises(
        ValueError, match="checkpointing='torch' is torch.utils.checkpoint, which has no trace"
    ):
        BackwardStepper(MLPChain(depth=2, width=4, checkpointing="torch"))
    with pytest.raises(TypeError, match=r"Linear has no loss, example_batch, checkpointing"):
        BackwardStepper(torch.nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match="no input requires grad and fn uses no parameter that does"
    ):
        BackwardStepper(torch.sin, torch.randn(2))
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        BackwardStepper(MLPChain(depth=2, width=4), batch=0)
    with pytest.raises(TypeError, match="fn returned int"):
        BackwardStepper(lambda t: 3, torch.randn(2, requires_grad=True))


def test_display_gives_the_widget_view_and_a_stable_text(blocks):
    _, stepper = blocks
    bundle = stepper._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == (
        f"BackwardStepper({len(stepper.frames)} events, peak 3.44 KiB; event 1: "
        f"{stepper.frames[0]['text']})"
    )


def test_the_words_say_whose_memory_a_save_is_so_a_save_that_adds_no_bytes_is_explained():
    plain = BackwardStepper(MLPChain(depth=2, width=8), batch=4)
    frames = plain.frames
    nothing_extra = {
        plain.tensors[f["tensor"]]["attribute"]: f["text"]
        for f in frames
        if f["event"] == "pack" and f["text"].endswith("nothing extra")
    }
    # The batch (block 0's input, the loss's target) was made before the step; mat2 is a weight.
    assert nothing_extra == {
        "mat1": "autograd saves saved #0 for AddmmBackward0.mat1 (in blocks.0.0): 4x8 float32, "
        "128 B, "
        "an input of the step, made before it: nothing extra",
        "target": "autograd saves saved #6 for MseLossBackward0.target: 4x8 float32, 128 B, "
        "an input of the step, made before it: nothing extra",
        "mat2": "autograd saves saved #3 for AddmmBackward0.mat2 (in blocks.1.0): 8x8 float32, "
        "256 B, "
        "a parameter's own memory: nothing extra",
    }
    blocks = BackwardStepper(MLPChain(depth=2, width=8, checkpointing="block"), batch=4)
    drops = [
        f["text"] for f in blocks.frames if f["event"] == "pack" and "frees nothing" in f["text"]
    ]
    assert drops == [
        "block 0 forward: drops tensor #0 (linear), 4x8 float32, 128 B, the checkpoint's input: "
        "dropping frees nothing",
        "block 1 forward: drops tensor #0 (linear), 4x8 float32, 128 B, the checkpoint's input: "
        "dropping frees nothing",
        "block 1 forward: drops tensor #1 (linear), 8x8 float32, 256 B, a parameter's own memory: "
        "dropping frees nothing",
    ]


def test_an_op_frame_tells_apart_what_the_op_allocated_and_what_died_before_it():
    frames = BackwardStepper(MLPChain(depth=2, width=8), batch=4).frames
    # Block 0's Linear output (4x8 float32) dies once ReLU has run (ReLU saves its output, not its
    # input), before block 1's weight.t(), a view that allocates nothing.
    k = next(k for k, f in enumerate(frames) if f["op"] == "t" and k > 0)
    assert frames[k]["text"] == (
        "forward runs t (transpose the weight: a view, no copy): no new memory; "
        "before it ran, 128 B freed: tensors nothing refers to any more"
    )
    assert frames[k - 1]["live_bytes"] - frames[k]["live_bytes"] == 128
    assert (
        frames[0]["text"] == "forward runs t (transpose the weight: a view, no copy): no new memory"
    )
    assert any(f["text"].startswith("forward runs addmm (x @ W.T + b): +128 B new") for f in frames)


def node_boxes(svg: str) -> dict[str, str]:
    """Each drawn node's title (without its state) -> its outline's points, read from the SVG."""
    groups = re.findall(
        r'<g class="node"><title>([^<:]*)[^<]*</title>\n<polygon[^>]* points="([^"]*)"', svg
    )
    return dict(groups)


def test_the_graph_is_laid_out_once_and_a_step_changes_only_colours(blocks):
    _, stepper = blocks
    first, later = stepper.svg(0), stepper.svg(len(stepper.frames) // 2)
    assert node_boxes(first) and node_boxes(first) == node_boxes(later)
    # Every saved tensor of the step has its box from the first event on, not packed yet.
    assert first.count(": not packed yet</title>") == len(stepper.picture.boxes) + len(
        stepper.picture.leaf_edges
    )
    # Sideways nothing is cut: every window is the graph's whole width.
    for index in range(len(stepper.frames)):
        view_box = re.search(r'viewBox="([^"]*)"', stepper.svg(index))[1]
        x, _, w, _ = (float(v) for v in view_box.split())
        assert (x, w) == (0.0, round(stepper.picture.width, 1)), index


def test_event_one_draws_no_op_of_the_backward_graph_as_made(blocks):
    _, stepper = blocks
    first = stepper.svg(0)
    made_ops = re.findall(
        r'<g class="node"><title>(n\d+)</title>\n<polygon fill="lightgrey"', first
    )
    assert made_ops == []  # every op is pale: forward has made none yet
    done = next(k for k, f in enumerate(stepper.frames) if f["phase"] != "forward")
    assert (
        len(
            re.findall(
                r'<g class="node"><title>n\d+</title>\n<polygon fill="lightgrey"', stepper.svg(done)
            )
        )
        > 5
    )


def test_the_counts_are_of_the_boxes_drawn(blocks):
    _, stepper = blocks
    for index in (0, 10, 30, len(stepper.frames) - 1):
        counts = stepper.counts(index)
        svg = stepper.svg(index)
        for state in ("saved", "dropped", "recomputed", "released", "not packed yet"):
            drawn = len(re.findall(rf'<g class="node"><title>[^<]*: {state}</title>', svg))
            assert counts[state] == drawn, (index, state)
        assert f"{counts['saved']}</b>" in stepper._states_html(index)


def test_a_function_of_token_ids_or_a_dict_gets_its_backward_through_the_parameters():
    torch.manual_seed(0)
    embedding, gru = torch.nn.Embedding(10, 4), torch.nn.GRU(4, 4, batch_first=True)
    tokens = torch.randint(0, 10, (2, 3))
    stepper = BackwardStepper(lambda ids: checkpoint(lambda e: gru(e)[0], embedding(ids)), tokens)
    assert any(f["event"] == "recompute" for f in stepper.frames)
    assert embedding.weight.grad is not None and gru.weight_hh_l0.grad is not None
    linear = torch.nn.Linear(3, 2)
    batch = {"x": torch.randn(4, 3, requires_grad=True), "scale": 2.0}
    stepper = BackwardStepper(
        lambda b: checkpoint(lambda t: linear(t).relu(), b["x"]) * b["scale"], batch
    )
    assert batch["x"].grad is not None and stepper.peak_bytes > 0
    first_grad = linear.weight.grad.clone()
    BackwardStepper(lambda b: checkpoint(lambda t: linear(t).relu(), b["x"]) * b["scale"], batch)
    assert torch.equal(linear.weight.grad, first_grad)  # reset before the step, not accumulated


def test_the_output_carries_a_picture_of_the_current_event(blocks):
    _, stepper = blocks
    stepper.position.value = 30
    bundle = stepper._repr_mimebundle_()
    assert base64.b64decode(bundle["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert bundle["text/plain"].startswith(
        f"BackwardStepper({len(stepper.frames)} events, peak 3.44 KiB; event 31: "
    )
    stepper.position.value = 0


def test_a_hugging_face_model_is_replayed_with_its_layers_checkpointed_and_given_back():
    model = hf_gpt2(n_layer=2).eval()
    stepper = BackwardStepper(model, batch=2)
    texts = [frame["text"] for frame in stepper.frames]
    for layer in ("transformer.h.0", "transformer.h.1"):  # regions named by module path
        events = [frame["event"] for frame in stepper.frames if frame["region"] == layer]
        assert events.count("recompute") == 1 and "unpack" in events, layer
        assert f"{layer} starts: keeps its input, 2x8x64 float32, 4.00 KiB" in texts
        assert any(text.startswith(f"{layer} forward: drops tensor #0") for text in texts)
        assert any(text.startswith(f"{layer} rerun: packs tensor #0") for text in texts)
    assert not any("not known" in text for text in texts)  # each rerun pack sits between its ops
    assert set(stepper.frames[-1]["states"].values()) == {"released"}
    assert not [path for path, module in model.named_modules() if "forward" in vars(module)]
    # The same step, checkpointed the same way, has the same peak.
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    with apply_checkpointing(model):
        step = measure(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward())
    peak = step.peak_bytes
    assert stepper.peak_bytes == peak


def test_a_decoder_layer_with_its_keyword_arguments_is_checkpointed_as_a_whole():
    llama = hf_llama(num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64)
    layer = llama.model.layers[0]
    hidden = torch.randn(2, 5, 32, requires_grad=True)
    positions = torch.arange(5)[None].expand(2, 5)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None].expand(2, 1, 5, 5)
    stepper = BackwardStepper(
        layer,
        hidden,
        attention_mask=mask,
        position_ids=positions,
        position_embeddings=llama.model.rotary_emb(hidden, positions),
    )
    regions = {frame["region"] for frame in stepper.frames if frame["region"]}
    assert regions == {"LlamaDecoderLayer"}  # no repeated layers inside: the layer is the region
    assert sum(frame["event"] == "recompute" for frame in stepper.frames) == 1
    assert hidden.grad is not None and "forward" not in vars(layer)
    with pytest.raises(
        TypeError,
        match="Linear has no loss, example_batch, checkpointing; pass a ckptlib demo model",
    ):
        BackwardStepper(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("checkpointing", ["none", "block"])
def test_the_words_number_each_saved_tensor_as_the_graph_draws_it(checkpointing):
    stepper = BackwardStepper(MLPChain(depth=3, width=16, checkpointing=checkpointing), batch=4)
    checked = set()
    for index, frame in enumerate(stepper.frames):
        label = frame["tensor"]
        if label not in stepper.picture.element_of:
            continue
        thick = [
            body
            for kind, body in re.findall(
                r'<g class="(node|edge)"><title>[^<]*</title>\n(.*?)</g>', stepper.svg(index), re.S
            )
            if 'stroke-width="2.5"' in body
        ]
        assert len(thick) == 1, (index, label)
        drawn = " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", thick[0]))
        prefix, _, number = label.rpartition(" #")
        # The thick box (or the dashed edge of a leaf's memory) says the number the words use.
        assert prefix in drawn and re.search(rf"#{number}\b", drawn), (index, label, drawn)
        where = stepper.picture.drawn_as[label]
        assert f"(in the graph: {where}, drawn thick)" in stepper._states_html(index)
        assert ("dashed edge" in where) == ("->" in stepper.picture.element_of[label])
        checked.add(label)
    assert checked == set(stepper.picture.element_of)
    # Two labels of one memory (a ReLU's output is the next Linear's input) share a box that
    # names both, and the second save says so.
    if checkpointing == "none":
        assert stepper.picture.drawn_as["saved #4"] == "the box 'saved #4, #5'"
        pack = next(f for f in stepper.frames if f["event"] == "pack" and f["tensor"] == "saved #5")
        assert pack["text"].endswith("the same memory as saved #4: one box in the graph")
        leaf_edge = stepper.picture.drawn_as["saved #3"]
        assert leaf_edge == "the dashed edge 'mat2: saved #3' to its leaf"


def test_the_picture_without_the_widget_shows_the_peak_not_the_pale_first_event(blocks):
    _, stepper = blocks
    stepper.position.value = 0
    peak = stepper.peak_index
    assert stepper.frames[peak]["live_bytes"] == stepper.peak_bytes and peak > 0
    assert stepper.frames[peak]["states"], "at the peak something is packed"
    first = stepper._static_png()
    stepper.position.value = peak
    assert stepper._static_png() == first
    stepper.position.value = 1
    assert stepper._static_png() != first   # any other event is drawn as it is
    stepper.position.value = 0
