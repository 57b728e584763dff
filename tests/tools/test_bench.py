"""The benchmark: its figures and files, and the upstream-style CUDA baseline it times."""

import ctypes
import json
import os
import shutil
import subprocess

import pytest
import torch
from helpers import CUDA, DEVICES, REPO

import torch_kvcanary as kc
from benchmarks import bench, upstream_baseline

pytestmark = pytest.mark.dev_tool

NVCC = upstream_baseline.find_nvcc() is not None


@pytest.mark.parametrize("device", DEVICES)
def test_run_case_times_the_fold_beside_its_baselines(device):
    case = bench.Case("ALL", 256, 512, 2, "random")
    result = bench.run_case(case, device, min_run_time=0.01, upstream=device == "cuda")
    assert result.seconds > 0 and result.repeats >= 1
    assert result.bytes_per_s == pytest.approx(512 * 256 * 2 / result.seconds)
    expected = {"stream", "gather", "reference"} | ({"upstream"} if device == "cuda" else set())
    if device == "cpu" and bench._xxh3_64() is not None:
        expected.add("xxh3_64")
    assert set(result.baselines) == set(result.baseline_repeats) == expected
    assert all(result.ratio(name) > 0 and result.baseline_repeats[name] >= 1 for name in expected)


def test_xxh3_baseline_hashes_the_folded_bytes_laid_out_contiguously(monkeypatch):
    hashed = []
    monkeypatch.setattr(bench, "_xxh3_64", lambda: lambda buffer: hashed.append(bytes(buffer)))
    case = bench.Case("PARTIAL", 64, 300, 2, "random")
    result = bench.run_case(case, "cpu", min_run_time=0.01)
    assert "xxh3_64" in result.baselines and result.ratio("xxh3_64") > 0
    # PARTIAL folds the first 16 bytes of each slot (docs/spec.md), of each of the 2 sources.
    assert hashed and all(len(b) == 300 * 16 * 2 for b in hashed)


def test_xxh3_baseline_is_left_out_with_a_note_without_xxhash(monkeypatch):
    monkeypatch.setattr(bench, "_xxh3_64", lambda: None)
    result = bench.run_case(bench.Case("ALL", 64, 64, 1, "seq"), "cpu", min_run_time=0.01)
    assert "xxh3_64" not in result.baselines
    assert any("xxhash" in note for note in result.notes)


def test_cli_writes_table_and_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--quick", "--min-run-time", "0.002", "--json", str(path)]) == 0
    table = capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert len(payload["results"]) == len(bench.default_cases(quick=True))
    assert payload["machine"]["cpu_isa"] == torch.ops.kvcanary.cpu_isa()
    for row in payload["results"]:
        assert row["seconds"] > 0 and row["repeats"] >= 1 and row["baselines"]["stream"] > 0
        assert set(row["baseline_repeats"]) == set(row["baselines"]) and min(row["baseline_repeats"].values()) >= 1
    assert table.count("\ncpu ") == len(payload["results"])
    assert table.splitlines()[0].split()[-2:] == ["n", "nb"]


def test_plot_series_keeps_one_slot_count():
    def result(read_bytes, num_slots, order="random", mode="ALL", sources=1):
        return bench.Result("cpu", bench.Case(mode, read_bytes, num_slots, sources, order), 1.0, 1)

    results = [
        result(1024, 64),
        result(256, 64),
        result(256, 1),
        result(256, 4096),
        result(16, 64),
        result(64, 64, order="seq"),
        result(64, 64, mode="PARTIAL"),
        result(64, 64, sources=2),
    ]
    series = bench.read_bytes_series(results, "cpu", "random")
    assert [(r.case.read_bytes, r.case.num_slots) for r in series] == [(16, 64), (256, 64), (1024, 64)]
    assert bench.read_bytes_series(results, "cuda", "random") == []


@pytest.mark.skipif(not NVCC, reason="nvcc is not on PATH and CUDA_HOME is unset")
def test_upstream_baseline_builds_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    library = upstream_baseline.build_library("90")
    assert library.parent == tmp_path / "torch_kvcanary" and library.stat().st_size > 0
    assert hasattr(ctypes.CDLL(str(library)), "upstream_fold_launch")
    built = library.stat().st_mtime_ns
    assert upstream_baseline.build_library("90") == library and library.stat().st_mtime_ns == built  # cached
    assert [p.name for p in library.parent.iterdir()] == [library.name]  # no scratch left


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_upstream_baseline_gives_the_folds_fingerprints():
    gen = torch.Generator().manual_seed(3)
    pools = [torch.randint(0, 256, (1000, 320), dtype=torch.uint8, generator=gen).cuda() for _ in range(3)]
    slots = torch.cat([torch.randint(0, 1000, (4000,), generator=gen), torch.tensor([-1])]).cuda()
    sources = [kc.view_source(p[:, :256].unsqueeze(1), read_bytes=256) for p in pools]
    assert torch.equal(upstream_baseline.upstream_fold(pools, 256)(slots), kc.fold(sources, slots))


