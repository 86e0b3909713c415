"""Tests for ``python -m benchmarks.bench``: it runs end to end at tiny sizes, writes what it says,
and computes its ratios correctly (its fits are the library's: tests/tools/test_fits.py).
Nothing here asserts a timing: performance is what the benchmark reports, not what a test can
promise on a shared machine."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import bench
from benchmarks.bench import (
    MARKDOWN_BEGIN,
    MARKDOWN_END,
    METER_VARIANTS,
    SCHEMA,
    SUMMARY_KEYS,
    TINY,
    BenchError,
    BenchRun,
    Group,
    ProgressBar,
    TransformerSize,
    Variant,
    draw_figure,
    format_bar,
    format_report,
    format_table,
    main,
    median_and_iqr,
    ratio,
    selective_tradeoff,
    summarise_group,
    to_markdown,
    write_figures,
    write_markdown,
)
from ckptlib.memory import TimelineEntry

ROOT = Path(__file__).resolve().parents[2]
FIGURES = (
    "memory_vs_depth",
    "overhead_per_variant",
    "memory_timeline",
    "scaling_peak_vs_n",
    "forward_calls_vs_theory",
)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One ``--quick`` run of the command line (at TINY sizes), with every output flag."""
    out = tmp_path_factory.mktemp("bench")
    readme = out / "README.md"
    readme.write_text(
        f"# Results\n\nintro\n\n{MARKDOWN_BEGIN}\nSTALE RESULTS\n{MARKDOWN_END}\n\nafterword\n"
    )
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "QUICK", TINY)
        stdout = io.StringIO()
        patch.setattr("sys.stdout", stdout)
        try:
            # One thread: tiny ops gain nothing from two, and a busy machine slows them a lot.
            # --system-malloc: keep_freed_memory would change the allocator of the whole test
            # process (tested on its own, in a subprocess).
            code = main(
                [
                    "--quick",
                    "--threads",
                    "1",
                    "--clock",
                    "cpu",
                    "--no-progress",
                    "--system-malloc",
                    "--json",
                    str(out / "results" / "cpu.json"),
                    "--markdown",
                    str(readme),
                    "--figures",
                    str(out / "figures"),
                ]
            )
        finally:
            torch.set_num_threads(threads)
    return {
        "code": code,
        "out": out,
        "stdout": stdout.getvalue(),
        "summary": json.loads((out / "results" / "cpu.json").read_text()),
    }


# -- end to end ----------------------------------------------------------------


def test_cli_writes_table_json_markdown_and_figures(cli_run):
    out = cli_run["out"]
    assert cli_run["code"] == 0
    assert "Per-block checkpointing" in cli_run["stdout"] and "Targets" in cli_run["stdout"]
    assert sorted(p.name for p in (out / "figures").iterdir()) == sorted(
        f"{name}.{suffix}" for name in FIGURES for suffix in ("png", "svg")
    )
    assert all(p.stat().st_size > 1000 for p in (out / "figures").iterdir())
    readme = (out / "README.md").read_text()
    assert readme.startswith("# Results\n\nintro\n\n" + MARKDOWN_BEGIN) and readme.endswith(
        MARKDOWN_END + "\n\nafterword\n"
    )
    assert "STALE RESULTS" not in readme and "| `ckptlib` |" in readme


def test_json_schema(cli_run):
    summary = cli_run["summary"]
    assert tuple(summary) == SUMMARY_KEYS and summary["schema"] == SCHEMA
    environment = summary["environment"]
    assert (
        environment["device"],
        environment["meter"],
        environment["clock"],
        environment["threads"],
    ) == ("cpu", "tensors", "cpu", 1)
    assert environment["allocator"] == "system default"  # --system-malloc
    assert summary["meter_agreement"] is None  # only measured on CUDA
    groups = summary["groups"]
    assert list(groups["blocks"]["variants"]) == [
        "plain",
        "torch",
        "ckptlib",
        "sqrt",
        "plain_metered",
        "plain_metered_timeline",
    ]
    assert set(groups["selective"]["tradeoffs"]) == {
        "torch_save_matmuls",
        "ckptlib_save_matmuls",
        "ckptlib_megatron",
        "ckptlib_cost_policy",
        "ckptlib_cost_policy_plans",
    }
    for group in groups.values():
        for name, variant in group["variants"].items():
            assert len(variant["times_s"]) == TINY.rounds
            assert variant["median_s"] > 0 and variant["iqr_s"] >= 0
            if name.startswith("plain_metered"):
                assert variant["peak_bytes"] is None  # timed only: the meter's own cost
            else:
                assert isinstance(variant["peak_bytes"], int) and variant["peak_bytes"] > 0
    scaling = summary["scaling"]
    assert scaling["ns"] == list(TINY.scaling_ns) and set(scaling["modes"]) == {
        "plain",
        "sqrt",
        "recursive",
    }
    for record in scaling["modes"].values():
        assert set(record["power_fit"]) == {"exponent", "coefficient", "r2"}
        assert all(
            len(record[key]) == len(TINY.scaling_ns) for key in ("peak_bytes", "forward_calls")
        )
    for target in summary["targets"]:
        assert set(target) == {"name", "source", "value", "op", "threshold", "met"} and target[
            "op"
        ] in ("<=", ">=")


