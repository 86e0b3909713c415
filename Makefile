# The course's two commands are `make lab` and `make test`; both build .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The notebook `make lab` opens, in the learner's working copy lab/ (tools/lab.py): a name such as
# 05_memory_vs_compute.ipynb or solutions/05_memory_vs_compute_solutions.ipynb; a notebooks/ path
# opens its lab/ copy.
NOTEBOOK ?= 00_welcome_and_setup.ipynb
# JupyterLab refuses to run as root without this flag (containers, CI).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: setup lint lab test test-lib test-notebooks figures bench clean check-python slides site gpu-wheels gpu-check

setup: $(STAMP)

check-python:
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 10) else "ckptlib needs Python 3.10 or newer; found %d.%d. Install a newer Python (or use environment.yml with conda) and run make again." % v[:2])' \
	  || { echo "No usable '$(PYTHON)' found. Install Python 3.10+ or run: make PYTHON=/path/to/python3"; exit 1; }

# Rebuilt only when pyproject.toml or constraints.txt change.
$(STAMP): pyproject.toml constraints.txt | check-python
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) \
	  || { echo "Could not create $(VENV): on Debian/Ubuntu install python3-venv (apt-get install python3-venv)."; exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[course,test,hf]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (ckptlib)" >/dev/null
	@touch $(STAMP)
	@echo "Environment ready in $(VENV)."

# lab/ is notebooks/ with the outputs cleared, so predictions are made blind; git ignores it, and a
# second `make lab` keeps every edit the learner made there.
lab: setup
	@command -v dot >/dev/null || echo "note: Graphviz 'dot' not found; graphs render with the bundled WebAssembly Graphviz instead."
	$(BIN)/python tools/lab.py
	$(BIN)/jupyter lab $(ROOT_FLAG) --notebook-dir=. $(LAB_ARGS) lab/$(patsubst notebooks/%,%,$(NOTEBOOK))

# The linter first (ruff: line length 100, pyflakes); the layering check is tests/tools/test_layers.py.
test: setup lint
	$(BIN)/python -m pytest --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-current-env

lint: setup
	$(BIN)/ruff check .

test-lib: setup
	$(BIN)/python -m pytest tests

test-notebooks: setup
	$(BIN)/python -m pytest --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-current-env notebooks

# The settings of the committed CPU results (benchmarks/README.md): one thread, this process's
# CPU time, 100 rounds. Override for your machine, e.g. `make bench BENCH_ARGS=`.
BENCH_ARGS ?= --threads 1 --clock cpu --rounds 100

figures: setup
	$(BIN)/python -m benchmarks.bench $(BENCH_ARGS) --figures figures
	$(BIN)/python benchmarks/frontier.py --from-json benchmarks/results/frontier.json --figures figures

bench: setup
	$(BIN)/python -m benchmarks.bench $(BENCH_ARGS) --json benchmarks/results/cpu.json --markdown benchmarks/README.md --figures figures
	$(BIN)/python benchmarks/region_cost.py --json benchmarks/results/region_cost.json --markdown benchmarks/README.md
	$(BIN)/python benchmarks/hf_models.py --json benchmarks/results/hf_models.json --markdown benchmarks/README.md
	$(BIN)/python benchmarks/frontier.py --json benchmarks/results/frontier.json --markdown benchmarks/README.md --figures figures

# The GPU run (see benchmarks/README.md): `make gpu-wheels` here fills .whl/ with what the GPU
# machine lacks; there, `benchmarks/gpu_check.sh OUTDIR` runs every CUDA check in one go.
gpu-wheels: setup
	PYTHON=$(BIN)/python benchmarks/gpu_wheels.sh

gpu-check: setup
	PYTHON=$(BIN)/python benchmarks/gpu_check.sh build/gpu-check

# Offline reveal.js decks and the static course site (see tools/classroom.py); the first run
# installs the pinned browser assets with `npm ci --prefix tools` (needs Node.js and npm).
slides: setup
	$(BIN)/python tools/classroom.py slides build/slides

site: setup
	$(BIN)/python tools/classroom.py site build/site

clean:
	rm -rf $(VENV) build .pytest_cache
