# autoshard developer entry points. `make test` bootstraps .venv on first use.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
# The torch to test against. The default, 2.13.0, is the CPU build pip finds on this machine's disk,
# in .venv. Any other supported release (`make test TORCH=2.15.0`) gets its own environment,
# .venv-torch<version>, with the build the package index serves (a CUDA build, which runs on CPU);
# the machine's pip constraints cap torch, and that environment lifts the cap for itself alone.
TORCH  ?= 2.13.0
ifeq ($(TORCH),2.13.0)
VENV   := .venv
PIP_ENV :=
else
VENV   := .venv-torch$(TORCH)
PIP_ENV := PIP_CONSTRAINT=/dev/null
endif
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: .venv venv demo test test-fast bench golden clean distclean

.venv venv: $(STAMP)

# torch goes in first and by exact version: a bare requirement would pull another build. Installing
# autoshard next must leave it alone (pyproject asks for a range that includes it): checked.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_ENV) $(PY) -m pip install --quiet --upgrade pip
	$(PIP_ENV) $(PY) -m pip install --quiet 'torch==$(TORCH)'
	$(PIP_ENV) $(PY) -m pip install --quiet -e '.[test]'
	$(PY) -c "import sys, torch; v = torch.__version__.split('+')[0]; \
	  sys.exit(0 if v == '$(TORCH)' else f'installing autoshard replaced torch $(TORCH) with {v}')"
	touch $@

demo: $(STAMP)
	$(PY) examples/demo.py

# The whole suite runs on JOBS pytest-xdist workers, each test file on one worker (a file's module
# fixtures launch their ranks once). A test that launches ranks leaves the cores idle about 40% of
# its time (rank 0 solves while the others wait; the caller plans and checks), and the other
# worker's tests fill it (docs/testing.md: 22.1 min against 27.6 min in two parts, ranks one test
# at a time). PYTEST_ARGS, when given, runs just those, in one process.
JOBS ?= auto
test: $(STAMP)
ifeq ($(strip $(PYTEST_ARGS)),)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n $(JOBS) --dist loadfile tests
else
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra $(PYTEST_ARGS)
endif

# The quick lane while editing: in-process tests of tracing, strategies, rules, the cost and
# memory models and small plans (about 100 s here, none that launches ranks). `make test` runs all.
FAST_TESTS := annotate cluster costmodel errors memory normalize notation planning progress rules sanity \
              strategies torch_adapter trace
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n $(JOBS) -m "not world" $(FAST_TESTS:%=tests/test_%.py)

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
	rm -rf .venv .venv-torch*
