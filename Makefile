# The two set-up commands: `make run` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
CONFIG ?= configs/default.yaml
RUN_DIR ?= runs/demo

.PHONY: install run test bench clean

install: $(STAMP)

# `make run` installs the product and the `ui` extra (full mlflow: the `mlflow ui` a run prints needs
# flask and the web app); `make test` adds the test extra (moto, nbclient, ...).
$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# No GPU driver here: take the CPU torch build so pip does not pull CUDA wheels.
	command -v nvidia-smi >/dev/null 2>&1 || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[ui]"
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(RUN_STAMP)
	$(PY) -m workflow demo-data data/demo
	$(PY) -m workflow run --config $(CONFIG) --set run.source=data/demo --set run.dir=$(RUN_DIR)

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) -m benchmarks all

clean:
	rm -rf $(VENV) runs data/demo
