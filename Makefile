# A fresh clone sets itself up: `make test` and `make audit` create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
MEGATRON_VERSION := 0.16.1

.PHONY: test lint bench audit clean docs-check docs-check-all

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned, so pip takes the local CPU wheel and never resolves a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev,megatron]' megatron-core==$(MEGATRON_VERSION) torch==$(TORCH_VERSION)
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python -m pytest

# Rerun every pasted output of README.md and docs/ (docs/docs-check.md); make test runs it too.
docs-check: $(STAMP)
	$(BIN)/python -m pytest tests/test_docs.py

# The slow transcripts as well: the Megatron audit and fuzzing of Megatron components.
docs-check-all: $(STAMP)
	SHARDCHECK_DOCS_ALL=1 $(BIN)/python -m pytest tests/test_docs.py -p no:timeout

# spmd_types 0.3.1, for the checker-overhead comparison only: its own folder, never a torch.
SPMD_TYPES := bench/.deps/spmd_types
$(SPMD_TYPES): | $(BIN)/python
	$(BIN)/pip install -q --no-deps --target bench/.deps spmd-types==0.3.1

bench: $(STAMP) $(SPMD_TYPES)
	$(BIN)/python bench/run_all.py

audit: $(STAMP)
	$(BIN)/shardcheck audit --out audit-out || test $$? -eq 1  # 1: findings (see audit-out/report.md)

clean:
	rm -rf $(VENV) .shardcheck audit-out