def _kernel_ab(base, *args: str) -> subprocess.CompletedProcess:
    command = [str(REPO / "tools" / "kernel_ab.sh"), str(base), "--pool-mib", "1", "--rounds", "2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="tools/kernel_ab.sh needs a C++ compiler")
def test_kernel_ab_times_two_builds_and_compares_their_fingerprints(tmp_path):
    same = _kernel_ab(REPO / "csrc", "--isa", torch.ops.kvcanary.cpu_isa(), "--row-bytes", "256")
    assert same.returncode == 0, same.stderr
    assert "4096 slots of 256 bytes" in same.stdout and "fingerprints agree" in same.stdout
    # A build whose hash differs must be caught, or "agree" would mean nothing.
    changed = tmp_path / "csrc"
    shutil.copytree(REPO / "csrc", changed)
    math_h = changed / "core" / "fold_math.h"
    math_h.write_text(math_h.read_text().replace("0xBF58476D1CE4E5B9ull", "0xBF58476D1CE4E5BBull"))
    differ = _kernel_ab(changed, "--isa", "scalar")
    assert differ.returncode == 1 and "fingerprints DIFFER" in differ.stdout


def test_call_overhead_times_the_fold_and_the_op_per_call(tmp_path, capsys):
    path = tmp_path / "overhead.json"
    assert bench.main(["--call-overhead", "--min-run-time", "0.05", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    times = figures["call_overhead_us"]
    assert set(times) == {"fold", "op"} and all(us > 0 for us in times.values())
    by_sources = figures["fold_op_us_by_sources"]  # by read and form: K and V of 1, 12 and 80 layers
    assert {(read, form) for read in by_sources for form in by_sources[read]} == {
        (r, f) for r in ("ALL", "PARTIAL") for f in ("Tensor[]", "bound")
    }
    for by_form in by_sources.values():
        for us_by_count in by_form.values():
            assert set(us_by_count) == {"2", "24", "160"} and all(us > 0 for us in us_by_count.values())
    first, *by_read = capsys.readouterr().out.splitlines()
    assert first.startswith("fold of 256 slots (1 source of 256 B, in cache), us per call: fold ")
    assert [line.split(";")[1].split(")")[0] for line in by_read] == [" ALL: each source's read_bytes", " PARTIAL: 16 B"]
    assert all(", us per call, Tensor[] / bound: 2 sources " in line for line in by_read)


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_step_check_runs_clean_steps_and_says_what_it_measured(device, tmp_path, capsys):
    from benchmarks import paged_step_device

    path = tmp_path / "step.json"
    argv = ["--device", device, "--layers", "1", "2", "--requests", "3", "--context", "40", "--steps", "4", "--json", str(path)]
    assert paged_step_device.main(argv) == 0
    rows = json.loads(path.read_text())
    assert [(r["layers"], r["requests"]) for r in rows] == [(1, 3), (2, 3)]
    assert all(r["violations"] == 0 and r["host_us"] > 0 for r in rows)
    on_cuda = device == "cuda"
    assert all((r["graph"] == "equal" and r["syncs"] == "none" and r["kernels"] > 0) if on_cuda else r["graph"] is None for r in rows)
    assert all((r["queued_us"] > 0 and r["trivial_us"] > 0) if on_cuda else r["queued_us"] is r["trivial_us"] is None for r in rows)
    assert capsys.readouterr().out.splitlines()[0].startswith("| device | layers | requests | context | host us |")


def test_upstream_baseline_refuses_what_it_cannot_fold():
    with pytest.raises(ValueError, match="^kv-canary: the upstream baseline folds 1 to 8 pools"):
        upstream_baseline.upstream_fold([], 16)
    with pytest.raises(ValueError, match="^kv-canary: the upstream baseline folds uint8 rows"):
        upstream_baseline.upstream_fold([torch.zeros(4, 16, dtype=torch.uint8)], 16)
