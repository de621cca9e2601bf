# A fresh clone sets itself up: `make test` and `make audit` create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# The default target: the newest release. The oldest supported one is tested too, from an
# overlay folder put first on PYTHONPATH (its own megatron/core, nothing else).
MEGATRON_VERSION := 0.19.2
MEGATRON_OLDEST := 0.16.1
MEGATRON_OLDEST_DIR := $(VENV)/megatron-core-$(MEGATRON_OLDEST)

.PHONY: test lint bench audit clean docs-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned, so pip takes the local CPU wheel and never resolves a CUDA build.
# megatron-core 0.19 declares Requires-Python >=3.12 but ships a cp311 wheel that runs here:
# it is installed alone with --ignore-requires-python (the flag applies to every package of a
# call, and would let pip pick a numpy made for a newer Python), then its dependencies and
# triton (imported by 0.19 at import time) normally. The `.[megatron]` extra then finds
# megatron-core installed and leaves it as it is.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q --no-deps --ignore-requires-python megatron-core==$(MEGATRON_VERSION)
	$(BIN)/pip install -q numpy 'packaging>=24.2' triton torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[dev,megatron]' torch==$(TORCH_VERSION)
	$(BIN)/pip install -q --no-deps --target $(VENV)/transformer-engine-2.20.2 transformer-engine==2.20.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 onnxscript==0.7.2 onnx-ir==1.1.0 onnx==1.23.2 ml-dtypes==0.7.0 protobuf==7.36.2
	touch $(STAMP)

$(MEGATRON_OLDEST_DIR): | $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(MEGATRON_OLDEST_DIR) megatron-core==$(MEGATRON_OLDEST)

lint: $(STAMP)
	$(BIN)/ruff check .

# The whole suite on the default megatron-core, then on the oldest release the Megatron tests
# that are not slow and the slow ones of megatron-core's own bugs (release_specific).
test: $(STAMP) lint $(MEGATRON_OLDEST_DIR)
	$(BIN)/python -m pytest
	PYTHONPATH=$(MEGATRON_OLDEST_DIR) $(BIN)/python -m pytest -m "megatron and (not slow or release_specific)"

# Rerun every pasted output of README.md and docs/ (docs/docs-check.md); make test runs it too.
docs-check: $(STAMP)
	$(BIN)/python -m pytest tests/test_docs.py

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
