# autoshard developer entry points. `make test` bootstraps .venv on first use.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch is pinned and installed first: a bare torch requirement would pull the CUDA build.
TORCH  := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: .venv venv demo test bench golden clean distclean

.venv venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra $(or $(PYTEST_ARGS),tests)

bench: $(STAMP)
	mkdir -p bench/out
	for f in bench/*.py; do \
	  [ -e "$$f" ] || { echo "no bench/*.py scripts"; break; }; \
	  echo "== $$f"; OMP_NUM_THREADS=1 $(PY) "$$f"; \
	done

# Prints what changed per case and rewrites those files; exits non-zero, leaving a case's file
# as it was, when its solve is not proven optimal. GOLDEN_CASES="gpt llama" re-plans only those.
GOLDEN_CASES ?=
golden: $(STAMP)
	if [ -f tests/golden_update.py ]; then OMP_NUM_THREADS=1 $(PY) -m tests.golden_update $(GOLDEN_CASES); \
	else echo "golden: tests/golden_update.py not found, nothing to do"; fi

clean:
	find . \( -path ./$(VENV) -o -path ./.git \) -prune -o -type d -name __pycache__ -exec rm -rf {} +
	rm -rf .pytest_cache build dist *.egg-info

distclean: clean
	rm -rf $(VENV)
