# kvtier's two entry points: `make demo` (the main job) and `make test` (what CI runs).
# Each builds its own virtual environment in .venv on first use.

PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch (a local wheel on these machines). Unpinned, pip may pull a
# multi-GB CUDA build; on a GPU machine set TORCH to the build you want.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvtier-dev

.PHONY: test demo bench lint clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "kvtier needs Python >= 3.11 (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,bench]"
	touch $@

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/python scripts/bench_host.py

bench: $(STAMP)
	$(BIN)/python scripts/bench_host.py --json out/bench_host.json

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache .hypothesis
