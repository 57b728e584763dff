# The two commands of the README: `make demo` (the main job) and `make test`.
# Each creates $(VENV) when missing, installs torch and the test tools, and
# builds the extension ahead of time; both are quick once that is done.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1
PYTEST_ARGS ?=

BIN := $(VENV)/bin
BUILD_INPUTS := pyproject.toml $(wildcard build_tools/*.py) $(wildcard csrc/*)

.PHONY: demo info test sanitize

demo: $(VENV)/.built
	$(BIN)/python -m torch_kvcanary demo

info: $(VENV)/.built
	$(BIN)/python -m torch_kvcanary info

test: $(VENV)/.built
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

$(VENV)/.deps: build_tools/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)" -r build_tools/requirements.txt
	echo "$(TORCH)" > $@

$(VENV)/.built: $(VENV)/.deps $(BUILD_INPUTS)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

# The CPU kernel under AddressSanitizer and UndefinedBehaviorSanitizer (see the script).
sanitize: $(VENV)/.deps
	build_tools/sanitizer_check.sh $(abspath $(BIN))/python
