"""Shared test helpers: the golden vectors' sources and random cache layouts."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from golden import golden_tensor
from torch.torch_version import TorchVersion

import torch_kvcanary as kc

REPO = Path(__file__).resolve().parents[1]
# The release's version, from its one source (the package says it from its installed metadata).
PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CUDA = torch.cuda.is_available()
# What an op called directly raises for a refused argument other than an index out of range
# (csrc/plan/checks.h): the kernels throw std::invalid_argument, which torch raises as
# ValueError, and as RuntimeError from 2.15 on. The package's functions raise the documented
# types on every torch (torch_kvcanary/ops.py).
RAW_OP_REFUSAL = ValueError if TorchVersion(torch.__version__) < (2, 15) else RuntimeError
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))]

# dtypes a KV cache is stored in, with the element size of each
DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64]


def golden_source(spec: dict, device: str = "cpu"):
    """A golden case's source (tests/data/fold_vectors.json) as the package's source."""
    tensor = golden_tensor(spec, device)
    if spec["form"] == "rows":
        return kc.RealKvSource(
            tensor=tensor,
            page_size=spec["page_size"],
            num_bytes_per_token=spec["num_bytes_per_token"],
            read_bytes=spec["read_bytes"],
        )
    return kc.view_source(tensor, read_bytes=spec["read_bytes"])


def random_bytes(shape, dtype: torch.dtype, generator: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """A tensor of random bit patterns (NaNs and all), made on `device`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).squeeze(-1).to(device)


