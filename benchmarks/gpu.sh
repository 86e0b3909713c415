#!/usr/bin/env bash
# The short GPU benchmark: `python -m benchmarks.bench --quick --device cuda`, about a minute on one GPU.
#
# Measures every variant with the CUDA caching allocator (synchronised timing), and measures the
# same steps again with the live-tensor meter: `meter_agreement` in the JSON says how far the two
# meters differ (target: within 2%). Writes benchmarks/results/cuda-<gpu name>.json.
#
#   benchmarks/gpu.sh                 # from anywhere; uses .venv/bin/python if it exists
#   PYTHON=python3 benchmarks/gpu.sh  # another interpreter
#   benchmarks/gpu.sh --rounds 9      # extra flags go to python -m benchmarks.bench
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-.venv/bin/python}"
if [ ! -x "$python" ] && ! command -v "$python" >/dev/null; then
  python=python3
fi

# Fail before measuring anything when this machine cannot run the GPU benchmark.
if ! "$python" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    build = "a CUDA build" if torch.version.cuda else "a build without CUDA (CPU only)"
    sys.exit(f"benchmarks/gpu.sh: no CUDA device is available (torch {torch.__version__} is {build}). "
             "Run it on a machine with an NVIDIA GPU and a CUDA build of torch; "
             "on CPU use `make bench` instead.")
PY
then
  exit 1
fi

gpu_name="$("$python" -c 'import torch; print(torch.cuda.get_device_name(0))')"
slug="$(printf '%s' "$gpu_name" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/^-*//; s/-*$//')"
out="benchmarks/results/cuda-${slug:-gpu}.json"

# The run takes about a minute; stop it well before anyone's 3-minute budget is gone.
timeout "${BENCH_TIMEOUT_S:-170}" "$python" -m benchmarks.bench --quick --device cuda --json "$out" "$@"
