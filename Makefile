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

.PHONY: demo info test sanitize sglang-reference

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