def random_view_source(rng: random.Random, gen: torch.Generator, device: str = "cpu"):
    """A view-form source with holes: padded pages, slots and token dims, a storage
    offset, and the page/slot/head dims in a random memory order."""
    dtype = rng.choice(DTYPES)
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_chunk = 16 // itemsize
    num_pages, page_size = rng.randint(1, 6), rng.choice([1, 2, 3, 16])
    heads, dim = rng.randint(1, 3), per_chunk * rng.randint(1, 4)
    pad_pages, pad_slots, pad_heads = rng.randint(0, 2), rng.randint(0, 1), rng.randint(0, 1)
    pad_dim = per_chunk * rng.randint(0, 1)
    # Physical order of the (page, slot, head) axes; the dim axis stays innermost.
    order = rng.sample(range(3), 3)
    logical = [num_pages + pad_pages, page_size + pad_slots, heads + pad_heads]
    base = random_bytes([logical[i] for i in order] + [dim + pad_dim], dtype, gen, device)
    inverse = [order.index(i) for i in range(3)]
    full = base.permute(*inverse, 3)
    view = full[pad_pages:, :page_size, :heads, :dim]
    read_bytes = rng.choice([16 * rng.randint(1, heads * dim * itemsize // 16), sys.maxsize])
    return kc.view_source(view, read_bytes=read_bytes)


def random_row_source(rng: random.Random, gen: torch.Generator, device: str = "cpu"):
    """A row-form source: rows of page_size tokens plus trailing bytes, rows
    strided inside a wider buffer."""
    page_size, token = rng.choice([1, 2, 4, 16]), 16 * rng.randint(1, 6)
    rows, tail, gap = rng.randint(1, 8), 16 * rng.randint(0, 2), 16 * rng.randint(0, 2)
    buffer = random_bytes([rows, page_size * token + tail + gap], torch.uint8, gen, device)
    tensor = buffer[:, : page_size * token + tail]
    read_bytes = 16 * rng.randint(1, token // 16)
    return kc.RealKvSource(tensor=tensor, page_size=page_size, num_bytes_per_token=token, read_bytes=read_bytes)


def random_slots(rng: random.Random, cap: int, n: int, dtype=torch.int64, device: str = "cpu") -> torch.Tensor:
    """Slots in [0, cap) with some -1 padding mixed in."""
    values = [rng.randrange(cap) if rng.random() > 0.1 else -rng.randint(1, 3) for _ in range(n)]
    return torch.tensor(values, dtype=dtype, device=device)


def random_case(seed: int, device: str = "cpu", *, max_sources: int = 8, lengths=range(41)):
    """(sources, slots, mode): 1..max_sources view- and row-form sources, int32 or int64
    slots of a length drawn from `lengths` (with padding), and a mode."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    make = [random_view_source, random_row_source]
    sources = [rng.choice(make)(rng, gen, device) for _ in range(rng.randint(1, max_sources))]
    capacity = min(s.capacity for s in sources)
    slots = random_slots(rng, capacity, rng.choice(lengths), rng.choice([torch.int32, torch.int64]), device)
    return sources, slots, rng.choice(list(kc.HashMode))


# (dtype, unit_shape): bf16 heads, fp8 heads, fp32 scale sidecars of one float, units of 12
# and 20 bytes (the last word zero-padded), 2-D units (whose rows random_digest_view may pad,
# making units of several runs: of 24, 12 and 4 bytes)
UNIT_KINDS = [
    (torch.bfloat16, (16,)),
    (torch.float8_e4m3fn, (32,)),
    (torch.float32, ()),
    (torch.float32, (3,)),
    (torch.float16, (10,)),
    (torch.uint8, (2, 24)),
    (torch.float32, (2, 3)),
    (torch.uint8, (3, 4)),
    (torch.int64, (5,)),
]


def random_digest_view(rng: random.Random, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """A view [num_pages, page_size, units, *unit_shape] with holes: padded pages, slots, units
    and (sometimes) unit rows, a storage offset, and the page/slot/unit dims in a random memory
    order; the innermost dim stays contiguous."""
    dtype, unit_shape = rng.choice(UNIT_KINDS)
    num_pages, page_size, units = rng.randint(1, 5), rng.choice([1, 2, 3, 8]), rng.randint(1, 5)
    pad = [rng.randint(0, 2), rng.randint(0, 1), rng.randint(0, 1)]
    inner_pad = [rng.randint(0, 2) if len(unit_shape) == 2 and i == 1 else 0 for i in range(len(unit_shape))]
    order = rng.sample(range(3), 3)
    logical = [num_pages + pad[0], page_size + pad[1], units + pad[2]]
    inner = [n + p for n, p in zip(unit_shape, inner_pad)]
    base = random_bytes([logical[i] for i in order] + inner, dtype, gen, device)
    full = base.permute(*[order.index(i) for i in range(3)], *range(3, 3 + len(inner)))
    view = full[pad[0] :, :page_size, pad[2] :]
    return view[(...,) + tuple(slice(0, n) for n in unit_shape)] if unit_shape else view


def random_entries(rng: random.Random, capacity: int, n: int, num_groups: int, device: str, dtype=torch.int64):
    """n digest entries (slots, positions, groups): slots in [0, capacity) with some padding mixed in."""
    slots = [rng.randrange(capacity) if rng.random() > 0.15 else -rng.randint(1, 3) for _ in range(n)]
    top = 1 << (40 if dtype == torch.int64 else 30)
    positions = [rng.randrange(-5, top) for _ in range(n)]
    groups = [rng.randrange(num_groups) for _ in range(n)]
    as_tensor = lambda v: torch.tensor(v, dtype=dtype, device=device)  # noqa: E731
    return as_tensor(slots), as_tensor(positions), as_tensor(groups)


def random_digest_case(seed: int, device: str = "cpu", *, max_entries: int = 90):
    """(views, unit_offsets, slots, positions, groups, num_groups): 1..4 random digest views and
    up to max_entries entries of int32 or int64."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    views = [random_digest_view(rng, gen, device) for _ in range(rng.randint(1, 4))]
    offsets = [rng.randrange(1 << 62) for _ in views]
    capacity = min(v.shape[0] * v.shape[1] for v in views)
    num_groups = rng.randint(1, 4)
    dtype = rng.choice([torch.int32, torch.int64])
    slots, positions, groups = random_entries(rng, capacity, rng.randint(0, max_entries), num_groups, device, dtype)
    return views, offsets, slots, positions, groups, num_groups


# What vLLM's CPU build serves depends on the host's x86 instruction set, which it checks
# with torch's own probes: an fp8 KV cache needs AVX-512 or AMX (vllm/v1/attention/backends/
# cpu_attn.py), and MLA models keep prefix caching and chunked prefill only on AMX, where
# they take AMX_MLA (vllm/platforms/cpu.py). A vLLM test that needs one of them skips
# elsewhere with its reason here; these are the only skips `make test-vllm` accepts
# (build_tools/check_vllm_skips.py).
HOST_AMX = torch.cpu._is_amx_tile_supported()
HOST_AVX512 = torch.cpu._is_avx512_supported()
ISA_SKIP_REASONS = {
    "fp8 KV cache": "host lacks AVX-512 and AMX: vLLM's CPU build serves an fp8 KV cache only with AVX-512 or AMX",
    "MLA prefix caching": "host lacks AMX: vLLM's CPU build turns prefix caching off for MLA models without AMX",
}


def needs_isa(need: str, available: bool) -> pytest.MarkDecorator:
    """Skips a vLLM test where the host lacks what vLLM's CPU build needs for ``need`` (a key
    of ``ISA_SKIP_REASONS``)."""
    return pytest.mark.skipif(not available, reason=ISA_SKIP_REASONS[need])


@contextlib.contextmanager
def torch_threads(count: int):
    """Runs the block on ``count`` of torch's threads, then gives torch back the number it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ring_rows(violations) -> list[list[int]]:
    """Violations (``KvCanary.poll()``) as the ring rows spec_oracle.Records gives: kind, slot,
    position, stored token, expected token, stored chain, expected aux, reasons."""
    return [
        [int(v.kind), v.slot, v.position, v.stored_token, v.expected_token, v.stored_chain, v.expected_aux, int(v.reasons)]
        for v in violations
    ]


def refusal(exception: type[BaseException], call) -> str:
    """The message of what ``call()`` raises, which must be an ``exception``."""
    with pytest.raises(exception) as info:
        call()
    return str(info.value)


def refusal_lines(exception: type[BaseException], calls: dict) -> str:
    """A line ``name: message`` for each of ``calls`` (name -> call), each of which must raise an
    ``exception``, in their order."""
    return "\n".join(f"{name}: {refusal(exception, call)}" for name, call in calls.items())


def refusal_table_test(cases: list[tuple]):
    """The test of a table of refusals, rows (name, call, exception, message): each ``call()``
    raises an ``exception`` whose message starts with ``kv-canary: message``. A test module
    binds it as ``test_bad_input = refusal_table_test(CASES)``."""

    @pytest.mark.parametrize("name, call, exception, message", cases, ids=[c[0] for c in cases])
    def test_bad_input(name, call, exception, message):
        text = refusal(exception, call)
        assert text.startswith("kv-canary: " + message), text

    return test_bad_input


# The CPU kernels' instruction-set paths, from the least to the best.
CPU_PATHS = ["scalar", "avx2", "avx512"]


def run_python(args: list[str], **env: str | None) -> subprocess.CompletedProcess:
    """`python *args` in a child process that imports this process's torch_kvcanary, with the
    environment variables `env` set (None: unset). It runs in tests/, so that nothing on its
    path comes before that package."""
    environ = {name: value for name, value in os.environ.items() if name not in env}
    environ.update({name: value for name, value in env.items() if value is not None})
    package_root = str(Path(kc.__file__).resolve().parents[1])
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=REPO / "tests", env=environ, capture_output=True, text=True, timeout=900)


def best_cpu_path() -> str:
    """The best instruction-set path this CPU has: the one a process takes unless
    KVCANARY_CPU_ISA names a lesser one. A process reads the variable once, so when it is set
    here a child without it is asked."""
    if not os.environ.get("KVCANARY_CPU_ISA"):
        return torch.ops.kvcanary.cpu_isa()
    child = run_python(["-c", "import torch, torch_kvcanary; print(torch.ops.kvcanary.cpu_isa())"], KVCANARY_CPU_ISA=None)
    assert child.returncode == 0, child.stderr
    return child.stdout.strip()
