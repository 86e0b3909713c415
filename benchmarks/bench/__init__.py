"""``python -m benchmarks.bench``: peak memory and step time of every way to checkpoint, side by
side.

A tool beside the library, not part of it: run it from the repository root
(``make bench``, ``make figures``, or ``python -m benchmarks.bench --quick``).
Every number the course quotes about the cost of checkpointing comes from it,
so a learner can rerun it on their own machine. One idea per module, in the
order a run meets them:

============  ==============================================================================
``config``    what runs: model sizes, presets (``DEFAULT``, ``QUICK``, ``TINY``), the variants
              of each group (``Config``, ``Variant``, ``Group``)
``timing``    the interleaved timing loop: peak memory of each variant, then rounds of steps;
              busy machines and freed memory
``sweeps``    memory only: peak vs depth, and the scaling run (peak vs chain length n), fitted
              with the library's ``ckptlib.fits``
``stats``     ratios, medians and IQRs, bootstrap intervals
``summary``   one whole run into the JSON summary (``run``, ``BenchRun``), and its targets
``report``    the text tables and the Markdown of ``benchmarks/README.md``
``figures``   the figures (``make figures``)
``progress``  the progress bar
``cli``       the command line (``main``); ``__main__`` runs it
============  ==============================================================================

From Python (``tests/tools/test_bench.py`` runs the command line at the ``TINY`` sizes)::

    bench = run(QUICK)                 # a progress bar on stderr
    print(format_report(bench.summary))
    write_figures(bench, "figures")
"""
from benchmarks.bench.cli import main
from benchmarks.bench.config import (
    CLOCKS, DEFAULT, METER_VARIANTS, QUICK, TINY, Config, Group, TransformerSize, Variant,
)
from benchmarks.bench.figures import FIGURE_NAMES, draw_figure, write_figures
from benchmarks.bench.progress import ProgressBar, format_bar
from benchmarks.bench.report import (
    MARKDOWN_BEGIN, MARKDOWN_END, format_report, format_table, to_markdown, write_markdown,
)
from benchmarks.bench.stats import median_and_iqr, paid_interval, ratio, selective_tradeoff
from benchmarks.bench.summary import (
    SCHEMA, SEED_CLAIMS, SUMMARY_KEYS, TORCH_SAC_REFERENCE, BenchError, BenchRun, check_summary,
    run,
)
from benchmarks.bench.timing import keep_freed_memory, summarise_group

__all__ = [
    "Config", "TransformerSize", "DEFAULT", "QUICK", "TINY", "CLOCKS", "METER_VARIANTS", "BenchRun",
    "BenchError", "Group", "Variant", "run", "main", "keep_freed_memory", "check_summary",
    "SEED_CLAIMS", "TORCH_SAC_REFERENCE", "SCHEMA", "SUMMARY_KEYS",
    "ratio", "median_and_iqr", "paid_interval", "selective_tradeoff",
    "summarise_group", "format_bar", "ProgressBar", "format_table", "format_report", "to_markdown",
    "write_markdown", "MARKDOWN_BEGIN", "MARKDOWN_END", "FIGURE_NAMES", "draw_figure",
    "write_figures",
]
