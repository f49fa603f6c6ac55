# Two commands from a fresh machine:
#   make quickstart   create .venv, install nanolm, run every stage at tiny scale (~6 minutes on a laptop CPU)
#   make test         create .venv, install nanolm with its test extras, run the whole test suite
#
# TORCH pins the PyTorch build; the default is the CPU build this project is tested with.
# On a CUDA machine use e.g. `make TORCH=torch quickstart` to take PyPI's default (CUDA) build.

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install quickstart test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test,hf,gguf,serve,track]"
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/nanolm quickstart

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

bench: $(STAMP)
	$(BIN)/python bench/throughput.py --preset minimind-26m --seq-len 512 --batch-size 4

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