def test_ratios_in_the_json_follow_from_its_measurements(cli_run):
    groups = cli_run["summary"]["groups"]
    blocks = groups["blocks"]["variants"]
    plain = blocks["plain"]
    for variant in blocks.values():
        assert variant["median_s"] == median_and_iqr(variant["times_s"])[0]
        per_round = [t / p for t, p in zip(variant["times_s"], plain["times_s"])]
        assert (variant["time_vs_plain"], variant["time_vs_plain_iqr"]) == median_and_iqr(per_round)
    assert blocks["ckptlib"]["memory_vs_plain"] == pytest.approx(
        blocks["ckptlib"]["peak_bytes"] / plain["peak_bytes"]
    )
    pair = groups["blocks"]["pairs"]["ckptlib_vs_torch"]
    assert pair["memory"] == pytest.approx(
        blocks["ckptlib"]["peak_bytes"] / blocks["torch"]["peak_bytes"]
    )
    assert cli_run["summary"]["meter_overhead"]["peak"] == blocks["plain_metered"]["time_vs_plain"]


def test_checkpointing_lowers_the_measured_peak(cli_run):
    """The meter is exact, so this holds at any size: recomputing keeps less than plain."""
    variants = cli_run["summary"]["groups"]["blocks"]["variants"]
    assert variants["ckptlib"]["peak_bytes"] < variants["plain"]["peak_bytes"]
    assert variants["torch"]["peak_bytes"] < variants["plain"]["peak_bytes"]
    scaling = cli_run["summary"]["scaling"]["modes"]
    assert scaling["sqrt"]["peak_bytes"][-1] < scaling["plain"]["peak_bytes"][-1]


def test_counted_forward_calls_match_the_plans(cli_run):
    for name, record in cli_run["summary"]["scaling"]["modes"].items():
        assert record["forward_calls"] == record["plan_forward_calls"], name
    plain = cli_run["summary"]["scaling"]["modes"]["plain"]
    assert plain["forward_calls"] == list(TINY.scaling_ns)


