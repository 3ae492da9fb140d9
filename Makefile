# make demo   set up, compile the trained tiny V3 (AOTInductor) and V4 (export), both with speculative decoding on, generate from both
# make test   set up with the test extra, then run the whole suite
# make serve  serve artifacts/tiny-code (compiled first if absent, here: its AOTInductor regions are allowed) over OpenAI's HTTP API on 127.0.0.1:8000
# make compile-all   compile every recipe in recipes/; bisect any that fails (reports under bisect/)
# make docs   the pages under docs/ as a site in build/site (mkdocs-material; a broken link fails)
VENV := .venv
PY := $(VENV)/bin/python

PIP_TORCH ?= torch==2.13.0

.PHONY: setup demo test serve compile-all docs

setup: $(VENV)/.installed

# What compile, run and serve need. torch==2.13.0 is the CPU build on this machine's disk; a bare
# `torch` would pull a CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q $(PIP_TORCH)
	$(VENV)/bin/pip install -q -e '.[serve]'
	touch $@

# The test extra on top: transformers, jax and torch-mlir, Ray, the clients the tests drive.
$(VENV)/.installed-test: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e '.[serve,test]'
	touch $@

demo: setup
	$(VENV)/bin/deepinfer-compile recipes/tiny-code.yaml
	$(VENV)/bin/deepinfer-run --bundle artifacts/tiny-code --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0.5 --seed 1
	$(VENV)/bin/deepinfer-compile recipes/tiny-v4-code.yaml
	$(VENV)/bin/deepinfer-run --bundle artifacts/tiny-v4-code --prompt "class Stack:" --max-tokens 64 --temperature 0.5 --seed 1

# Two test processes, a file each at a time (a module's compiled bundles stay in one process): most
# tests keep one core busy (tracing, loading, one compile), so two halve the suite on 2 cores. Each
# process, and what it starts, gets one thread: two processes of two threads on 2 cores slowed eager
# tests ~5x (torch's threads spin-wait for a core the other process holds), the suite 28 -> 22 min.
# The slowest tests are listed at the end, for keeping the suite under CI's 30 minutes.
test: $(VENV)/.installed-test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

serve: setup
	test -f artifacts/tiny-code/manifest.json || $(VENV)/bin/deepinfer-compile recipes/tiny-code.yaml
	$(VENV)/bin/deepinfer-serve --bundle artifacts/tiny-code --native-regions allow

compile-all: setup
	@status=0; for recipe in recipes/*.yaml; do \
		$(VENV)/bin/deepinfer-compile $$recipe || { status=1; $(VENV)/bin/deepinfer-compile bisect $$recipe; }; \
	done; exit $$status

docs: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e '.[docs]'
	$(VENV)/bin/mkdocs build
