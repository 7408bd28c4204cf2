# Two commands: `make train` and `make test` (`make test-fast`: the in-process tier). Each
# creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
# CPU wheel on CI-like machines; set TORCH_SPEC to keep/choose a CUDA build on GPU machines.
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
export PYTHONUNBUFFERED := 1
# Bytecode is written as modules are first imported (an empty value: Python writes it, even where
# the shell sets PYTHONDONTWRITEBYTECODE=1). pip's own pass (--no-compile above) and a compileall of
# the venv compile all ~19,400 files (52 CPU-s here) for the ~5,100 any job imports; with no
# bytecode written at all, every interpreter compiles llama_train (0.15 CPU-s) and pytest rewrites
# every test module again in each worker.
export PYTHONDONTWRITEBYTECODE :=
# DeepSpeed JIT-builds a CPU comm op on first use; keep its build with this checkout's venv so two
# checkouts never rebuild each other's copy.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: setup train test test-fast gpu-check scaling-demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --no-compile "$(TORCH_SPEC)"
	$(BIN)/pip install --no-compile -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/llama-train $(ARGS)

# Three pytest-xdist workers on 2 cores (a third keeps the CPU busy while a job waits on a
# timeout or the launcher's 1 s poll), each taking whole test files (module fixtures run once;
# the two files sharing the zero3_run fixture as one unit, tests/conftest.py), torch on one
# thread in each: 9:57 of tests in a fresh clone on 2 idle cores, 10:38 with the set-up
# (902.2 + 217.3 CPU-s, 18.7 CPU-min, 2026-11-29; launches whose subject is not the launcher
# fork from a warm parent: tests/warm_ranks.py). The commit before took 20.0 and 26.0 CPU-min
# in two fresh clones 25 minutes apart: this machine's speed moves. Before that 12:47 and 13:50;
# on a
# slower 2-core machine (AMD EPYC at 2.45 GHz, `import torch` 2.3-2.6 s) 25:18-37:24 and 28:02-40:29
# (27:09 and 29:33 at the last measurement; its speed varies by ~30% from hour to hour).
# PYTEST_WORKERS=0 runs them in this process (for pdb, -x).
PYTEST_WORKERS ?= 3
xdist = $(if $(filter 0,$(1)),-p no:xdist,-n $(1) --dist loadfile)
# The fast tier waits on little, so a third worker only adds its collection (~9 CPU-s: torch,
# Hydra): 2 workers took 72-75 s here against 82-86 s for 3 (interleaved runs, slower machine).
# PYTEST_WORKERS given on the command line or in the environment sets both.
ifeq ($(origin PYTEST_WORKERS),file)
FAST_WORKERS := 2
else
FAST_WORKERS := $(PYTEST_WORKERS)
endif

test: $(STAMP)
	$(BIN)/python -m pytest $(call xdist,$(PYTEST_WORKERS)) $(PYTEST_ARGS)

# The edit-test loop: the in-process tier (no launcher, no interpreter of its own), the loop
# included.
test-fast: $(STAMP)
	$(BIN)/python -m pytest $(call xdist,$(FAST_WORKERS)) -m "not slow" $(PYTEST_ARGS)

# On a machine with CUDA GPUs: every GPU path, measured (launch/gpu_check.sh); skips without one.
gpu-check:
	bash launch/gpu_check.sh $(ARGS)

# Our scaling study, end to end on 2 CPU cores (~8.5 h; the IsoFLOP sweep, 5 budgets x 7-8 sizes,
# measured 3.0 h of it on the slower machine: docs/scaling.md): lr vs size, the sweep, two more
# seeds at every size (3.2 h), the Approach 2/3 fits and plot, then the compute- vs inference-optimal
# pairs at 3e11, 1e12, 3e12 and 1e13, planned by the law fitted from 3e11 up (1.5 h).
# A stopped study goes on where it was; STAGES=fit,frontier starts from the committed
# docs/data/isoflop_runs.csv.
STAGES ?= lr,sweep,seeds,fit,frontier
scaling-demo: $(STAMP)
	$(BIN)/python -m llama_train.scaling.study --stages $(STAGES) $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
