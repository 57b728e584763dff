#!/usr/bin/env bash
# The GPU check, for a lent GPU machine, in one call (under 8 minutes): install the
#   package's wheel when one is carried in .whl/ (else build the extension there, for that
#   machine's GPU, against its torch); check the engine step's call on the GPU
#   (benchmarks/paged_step_device.py); run the tests that use the GPU (compute-sanitizer
#   memcheck among them; the CPU ones run in CI); run the GPU benchmark's goal cases (and its
#   sweep with DEVICE_CHECK_SWEEP=1); print a short table last. The log and the JSON go
#   under $OUT.
# That machine has no package registry: the wheels it lacks travel in .whl/ (fill it with
# build_tools/device_carry.sh, then carry .whl, and .sglang for the SGLang oracle's tests).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
status=0
step() { echo; echo "== $* =="; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'cxx11 abi', torch._C._GLIBCXX_USE_CXX11_ABI)"
c++ --version | head -1; uname -r; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
CUDA_HOME=$(python3 -c "import sys; sys.path.insert(0, '.'); from build_tools.build_ext import find_cuda_home; print(find_cuda_home() or '')")
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"  # compute-sanitizer lives beside nvcc
export MAX_JOBS=${MAX_JOBS:-16}
# Only this machine's GPU architecture: a lent machine's minutes are few.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}

if ls .whl/torch_kvcanary-*.whl >/dev/null 2>&1; then
  # Carried: the package's wheel as CI builds it (elsewhere, against another torch),
  # installed in /tmp/site above. Its libraries also go beside the source tree's
  # package, which a process started here imports first: either copy is the same.
  step "the carried wheel, under this machine's torch"
  ls .whl/torch_kvcanary-*.whl
  cp /tmp/site/torch_kvcanary/*.so torch_kvcanary/
else
  step "build against this machine's torch"
  python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . || { echo "BUILD FAILED"; exit 1; }
fi
python3 -m torch_kvcanary info || status=1
# The libstdc++ the process loads beside the one the extension was compiled against (a
# C++ error message crashed on the GPU machine: see docs/figures_cuda.md).
python3 -c "import torch_kvcanary, re; print(sorted({l.split()[-1] for l in open('/proc/self/maps') if re.search(r'libstdc|libgomp|libiomp', l)}))"
python3 -X faulthandler -c "import torch, torch_kvcanary as kc; kc.fold(kc.view_source(torch.zeros(4, 2, 64, dtype=torch.uint8), read_bytes=64), torch.tensor([8]))" 2>&1 | tail -3

step "the engine step on the GPU: no wait, kernels per call, a CUDA graph's replay, host us per call"
timeout 120 python3 -m benchmarks.paged_step_device --device cuda --layers 1 12 80 --requests 8 64 256 --json "$OUT/paged_step_cuda.json" | tee "$OUT/paged_step_cuda.txt" || status=1
timeout 60 python3 -m benchmarks.paged_step_device --device cuda --mode PARTIAL --layers 1 80 --requests 8 256 --json "$OUT/paged_step_cuda_partial.json" | tee "$OUT/paged_step_cuda_partial.txt" || status=1

step "the tests that use the GPU (memcheck included)"
# In worker processes when pytest-xdist is there: a test that crashes fails alone.
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 200 python3 -m pytest -q -rs ${workers} -k cuda --durations=10 --junitxml="$OUT/tests.xml" tests || status=1

step "GPU benchmark: the goal cases"
timeout 100 python3 -m benchmarks.bench --device cuda --goals --min-run-time 0.3 --json "$OUT/bench_cuda.json" | tee "$OUT/bench_cuda.txt" || status=1

if [ "${DEVICE_CHECK_SWEEP:-0}" = 1 ]; then
  step "GPU benchmark: the sweep"
  timeout 150 python3 -m benchmarks.bench --device cuda --min-run-time 0.2 --json "$OUT/bench_cuda_sweep.json" --plot "$OUT/bench_cuda_sweep.png" | tee "$OUT/bench_cuda_sweep.txt" || status=1
fi

step "summary"
python3 - "$OUT/bench_cuda.json" "$OUT/tests.xml" <<'PY'
import json, sys, xml.etree.ElementTree as ET
bench = json.load(open(sys.argv[1]))
try:
    suite = ET.parse(sys.argv[2]).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    print(f"tests: {suite.get('tests')} run, {suite.get('failures')} failed, {suite.get('errors')} errors, {suite.get('skipped')} skipped")
except OSError:
    print("tests: no report (pytest did not finish)")
for r in bench["results"]:
    c, base = r["case"], r["baselines"]
    ratio = lambda k: f"{base[k] / r['seconds']:.2f}" if k in base else "-"
    print(f"{c['mode']:7} {c['read_bytes']:5}B x {c['num_slots']:8} slots x {c['num_sources']} {c['order']:6}: "
          f"{r['bytes_per_s'] / 1e9:8.1f} GB/s {r['slots_per_s'] / 1e9:6.2f} Gslot/s  /copy {ratio('stream')}  x upstream {ratio('upstream')}")
graph = bench.get("cuda_graph_decode") or {}
if graph:
    print(f"decode step from a CUDA graph: {graph['decode_fold_us']:.2f} us (launch floor {graph['launch_floor_us']:.2f} us)")
PY
echo "device check exit status: $status"
exit $status
