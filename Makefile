# Two commands a newcomer needs:  `make run` (set up + live server)  and  `make test` (set up + whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: setup run test lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# cluster: Ray, for the scale-out workers (engine/cluster) and their tests; ndi: the NDI runtime
	# (docs/ndi.md), so the NDI tests run rather than skip.
	$(PY) -m pip install -q -e '.[dev,cluster,ndi]'
	touch $@

run: setup
	$(VENV)/bin/diffcast serve --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest -q -ra

lint: setup
	$(VENV)/bin/ruff check app engine tests demos
	$(VENV)/bin/mypy app engine
