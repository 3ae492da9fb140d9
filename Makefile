# make demo   set up, then generate text with the built-in tiny model
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
	$(PY) -m deepinfer.compiler.eager --prompt "Hello, DeepSeek!" --prompt "Static graphs"

test: setup
	$(PY) -m pytest -q
