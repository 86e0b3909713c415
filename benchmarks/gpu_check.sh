#!/usr/bin/env bash
# Everything the course and ckptlib must show on a real GPU, in one prepared command.
#
# On a GPU machine (no registry there: carry the wheels that benchmarks/gpu_wheels.sh downloads):
#   benchmarks/gpu_check.sh OUTDIR       # OUTDIR defaults to $OUT, else build/gpu-check
# It writes at most seven files into OUTDIR:
#   summary.txt        the machine, torch, each step's status and the key numbers
#   log.txt            every step's full output
#   cuda-<gpu>.json    benchmarks/gpu.sh's results (also left in benchmarks/results/)
#   00.ipynb 06.ipynb  notebooks 00 and 06 executed on CUDA (fresh kernels)
#   dashboard-off.png dashboard-per-block.png   the MemoryDashboard's plot after a CUDA step
# Steps: (1) install carried wheels, (2) check imports and a Jupyter kernel, collect the tests,
# (3) stop here with exit 2 and a clear message when there is no CUDA device (the dry run on a
# CPU machine), else (4) the CUDA-only tests, (5) the library tests, (6) the GPU benchmark,
# (7) notebooks 00 and 06, (8) the dashboard. A failing step is recorded and the rest still run;
# the exit status is the number of failed steps (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="${1:-${OUT:-build/gpu-check}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
summary="$out/summary.txt"
log="$out/log.txt"
: >"$summary"
: >"$log"
failed=0

say() { echo "$*" | tee -a "$summary"; }
# step NAME TIMEOUT_S CMD...: run, log, record status.
step() {
  local name="$1" limit="$2"
  shift 2
  echo "=== $name: $*" >>"$log"
  local start=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    say "PASS  $name (${took}s)"
  else
    [ "$rc" -eq 124 ] && say "FAIL  $name: timed out after ${limit}s" || say "FAIL  $name: exit $rc (${took}s), see log.txt"
    failed=$((failed + 1))
  fi
  return "$rc"
}

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi

# (1) Carried wheels go to a private folder that comes first on the path, so the GPU image's
# own packages are left as they are.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
wheel_python="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if compgen -G ".whl/*.whl" >/dev/null && [ "$wheel_python" != "3.12" ]; then
  say "note  .whl/ holds wheels for the GPU machine's Python 3.12; this is Python $wheel_python, so they are not installed here"
elif compgen -G ".whl/*.whl" >/dev/null; then
  site=/tmp/ckptlib-gpu-site
  step "install carried wheels" 300 "$python" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PYTHONPATH"
else
  say "note  no .whl/ folder: using the packages this Python already has (benchmarks/gpu_wheels.sh makes it)"
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

# (2) What a run needs, checked before anything is measured.
"$python" - >>"$summary" 2>>"$log" <<'PY'
import importlib, platform, sys
import torch
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, "
      f"CUDA build {torch.version.cuda or 'none'}, cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
missing = []
for name in ("numpy", "matplotlib", "pytest", "hypothesis", "yaml", "ipywidgets", "nbformat",
             "nbclient", "ipykernel", "graphviz", "torchviz", "ckptlib"):
    try:
        importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - report every missing piece at once
        missing.append(f"{name} ({type(error).__name__}: {error})")
print("imports: all present" if not missing else "imports MISSING: " + "; ".join(missing))
PY
step "imports" 60 "$python" -c "import ipywidgets, nbclient, ipykernel, matplotlib, ckptlib"
step "jupyter kernel starts" 120 "$python" - <<'PY'
import nbformat
from nbclient import NotebookClient
nb = nbformat.v4.new_notebook()
nb.cells.append(nbformat.v4.new_code_cell("import torch, ckptlib; print(torch.cuda.is_available())"))
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
NotebookClient(nb, timeout=60, kernel_name="python3").execute()
print("kernel said:", nb.cells[0].outputs[0]["text"].strip())
PY
step "collect tests" 180 "$python" -m pytest -q --collect-only -p no:cacheprovider tests -k "not browser"
grep -E "tests? collected" "$log" | tail -1 | sed 's/^/      /' | tee -a "$summary"

# (3) The CUDA check: a CPU machine stops here, cleanly.
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "STOP  no CUDA device here: the preparation above is all a CPU machine can check."
  say "      Run benchmarks/gpu_check.sh on a machine with an NVIDIA GPU and a CUDA build of torch."
  say "      ($failed of the preparation steps failed; details in $log)"
  exit 2
fi

# (4) The tests that skip without CUDA, then (5) the whole library suite on this machine.
step "CUDA-only tests" 300 "$python" -m pytest -q -rs -p no:cacheprovider tests -k "cuda and not browser"
step "library tests" 420 "$python" -m pytest -x -q -rs -p no:cacheprovider tests -k "not browser"
grep -E "(passed|failed|skipped)" "$log" | grep -E "^[0-9]+ |^=+ " | tail -2 | sed 's/^/      /' | tee -a "$summary"

# (6) The GPU benchmark (timings with CUDA events, both meters).
before="$(ls benchmarks/results/cuda-*.json 2>/dev/null)"
if step "benchmarks/gpu.sh" 300 env PYTHON="$python" BENCH_TIMEOUT_S=280 benchmarks/gpu.sh; then
  for json in benchmarks/results/cuda-*.json; do cp "$json" "$out/"; done
  "$python" - "$out" >>"$summary" 2>>"$log" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("cuda-*.json")):
    data = json.loads(path.read_text())
    agreement = data.get("meter_agreement")
    print(f"      {path.name}: meter_agreement {json.dumps(agreement)[:400]}")
PY
fi

# (7) Notebooks 00 and 06 on CUDA, each in a fresh kernel; the executed copies are kept.
for nb in notebooks/00_welcome_and_setup.ipynb notebooks/06_transformer_in_practice.ipynb; do
  name="$(basename "$nb" | cut -c1-2).ipynb"
  step "notebook $(basename "$nb")" 240 "$python" - "$nb" "$out/$name" <<'PY'
import sys
import nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
try:
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": "notebooks"}}).execute()
finally:
    nbformat.write(nb, sys.argv[2])
PY
done

# (8) The dashboard, headless, for two settings; its plot saved as PNG.
step "MemoryDashboard on CUDA" 240 "$python" - "$out" <<'PY'
import pathlib, sys
from ckptlib.widgets import MemoryDashboard
out = pathlib.Path(sys.argv[1])
dashboard = MemoryDashboard(device="cuda")
for label, on in (("off", False), ("per-block", True)):
    dashboard.checkpointing.value = on
    record = dashboard.run(steps=3)[-1]
    (out / f"dashboard-{label}.png").write_bytes(dashboard.plot.value)
    print(f"{label}: peak {record['peak_bytes']} B, step {record['step_s'] * 1e3:.2f} ms "
          f"(range {record['step_s_range'][0] * 1e3:.2f}-{record['step_s_range'][1] * 1e3:.2f} ms)")
PY
grep -E "^(off|per-block): peak" "$log" | sed 's/^/      dashboard /' | tee -a "$summary"

say "done: $failed step(s) failed"
exit "$failed"
