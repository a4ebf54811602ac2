# Set-up is part of each target: a fresh machine needs nothing but python3 (3.10+).
# torch is pinned to the CPU build first (it lies on disk here); the package's own range
# (torch>=2.11) then installs nothing more, so no multi-GB CUDA build is ever pulled.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

.PHONY: setup demo test
setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m benchmarks $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(ARGS)
