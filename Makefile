# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Installs are idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
WORKSPACE ?= runs/demo

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

demo: install
	$(VENV)/bin/eagle3 discover   --config configs/demo.yaml --workspace $(WORKSPACE)
	$(VENV)/bin/eagle3 regenerate --config configs/demo.yaml --workspace $(WORKSPACE)
	$(VENV)/bin/eagle3 extract    --config configs/demo.yaml --workspace $(WORKSPACE)
	$(VENV)/bin/eagle3 train      --config configs/demo.yaml --workspace $(WORKSPACE)
	$(VENV)/bin/eagle3 status     --config configs/demo.yaml --workspace $(WORKSPACE)

test: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q

bench: install
	$(PY) benchmarks/dedupe.py
	$(PY) benchmarks/regenerate_client.py
	$(PY) benchmarks/extract.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/teacher_storage.py

clean:
	rm -rf runs .pytest_cache
