# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Installs are idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
WORKSPACE ?= runs/demo

.PHONY: install browser demo serve test bench clean

install: $(STAMP)

# Headless Chromium drives the Prefect UI in `eagle3 ui-check` and tests/test_serve.py (Debian's package).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq >/dev/null && $$SUDO apt-get install -y -qq chromium >/dev/null; }; }

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

# The whole pipeline on the embedded default; run it again to resume (or continue) the same workspace.
demo: install
	$(VENV)/bin/eagle3 run    --config configs/demo.yaml --workspace $(WORKSPACE)
	$(VENV)/bin/eagle3 status --config configs/demo.yaml --workspace $(WORKSPACE)

# Deployments of every flow and the nightly pipeline, served until Ctrl-C (UI: http://127.0.0.1:4200).
serve: install
	$(VENV)/bin/eagle3 serve --config configs/demo.yaml --workspace $(WORKSPACE)

test: install browser
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q

bench: install
	$(PY) benchmarks/dedupe.py
	$(PY) benchmarks/regenerate_client.py
	$(PY) benchmarks/extract.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/teacher_storage.py
	$(PY) benchmarks/extract_workers.py
	$(PY) benchmarks/pipeline.py

clean:
	rm -rf runs .pytest_cache
