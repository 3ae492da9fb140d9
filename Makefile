# make demo   set up, compile the tiny recipe with AOTInductor, generate from the bundle
# make test   set up, then run the whole suite
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test

setup: $(VENV)/.installed

# torch==2.13.0 is the CPU build on this machine's disk; a bare `torch` would pull a CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

demo: setup
	$(VENV)/bin/deepinfer-compile recipes/tiny.yaml
	$(VENV)/bin/deepinfer-run --bundle artifacts/tiny --prompt "Hello, DeepSeek!" --max-tokens 24

test: setup
	$(PY) -m pytest -q
