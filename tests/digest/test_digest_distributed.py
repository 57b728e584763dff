"""Transfer digests across real processes (torch.distributed, gloo): a tensor-parallel prefill
group sends its blocks to a decode rank with another layout and paging. The decode side's
digests equal the all_reduce(SUM) of the prefill group's, which equal the spec's digest of
the logical KV (spec_oracle, ids written out here); each transfer bug changes exactly the
digests of the request and chunk it hits."""

from __future__ import annotations

import dataclasses

import pytest
import spec_oracle as oracle
import torch

from torch_kvcanary.demos import transfer as td

CONFIG = td.TransferConfig()
# TP=4 prefill ranks with blocks of 8 tokens; the decode rank as before
CONFIG_TP4 = dataclasses.replace(CONFIG, prefill_tp=4, block_size=8, prefill_blocks=8, seed=7)


@pytest.fixture(scope="module")
def results():
    return {r["fault"]: r for r in td.run_transfers(CONFIG, timeout=180)}


@pytest.fixture(scope="module")
def results_tp4():
    return {r["fault"]: r for r in td.run_transfers(CONFIG_TP4, faults=("none", "one page never sent", "scales lost"), timeout=180)}


def spec_digests(config: td.TransferConfig) -> list[int]:
    """Per-request then per-chunk digests of the requests' logical KV, by the spec: unit id =
    layer * 4 * heads + kind * heads + head, kinds K, V, K scale, V scale."""
    requests = td.make_requests(config)
    heads = config.kv_heads
    views, offsets = [], []
    # every request's tokens side by side in one logical pool, slot = running token index
    for kind, field in enumerate(("k", "v", "k_scale", "v_scale")):
        for layer in range(config.layers):
            views.append(torch.cat([getattr(r, field)[layer] for r in requests]).unsqueeze(1))
            offsets.append(layer * 4 * heads + kind * heads)
    slots, positions, request_of, chunk_of = [], [], [], []
    for r, n in enumerate(config.request_lengths):
        for i in range(n):
            slots.append(len(slots))
            positions.append(config.first_positions[r] + i)
            request_of.append(r)
            chunk_of.append(sum(-(-m // config.block_size) for m in config.request_lengths[:r]) + i // config.block_size)
    by_request = oracle.digest(views, slots, positions, offsets, request_of, len(config.request_lengths))
    by_chunk = oracle.digest(views, slots, positions, offsets, chunk_of, max(chunk_of) + 1)
    return by_request + by_chunk


def test_clean_transfer_agrees_with_the_spec(results):
    clean = results["none"]
    assert clean["received"] == clean["sent"]
    assert clean["sent"] == spec_digests(CONFIG)
    assert clean["requests"] == [] and clean["chunks"] == [] and clean["lines"] == []


@pytest.mark.parametrize("fault", [f for f in td.FAULTS if f != "none"])
def test_each_bug_changes_only_its_request_and_chunk(results, fault):
    result = results[fault]
    request, block = td.FAULT_CHUNKS[fault]
    chunk = CONFIG.chunk_of(request, block)
    assert result["sent"] == results["none"]["sent"]  # the prefill side is the same every time
    n = len(CONFIG.request_lengths)
    differs = [a != b for a, b in zip(result["sent"], result["received"])]
    assert differs[:n] == [r == request for r in range(n)]
    assert differs[n:] == [c == chunk for c in range(CONFIG.num_chunks)]
    assert result["requests"] == [request] and result["chunks"] == [chunk]
    assert result["lines"][0].startswith(f"kv-canary: transfer digest mismatch: request {request} sent=0x")


def test_tp4_prefill_with_other_pages(results_tp4):
    clean = results_tp4["none"]
    assert clean["received"] == clean["sent"] == spec_digests(CONFIG_TP4)
    for fault in ("one page never sent", "scales lost"):
        request, block = td.FAULT_CHUNKS[fault]
        assert results_tp4[fault]["requests"] == [request]
        assert results_tp4[fault]["chunks"] == [CONFIG_TP4.chunk_of(request, block)]


def test_the_demo_judges_its_results(results):
    verdicts = td.judge(CONFIG, list(results.values()))
    assert all(v.pinned for v in verdicts) and len(verdicts) == len(td.FAULTS)
    # a transfer whose bug went unseen is reported as such
    missed = dict(results["scales lost"], requests=[], chunks=[])
    assert td.judge(CONFIG, [missed])[0].caught is False
