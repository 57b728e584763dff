"""CUDA-only behaviour: compile with reduce-overhead, streams, devices and
compute-sanitizer. Bit-exactness against the CPU kernel and the golden vectors
runs in test_ops.py on every device, CUDA graphs in test_op_contracts.py and the
eager range check in test_bad_input.py."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import CUDA, random_case

import torch_kvcanary as kc

pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _pool(device="cuda", pages=64, page_size=16, heads=2, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(-128, 127, (2, pages, page_size, heads, dim), dtype=torch.int8, generator=gen)
    return pool.view(torch.bfloat16).to(device)  # [2, blocks, block_size, heads, dim/2] bf16


def _sources(pool):
    return [kc.view_source(pool[i], read_bytes=kc.resolve_read_bytes(kc.HashMode.ALL)) for i in range(2)]


def _every_slot():
    """The sources of a pool on the GPU, every slot of it, and their folds on the current stream."""
    pool = _pool()
    sources = _sources(pool)
    slots = torch.arange(pool.shape[1] * pool.shape[2], device="cuda")
    return sources, slots, kc.fold(sources, slots)


def test_matches_cpu_on_random_layouts():
    for seed in range(40):
        cpu, slots, mode = random_case(seed, max_sources=20, lengths=range(3001))
        cuda = [type(s)(**{k: (v.cuda() if torch.is_tensor(v) else v) for k, v in vars(s).items()}) for s in cpu]
        assert torch.equal(kc.fold(cuda, slots.cuda(), mode=mode).cpu(), kc.fold(cpu, slots, mode=mode))


def test_compile_reduce_overhead():
    pool = _pool()
    sources = _sources(pool)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(slots):
        return kc.fold(sources, slots)

    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        slots = torch.randint(-1, pool.shape[1] * pool.shape[2], (128,), generator=gen).cuda()
        assert torch.equal(step(slots).clone(), kc.fold(sources, slots))


def test_non_default_stream():
    sources, slots, expected = _every_slot()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = kc.fold(sources, slots)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


def test_two_streams_at_once():
    sources, slots, expected = _every_slot()
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs.append([kc.fold(sources, slots) for _ in range(8)])
    torch.cuda.synchronize()
    assert all(torch.equal(o, expected) for batch in outs for o in batch)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_second_device():
    pool = _pool("cuda:1")
    slots = torch.arange(64, device="cuda:1")
    out = kc.fold(_sources(pool), slots)
    assert out.device == torch.device("cuda:1")
    assert torch.equal(out.cpu(), kc.fold(_sources(pool.cpu()), slots.cpu()))


_MEMCHECK_SCRIPT = """
import torch, torch_kvcanary as kc
pool = torch.randint(0, 255, (2, 9, 16, 2, 64), dtype=torch.uint8, device="cuda")
sources = [kc.view_source(pool[i, :, :, :, :48], read_bytes=kc.resolve_read_bytes(kc.HashMode.ALL)) for i in range(2)]
slots = torch.tensor([0, 143, -1, 77, 500], device="cuda")
for mode in kc.HashMode:
    kc.fold(sources * 9, slots, mode=mode, check_bounds=False)
torch.cuda.synchronize()
"""


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH")
def test_memcheck_clean():
    proc = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c", _MEMCHECK_SCRIPT],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
    )
    if "Device not supported" in proc.stdout + proc.stderr:
        pytest.skip("compute-sanitizer does not support this device here (a gVisor sandbox refuses it)")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout
