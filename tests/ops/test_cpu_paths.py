"""Each instruction-set path of the CPU kernels is bit-exact with the reference on the golden
vectors and on random layouts. A process takes one path, chosen when a kernel first runs: the
best one its CPU has, or the lesser one KVCANARY_CPU_ISA names. So the tests of this module,
and the digest's and verify's tests that depend on the path, run on this process's path, and
test_every_path reruns them in a child process for each other path."""

import os

import pytest
import torch
from golden import load_golden
from helpers import CPU_PATHS, best_cpu_path, golden_source, random_case, run_python, torch_threads

import torch_kvcanary as kc

# The tests that run once per path.
PER_PATH_TESTS = [
    "ops/test_cpu_paths.py",
    "digest/test_digest.py::test_cpu_path_matches_the_spec",
    "digest/test_digest.py::test_last_unit_of_a_tight_view",
    "canary/test_canary_records.py::test_calls_of_many_tasks_and_threads_match_the_spec",
]


def test_the_path_taken(cpu_path):
    # The one KVCANARY_CPU_ISA names (test_every_path's children), else the best one.
    forced = os.environ.get("KVCANARY_CPU_ISA")
    if forced:
        assert cpu_path == forced
    else:
        assert cpu_path in CPU_PATHS


def test_the_path_is_chosen_once(cpu_path, monkeypatch):
    # KVCANARY_CPU_ISA is read when a kernel first runs and never again: a later value, even
    # one no CPU runs, changes nothing.
    sources, slots, mode = random_case(7)
    monkeypatch.setenv("KVCANARY_CPU_ISA", "sse9")
    assert torch.ops.kvcanary.cpu_isa() == cpu_path
    assert torch.equal(kc.fold(sources, slots, mode=mode), kc.reference_fold(sources, slots, mode=mode))


@pytest.mark.parametrize("path", CPU_PATHS)
def test_every_path(path, cpu_path):
    if CPU_PATHS.index(path) > CPU_PATHS.index(best_cpu_path()):
        pytest.skip(f"this CPU cannot run the {path} path")
    if path == cpu_path:
        pytest.skip(f"the {path} path is this process's: the tests run on it here")
    child = run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not test_every_path", *PER_PATH_TESTS], KVCANARY_CPU_ISA=path
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout.splitlines()[-1], child.stdout[-2000:]


def test_golden_vectors(cpu_path):
    for case in load_golden():
        sources = [golden_source(spec) for spec in case["sources"]]
        slots = torch.tensor(case["slots"], dtype=torch.int64)
        expected = torch.tensor(case["expected"], dtype=torch.int64)
        assert torch.equal(kc.fold(sources, slots, mode=kc.HashMode[case["mode"]]), expected), case["name"]


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts(cpu_path, seed):
    # long enough for whole lane groups, short tails and padding in every group position
    sources, slots, mode = random_case(1000 + seed, lengths=[1, 7, 63, 64, 65, 200, 1500])
    assert torch.equal(kc.fold(sources, slots, mode=mode), kc.reference_fold(sources, slots, mode=mode))


@pytest.mark.parametrize("read_bytes", [16, 48, 64, 80, 128, 192, 1024, 1040])
def test_block_and_chunk_tails(cpu_path, read_bytes):
    # Rows read in 64-byte blocks (1, 2, 3 and 16 of them: the AVX-512 path loads the next block
    # while it hashes one) plus a 16-byte-chunk tail: contiguous tokens, tokens in
    # runs of 64 bytes (blocks allowed), of 48 bytes and of 16 bytes (chunks only).
    gen = torch.Generator().manual_seed(read_bytes)
    pool = torch.randint(0, 256, (300, 2, 1040), dtype=torch.uint8, generator=gen)
    runs = pool.view(300, 2, 13, 80)
    sources = [
        kc.view_source(pool[:, :, :read_bytes], read_bytes=read_bytes),
        kc.view_source(runs[..., :64], read_bytes=min(read_bytes, 13 * 64)),
        kc.view_source(runs[..., :48], read_bytes=min(read_bytes, 13 * 48)),
        kc.view_source(pool.view(300, 2, 65, 16)[:, :, ::2], read_bytes=min(read_bytes, 33 * 16)),
    ]
    slots = torch.randint(-1, 600, (500,), generator=gen)
    for source in sources:
        assert torch.equal(kc.fold(source, slots), kc.reference_fold(source, slots))


@pytest.mark.parametrize("rows, row_bytes, num_slots", [(4096, 256, 20000), (64, 8208, 2000)])
def test_threads_agree(cpu_path, rows, row_bytes, num_slots):
    # Many tasks per thread (each thread prefetches the start of the next task it claims),
    # two sources (each group prefetches the next source's tokens), and rows past the 4 KiB
    # that the prefetch requests of each token.
    gen = torch.Generator().manual_seed(5)
    pool = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen)
    sources = [
        *kc.make_row_source(layer_buffer=pool, read_bytes=row_bytes),
        kc.view_source(pool[:, 64:].unsqueeze(1), read_bytes=row_bytes - 64),
    ]
    slots = torch.randint(-1, rows, (num_slots,), generator=gen)
    results = []
    for n in range(1, max(torch.get_num_threads(), 2) + 1):
        with torch_threads(n):
            results.append(kc.fold(sources, slots))
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0], kc.reference_fold(sources, slots))


@pytest.mark.parametrize("read_bytes", [16, 64, 256])
def test_every_batch_size_up_to_two_groups(cpu_path, read_bytes):
    # Whole groups and the rest: the rest is folded in a narrower group (1, 2, 4 or all
    # vectors), with padding and out-of-range slots in it.
    gen = torch.Generator().manual_seed(read_bytes + 7)
    pool = torch.randint(0, 256, (97, 2, 256), dtype=torch.uint8, generator=gen)
    sources = [kc.view_source(pool, read_bytes=read_bytes), kc.view_source(pool[:, :, :128], read_bytes=min(read_bytes, 128))]
    batch = torch.randint(-1, 194, (130,), generator=gen)
    for n in range(1, 131):
        slots = batch[:n]
        expected = kc.reference_fold(sources, slots)
        assert torch.equal(kc.fold(sources, slots), expected), n
        assert torch.equal(kc.fold(sources, slots.int()), expected), n


@pytest.mark.parametrize("run_bytes", [None, 64, 32])
def test_small_batches_over_sources_of_one_token_layout(cpu_path, run_bytes):
    # A few slots over many sources that read the same bytes of their tokens (lanes then
    # take (source, slot) pairs): the sources differ in page size, strides and bytes, and
    # the tokens are contiguous or runs of 64 or 32 bytes of two heads.
    gen = torch.Generator().manual_seed(run_bytes or 1)
    sources = []
    for i in range(11):
        page_size = (1, 4, 16)[i % 3]
        pool = torch.randint(0, 256, (96 // page_size + i, page_size, 2, 96), dtype=torch.uint8, generator=gen)
        view = pool if run_bytes is None else pool[..., :run_bytes]
        sources.append(kc.view_source(view, read_bytes=view[0, 0].numel()))
    for n in (1, 2, 5, 9, 31, 63, 64, 70):
        slots = torch.randint(-1, 100, (n,), generator=gen)  # capacity 96: a few out of range
        expected = kc.reference_fold(sources, slots.where(slots < 96, -1))
        assert torch.equal(kc.fold(sources, slots, check_bounds=False), expected), n
        assert torch.equal(kc.fold(sources[:2], slots, check_bounds=False), kc.reference_fold(sources[:2], slots.where(slots < 96, -1))), n