def test_from_json_reports_a_saved_run(cli_run, tmp_path, capsys):
    markdown = tmp_path / "results.md"
    assert (
        main(
            [
                "--from-json",
                str(cli_run["out"] / "results" / "cpu.json"),
                "--markdown",
                str(markdown),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("ckptlib.bench on cpu")
    assert (
        markdown.read_text()
        == f"{MARKDOWN_BEGIN}\n\n{to_markdown(cli_run['summary'])}\n{MARKDOWN_END}\n"
    )


def test_from_json_refuses_figures_and_other_schemas(tmp_path):
    stale = tmp_path / "old.json"
    stale.write_text(json.dumps({"schema": "ckptlib.bench/0"}))
    with pytest.raises(SystemExit, match="schema 'ckptlib.bench/0'"):
        main(["--from-json", str(stale)])
    with pytest.raises(SystemExit, match="--figures needs a fresh run"):
        main(["--from-json", str(stale), "--figures", str(tmp_path)])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message shown when there is no CUDA"
)
def test_cuda_without_a_gpu_fails_clearly():
    with pytest.raises(SystemExit, match="--device cuda: no CUDA device is available"):
        main(["--device", "cuda", "--quick"])


def test_bad_arguments_fail_clearly():
    with pytest.raises(SystemExit, match="--device tpu"):
        main(["--device", "tpu"])
    with pytest.raises(SystemExit, match="--rounds 0"):
        main(["--rounds", "0"])
    with pytest.raises(SystemExit, match="--threads 0"):
        main(["--threads", "0"])
    with pytest.raises(SystemExit):
        main(["--clock", "sundial"])


def test_run_refuses_a_device_it_cannot_measure():
    with pytest.raises(BenchError, match="'cpu' or 'cuda'"):
        bench.run(TINY, "meta", progress=None)
    with pytest.raises(BenchError, match="cuda"):
        bench.run(replace(TINY, clock="cpu"), "cuda", progress=None)  # no CUDA here, or a CPU clock


# -- pure functions ---------------------------------------------------------------


def test_ratio_and_statistics():
    assert ratio(3, 4) == 0.75 and ratio(1, 0) is None and ratio(None, 1) is None
    assert median_and_iqr([5.0]) == (5.0, 0.0)
    assert median_and_iqr([4.0, 1.0, 3.0, 2.0]) == (2.5, 1.5)
    with pytest.raises(ValueError):
        median_and_iqr([])


def test_summarise_group_from_given_numbers():
    group = Group(
        "g",
        "title",
        "model",
        [
            Variant("plain", "p", None, None),
            Variant("torch", "t", None, None),
            Variant("ckptlib", "c", None, None),
            Variant("ckptlib_sel", "s", None, None),
        ],
        pairs={"ckptlib_vs_torch": ("ckptlib", "torch")},
        tradeoffs={"ckptlib_sel": "ckptlib"},
    )
    peaks = {"plain": 1000, "torch": 400, "ckptlib": 300, "ckptlib_sel": 650}
    times = {
        "plain": [1.0, 1.2, 0.8],
        "torch": [2.0, 2.0, 2.0],
        "ckptlib": [1.6, 1.5, 1.7],
        "ckptlib_sel": [1.2, 1.1, 1.3],
    }
    record = summarise_group(group, peaks, times)
    variants = record["variants"]
    assert variants["plain"]["memory_vs_plain"] == 1.0 and variants["plain"]["time_vs_plain"] == 1.0
    assert variants["ckptlib"]["memory_vs_plain"] == 0.3
    # time ratios are medians of per-round ratios: torch 2, 1.67, 2.5; ckptlib 1.6, 1.25, 2.125
    assert variants["torch"]["time_vs_plain"] == 2.0 and variants["ckptlib"]["time_vs_plain"] == 1.6
    assert variants["ckptlib"]["median_s"] == 1.6 and variants["ckptlib"]["iqr_s"] == pytest.approx(
        0.1
    )
    assert record["pairs"]["ckptlib_vs_torch"] == {
        "numerator": "ckptlib",
        "denominator": "torch",
        "memory": 0.75,
        "time": 0.8,
    }
    # per-round ckptlib/torch: 0.8, 0.75, 0.85; kept (1000-650)/(1000-300) = 0.5 of the saving,
    # paid (1.2-1)/(1.6-1) = 1/3 of the extra time (per-round selective/plain: 1.2, 0.92, 1.63)
    assert record["tradeoffs"]["ckptlib_sel"] == {
        "full": "ckptlib",
        "saving_kept": 0.5,
        "extra_time_paid": pytest.approx(1 / 3),
        "extra_time_paid_interval": None,
    }  # 3 rounds: too few
    times = {name: values * 3 for name, values in times.items()}  # 9 rounds: an interval around 1/3
    low, high = summarise_group(group, peaks, times)["tradeoffs"]["ckptlib_sel"][
        "extra_time_paid_interval"
    ]
    assert low <= 1 / 3 <= high


def test_selective_tradeoff_edge_cases():
    assert selective_tradeoff((100, 1.0), (100, 1.0), (90, 1.0)) == {
        "saving_kept": None,
        "extra_time_paid": None,
    }
    assert selective_tradeoff((100, 1.0), (50, 2.0), (50, 2.0)) == {
        "saving_kept": 1.0,
        "extra_time_paid": 1.0,
    }


# -- formatting ---------------------------------------------------------------------


def test_format_bar():
    assert format_bar(0, 10, "start", width=10) == "[----------]   0%  0/10 start"
    assert format_bar(10, 10, width=10, elapsed_s=125) == "[##########] 100% 10/10 02:05"
    assert format_bar(0, 0, width=4) == "[####] 100% 0/0"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_on_a_terminal_and_writes_few_lines_to_a_log():
    log = io.StringIO()
    bar = ProgressBar(100, stream=log)
    for _ in range(100):
        bar.advance("x")
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("[" + "#" * 24 + "] 100% 100/100")
    terminal = _Terminal()
    bar = ProgressBar(3, stream=terminal)
    for _ in range(3):
        bar.advance("y")
    bar.close()
    assert terminal.getvalue().count("\r") == 3 and terminal.getvalue().endswith("\n")


def test_format_table_aligns_columns():
    table = format_table(["name", "value"], [["a", 1], ["long name", None]])
    assert table.splitlines() == [
        "name       value",
        "---------  -----",
        "a              1",
        "long name",
    ]


def test_write_markdown_appends_then_replaces(tmp_path, cli_run):
    path = tmp_path / "README.md"
    path.write_text("# Bench\n")
    write_markdown(path, cli_run["summary"])
    first = path.read_text()
    assert first.startswith("# Bench\n\n" + MARKDOWN_BEGIN) and first.endswith(MARKDOWN_END + "\n")
    write_markdown(path, cli_run["summary"])
    assert path.read_text() == first


def test_keep_freed_memory_sets_glibc_in_its_own_process():
    import subprocess
    import sys

    script = (
        "from benchmarks.bench import keep_freed_memory as k, TINY; "
        "from benchmarks.bench.timing import describe_environment; "
        "print(k()); "
        "import torch; print(describe_environment(TINY, torch.device('cpu'))['allocator'])"
    )
    lines = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split("\n")
    if sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver()):
        assert lines[0] == lines[1] == "glibc, freed memory kept for reuse (mallopt)"
    else:
        assert lines[0] == lines[1] == "system default"


# -- figures: redrawn from a saved run, nothing clipped ---------------------------------

COMMITTED = ROOT / "benchmarks" / "results" / "cpu.json"


def committed_run() -> BenchRun:
    """The committed CPU results, with made-up timelines (only the timeline figure reads them)."""
    summary = json.loads(COMMITTED.read_text())
    timelines = {
        f"blocks/{name}": [
            TimelineEntry(i, "aten.mm", phase, 2**20 * (i % 37))
            for i, phase in enumerate(["forward"] * 400 + ["recompute", "backward"] * 300)
        ]
        for name in ("plain", "ckptlib")
    }
    return BenchRun(summary, timelines)


def outside_the_canvas(figure) -> list[str]:
    """What of ``figure`` reaches past its edges, as drawn (empty: nothing is clipped)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    drawn = figure.get_tightbbox(renderer)  # in inches: everything drawn, texts included
    if (
        drawn.x0 >= 0
        and drawn.y0 >= 0
        and drawn.x1 <= figure.get_figwidth()
        and drawn.y1 <= figure.get_figheight()
    ):
        return []

    def clipped(text: Text) -> bool:
        extent = text.get_window_extent(renderer)
        return (
            extent.x0 < 0
            or extent.y0 < 0
            or extent.x1 > figure.bbox.width
            or extent.y1 > figure.bbox.height
        )

    texts = [
        text.get_text() for text in figure.findobj(Text) if text.get_visible() and text.get_text()
    ]
    return [
        text.get_text()
        for text in figure.findobj(Text)
        if text.get_text() in texts and clipped(text)
    ] or [f"something drawn spans {drawn}"]


@pytest.mark.parametrize("name", FIGURES)
def test_no_figure_clips_its_texts(name):
    assert outside_the_canvas(draw_figure(name, committed_run())) == []


def test_the_meter_has_its_own_panel_in_the_overhead_figure():
    figure = draw_figure("overhead_per_variant", committed_run())
    ways, meter = figure.axes
    labels = [[tick.get_text() for tick in ax.get_yticklabels()] for ax in (ways, meter)]
    assert labels[1] == [f"blocks/{name}" for name in METER_VARIANTS.values()]
    assert not any("metered" in label for label in labels[0]) and "blocks/ckptlib" in labels[0]
    assert "Recomputing costs time" in figure.get_suptitle() and "meter" in meter.get_title()


def test_figures_redraw_from_a_saved_run(tmp_path):
    saved = BenchRun(json.loads(COMMITTED.read_text()), {})
    names = [name for name in FIGURES if name != "memory_timeline"]
    written = write_figures(saved, tmp_path, names=names)
    assert sorted(p.name for p in written) == sorted(
        f"{name}.{suffix}" for name in names for suffix in ("png", "svg")
    )
    with pytest.raises(
        BenchError, match="memory_timeline needs the per-op timelines of a fresh run"
    ):
        write_figures(saved, tmp_path / "more")
    assert not (tmp_path / "more").exists()  # checked before anything was written


# -- misuse: clear errors before anything runs -------------------------------------------

_SIZE = dict(depth=2, d_model=16, heads=2, seq=8, vocab=32, batch=2)

BAD_CALLS = [
    (
        "run config str",
        lambda: bench.run("TINY", progress=None),
        TypeError,
        ["config must be a Config", "str"],
    ),
    (
        "run device tpu",
        lambda: bench.run(TINY, "tpu", progress=None),
        BenchError,
        ["--device tpu", "'cpu' or 'cuda'"],
    ),
    (
        "run progress str",
        lambda: bench.run(TINY, progress="yes"),
        TypeError,
        ["progress must be 'auto'", "'yes'"],
    ),
    (
        "Config rounds 0",
        lambda: replace(TINY, rounds=0),
        ValueError,
        ["Config: rounds must be at least 1", "got 0"],
    ),
    (
        "Config rounds str",
        lambda: replace(TINY, rounds="5"),
        TypeError,
        ["Config: rounds must be an int", "'5'"],
    ),
    (
        "Config clock",
        lambda: replace(TINY, clock="sundial"),
        ValueError,
        ["clock must be one of", "'sundial'"],
    ),
    (
        "Config one n",
        lambda: replace(TINY, scaling_ns=(16, 16)),
        ValueError,
        ["scaling_ns", "2 different ints"],
    ),
    (
        "Config no depths",
        lambda: replace(TINY, depths=()),
        ValueError,
        ["depths must be a tuple of at least 1"],
    ),
    (
        "Config negative n",
        lambda: replace(TINY, scaling_ns=(-4, 16)),
        ValueError,
        ["each of scaling_ns", "-4"],
    ),
    (
        "Config blocks",
        lambda: replace(TINY, blocks=(2, 16)),
        TypeError,
        ["blocks must be a TransformerSize"],
    ),
    ("Config quick", lambda: replace(TINY, quick="no"), TypeError, ["quick must be True or False"]),
    (
        "TransformerSize depth 0",
        lambda: TransformerSize(**{**_SIZE, "depth": 0}),
        ValueError,
        ["TransformerSize: depth must be at least 1"],
    ),
    (
        "TransformerSize heads str",
        lambda: TransformerSize(**{**_SIZE, "heads": "2"}),
        TypeError,
        ["TransformerSize: heads must be an int", "'2'"],
    ),
    ("format_report empty", lambda: format_report({}), BenchError, ["schema None", SCHEMA]),
    (
        "to_markdown old schema",
        lambda: to_markdown({"schema": "ckptlib.bench/0"}),
        BenchError,
        ["schema 'ckptlib.bench/0'", "rerun the bench"],
    ),
    (
        "to_markdown a list",
        lambda: to_markdown([]),
        BenchError,
        ["a list is not a ckptlib.bench summary"],
    ),
    (
        "write_figures summary",
        lambda: write_figures({"schema": SCHEMA}, "figures"),
        TypeError,
        ["bench must be a BenchRun", "dict"],
    ),
    (
        "draw_figure name",
        lambda: draw_figure("pie_chart", committed_run()),
        ValueError,
        ["no figure named 'pie_chart'", "memory_vs_depth"],
    ),
]


@pytest.mark.parametrize(
    "call, exception, words", [row[1:] for row in BAD_CALLS], ids=[row[0] for row in BAD_CALLS]
)
def test_bad_arguments_of_the_python_entry_points(call, exception, words):
    with pytest.raises(exception) as info:
        call()
    assert all(word in str(info.value) for word in words), str(info.value)


BAD_COMMAND_LINES = [
    (
        "from-json missing",
        ["--from-json", "{tmp}/missing.json"],
        ["--from-json", "missing.json", "cannot read"],
    ),
    (
        "from-json not JSON",
        ["--from-json", "{tmp}/notes.txt"],
        ["notes.txt: cannot read a JSON summary"],
    ),
    (
        "from-json and rounds",
        ["--from-json", "{tmp}/notes.txt", "--rounds", "3", "--threads", "1"],
        ["--rounds --threads: only for a measurement"],
    ),
    (
        "markdown in a missing dir",
        ["--markdown", "{tmp}/nowhere/README.md"],
        ["--markdown", "existing directory"],
    ),
    ("json is a dir", ["--json", "{tmp}"], ["--json", "is a directory"]),
    ("figures is a file", ["--figures", "{tmp}/notes.txt"], ["--figures", "is a file"]),
    ("device before malloc", ["--device", "tpu", "--quick"], ["--device tpu"]),
]


@pytest.mark.parametrize(
    "argv, words", [row[1:] for row in BAD_COMMAND_LINES], ids=[row[0] for row in BAD_COMMAND_LINES]
)
def test_bad_command_lines_fail_before_measuring(argv, words, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("not json")
    monkeypatch.setattr(
        "benchmarks.bench.cli.run", lambda *a, **k: pytest.fail("measured despite a bad argument")
    )
    monkeypatch.setattr(
        "benchmarks.bench.cli.keep_freed_memory", lambda: pytest.fail("changed the allocator")
    )
    with pytest.raises(SystemExit) as info:
        main([arg.format(tmp=tmp_path) for arg in argv])
    assert all(word in str(info.value) for word in words), str(info.value)
