"""KvCanary's records, checks, ring, policies and counters against docs/spec.md transcribed
(spec_oracle.py), on random layouts and call sequences; one launch per verify; TP agreement.
The PT2 contracts are in test_op_contracts.py."""

import hashlib
import logging
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import CUDA, DEVICES, random_case, ring_rows, torch_threads
from spec_oracle import MASK, Records

import torch_kvcanary as kc
from torch_kvcanary import layouts


def _as(values, dtype, device):
    return torch.tensor(values, dtype=dtype, device=device)


def _random_entries(rng, capacity, n, written):
    """(slots, positions, tokens, prev_slots) of one call: chains through earlier entries
    of the same call (adjacent or not), through slots of earlier calls, first positions,
    padding, and repeated slots."""
    slots, prev = [], []
    for _ in range(n):
        r = rng.random()
        slots.append(-rng.randint(1, 3) if r < 0.08 else rng.randrange(capacity))
        earlier = [s for s in slots[:-1] if s >= 0] + written
        prev.append(rng.choice(earlier) if earlier and rng.random() < 0.8 else -1)
    positions = [rng.randrange(1 << 20) for _ in range(n)]
    tokens = [rng.randrange(-1, 1 << 17) for _ in range(n)]
    return slots, positions, tokens, prev


def _folds(canary, slots, device):
    s = torch.tensor(slots, dtype=torch.int64, device=device)
    safe = torch.where(s >= 0, s, -1)
    return kc.reference_fold(list(canary.sources), safe, mode=canary.mode).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(24))
def test_random_calls_match_the_spec(seed, device):
    sources, _, mode = random_case(seed, device, max_sources=4)
    rng = random.Random(seed)
    capacity = min(s.capacity for s in sources)
    padding = rng.choice([None, 0]) if capacity > 1 else None
    canary = kc.KvCanary(sources, mode=mode, padding_slot=padding, on_violation=None, ring_capacity=4096)
    oracle = Records(capacity)
    written, expected_rows = [], []
    for _ in range(4):
        n = rng.randint(0, 40)
        slots, positions, tokens, prev = _random_entries(rng, capacity, n, written)
        dtype = rng.choice([torch.int32, torch.int64])
        given = {name: rng.random() < 0.8 for name in ("positions", "tokens", "prev_slots")}
        kwargs = {
            name: _as(values, dtype, device)
            for name, values in (("positions", positions), ("tokens", tokens), ("prev_slots", prev))
            if given[name]
        }
        # On CUDA, runs of a call are written concurrently: a run's first entry must not
        # chain through a slot another run of the same call writes (the documented rule).
        # A slot is written at most once per call there, too.
        if device == "cuda":
            slots = [s if s < 0 or s not in slots[:i] else -1 for i, s in enumerate(slots)]
            prev = [p if (i > 0 and p == slots[i - 1]) or p not in slots else -1 for i, p in enumerate(prev)]
            if "prev_slots" in kwargs:
                kwargs["prev_slots"] = _as(prev, dtype, device)
        tags = [rng.randrange(4) for _ in range(n)]
        canary.record(_as(slots, dtype, device), tag=_as(tags, torch.int64, device), **kwargs)
        oracle.record(
            slots, _folds(canary, slots, device), tags=tags,
            **{name: values for name, values in (("positions", positions), ("tokens", tokens), ("prev_slots", prev)) if given[name]},
        )  # fmt: skip
        assert canary.records.tolist() == oracle.records
        written += [s for s in slots if s >= 0]

        # Verify the same entries, some of them changed, against the oracle.
        check = [s if rng.random() < 0.9 else rng.randrange(capacity) for s in slots]
        check_tokens = [t if rng.random() < 0.9 else t + 1 for t in tokens]
        tag = rng.choice([None, 1])
        flags = canary.verify(
            _as(check, dtype, device), tag=tag, positions=kwargs.get("positions"), prev_slots=kwargs.get("prev_slots"),
            tokens=_as(check_tokens, dtype, device) if given["tokens"] else None,
        )  # fmt: skip
        want_flags, rows = oracle.verify(
            check, _folds(canary, check, device), positions=positions if given["positions"] else None,
            tokens=check_tokens if given["tokens"] else None, prev_slots=prev if given["prev_slots"] else None,
            tags=None if tag is None else [tag] * n, padding_slot=padding,
        )  # fmt: skip
        assert flags.tolist() == want_flags
        expected_rows += rows
    got = ring_rows(canary.poll())
    key = lambda row: tuple(row)  # noqa: E731  (CUDA claims ring rows in no fixed order)
    assert sorted(got, key=key) == sorted(expected_rows, key=key)
    stats = canary.stats()
    assert stats["record_calls"] == stats["verify_calls"] == 4 and stats["violations"] == len(expected_rows)


def _requests(rng, capacity, written):
    """(slots, prev_slots) of one call of many requests, each a run of entries that chain
    through the slot the entry before wrote, with padding inside runs, slots repeated across
    runs, and runs whose first entry chains through a slot of an earlier call or of an earlier
    run of this call (which then must see that run's record)."""
    slots, prev = [], []
    for _ in range(rng.randint(1, 24)):
        head = rng.choice([-1, -1] + written[-8:] + [s for s in slots if s >= 0][-8:])
        for k in range(rng.choice([1, 1, 2, 3, 9, 33, 70])):
            slots.append(-1 if rng.random() < 0.04 else rng.randrange(capacity))
            prev.append(head if k == 0 else slots[-2])
    return slots, prev


@pytest.mark.parametrize("seed", range(12))
def test_calls_of_many_requests_apply_in_entry_order(seed):
    # The spec applies the entries one after the other, each seeing what the entries before it
    # wrote: requests chaining through each other's slots within one call.
    sources, _, mode = random_case(seed, "cpu", max_sources=2)
    rng = random.Random(seed)
    capacity = min(min(s.capacity for s in sources), rng.choice([24, 4096]))
    canary = kc.KvCanary(sources, mode=mode, capacity=capacity, on_violation=None, ring_capacity=4096)
    oracle = Records(capacity)
    written, expected_rows = [], []
    for _ in range(3):
        slots, prev = _requests(rng, capacity, written)
        n = len(slots)
        positions = [rng.randrange(1 << 20) for _ in range(n)]
        tokens = [rng.randrange(-1, 1 << 17) for _ in range(n)]
        dtype = rng.choice([torch.int32, torch.int64])
        given = {"positions": positions, "tokens": tokens, "prev_slots": prev}
        given = {name: values for name, values in given.items() if name == "prev_slots" or rng.random() < 0.8}
        tensors = {name: _as(values, dtype, "cpu") for name, values in given.items()}
        canary.record(_as(slots, dtype, "cpu"), **tensors)
        oracle.record(slots, _folds(canary, slots, "cpu"), **given)
        assert canary.records.tolist() == oracle.records
        written += [s for s in slots if s >= 0]
        assert canary.stats()["slots_recorded"] == len(written)
        flags = canary.verify(_as(slots, dtype, "cpu"), **tensors)
        want_flags, rows = oracle.verify(slots, _folds(canary, slots, "cpu"), **given)
        assert flags.tolist() == want_flags
        expected_rows += rows
    got = ring_rows(canary.poll())
    assert got == expected_rows


def _random_pool(seed: int, token_bytes: int, **canary_args) -> tuple[torch.Tensor, kc.KvCanary, Records]:
    """4096 slots of `token_bytes` random bytes (one token a page, all of it read), the CPU
    canary over them and the spec's records of as many slots."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (4096, token_bytes), dtype=torch.uint8, generator=gen)
    source = kc.view_source(pool.unsqueeze(1), read_bytes=token_bytes)
    return pool, kc.KvCanary(source, on_violation=None, **canary_args), Records(4096)


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_steps_match_the_spec(threads):
    # Calls whose entries each chain through a slot of an earlier call (folded in tasks of 64
    # entries of 4 KiB, on one thread or two), and the same with one entry chaining through a
    # slot an earlier or a later entry of the call writes, a slot written twice, or padding:
    # every record as the spec's entry-order application leaves it.
    _, canary, oracle = _random_pool(5, 4096)
    rng = random.Random(threads)
    written = rng.sample(range(4096), 300)
    canary.record(torch.tensor(written))
    oracle.record(written, _folds(canary, written, "cpu"))
    changes = ["none", "chain through an earlier entry", "chain through a later entry", "slot twice", "padding"]
    with torch_threads(threads):
        for change in changes * 4:
            slots = rng.sample(range(4096), 200)
            prev = [rng.choice(written + [-1]) for _ in slots]
            prev = [p if p not in slots else -1 for p in prev]
            i, j = rng.randrange(64), rng.randrange(64, 128)
            if change == "chain through an earlier entry":
                prev[j] = slots[i]
            elif change == "chain through a later entry":
                prev[i] = slots[j]
            elif change == "slot twice":
                slots[j] = slots[i]
            elif change == "padding":
                slots[i] = -1
            positions = [rng.randrange(1 << 20) for _ in slots]
            tokens = [rng.randrange(1 << 17) for _ in slots]
            inputs = {"positions": positions, "tokens": tokens, "prev_slots": prev}
            canary.record(torch.tensor(slots), **{name: torch.tensor(values) for name, values in inputs.items()})
            oracle.record(slots, _folds(canary, slots, "cpu"), **inputs)
            assert canary.records.tolist() == oracle.records, change
            written += [s for s in slots if s >= 0]
    assert canary.stats()["slots_recorded"] == len(written)


@pytest.mark.parametrize("threads", [1, 2])
def test_calls_of_many_tasks_and_threads_match_the_spec(threads):
    # Enough entries of 1 KiB for several of the fold's tasks, whose lane groups the CPU kernel
    # checks as they are folded, on one thread or two; some slots changed after record. On this
    # process's CPU path; test_cpu_paths.py reruns it on every other path.
    pool, canary, oracle = _random_pool(3, 1024, ring_capacity=4096)
    rng = random.Random(threads)
    slots, prev = [], []
    while len(slots) < 1500:
        new, new_prev = _requests(rng, 4096, [s for s in slots if s >= 0])
        slots += new
        prev += new_prev
    positions = [rng.randrange(1 << 20) for _ in slots]
    tokens = [rng.randrange(1 << 17) for _ in slots]
    tags = [rng.randrange(3) for _ in slots]
    inputs = {name: torch.tensor(values) for name, values in (("positions", positions), ("tokens", tokens), ("prev_slots", prev))}
    with torch_threads(threads):
        canary.record(torch.tensor(slots), tag=torch.tensor(tags), **inputs)
        oracle.record(slots, _folds(canary, slots, "cpu"), positions=positions, tokens=tokens, prev_slots=prev, tags=tags)
        assert canary.records.tolist() == oracle.records
        changed = rng.sample([s for s in slots if s >= 0], 40)
        pool[changed] += 1
        flags = canary.verify(torch.tensor(slots), **inputs)
        want_flags, rows = oracle.verify(slots, _folds(canary, slots, "cpu"), positions=positions, tokens=tokens, prev_slots=prev)
    assert flags.tolist() == want_flags
    got = ring_rows(canary.poll())
    assert got == rows and len(rows) > 40


def _pool(device, blocks=8, block_size=16):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, blocks, block_size, 2, 32, generator=gen).to(torch.bfloat16).to(device)


def _request(canary, slots, device, first_token=100):
    """Record ``slots`` as one request's positions 0.., chained; returns its verify inputs."""
    s = torch.tensor(slots, device=device)
    inputs = {
        "positions": torch.arange(len(slots), device=device),
        "tokens": torch.arange(first_token, first_token + len(slots), device=device),
        "prev_slots": torch.tensor([-1] + slots[:-1], device=device),
    }
    canary.record(s, **inputs)
    return s, inputs


@pytest.mark.parametrize("device", DEVICES)
def test_each_mapping_bug_sets_its_bit(device):
    kv = _pool(device)
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None)
    a, a_in = _request(canary, list(range(16, 24)), device)
    b, b_in = _request(canary, list(range(40, 44)), device, first_token=200)
    assert not canary.verify(a, **a_in).any() and canary.poll() == []
    R = kc.FailReason
    # B's block table points its position 2 at A's slot 19 (A's position 3): every byte intact.
    wrong = b.clone()
    wrong[2] = 19
    hits = {v.slot: v.reasons for v in (canary.verify(wrong, **b_in), canary.poll())[1]}
    assert hits[19] == R.VERIFY_CHAIN_HASH_MISMATCH | R.VERIFY_POSITION_MISMATCH | R.VERIFY_TOKEN_MISMATCH
    # Pointed at A's slot 18, A's position 2 too: the chain and the token still tell.
    wrong[2] = 18
    hits = {v.slot: v.reasons for v in (canary.verify(wrong, **b_in), canary.poll())[1]}
    assert hits[18] == R.VERIFY_CHAIN_HASH_MISMATCH | R.VERIFY_TOKEN_MISMATCH
    # An off-by-one position: each slot's position, and nothing else.
    shifted = dict(a_in, positions=a_in["positions"] + 1)
    canary.verify(a, **shifted)
    assert {v.reasons for v in canary.poll()} == {R.VERIFY_POSITION_MISMATCH}
    # A chain through the wrong previous slot.
    canary.verify(a[3:4], prev_slots=torch.tensor([16], device=device))
    (v,) = canary.poll()
    assert v.reasons == R.VERIFY_CHAIN_HASH_MISMATCH and v.expected_aux != v.stored_chain
    # Changed bytes.
    kv[1, 1, 5, 0, 0] += 1  # slot 21
    canary.verify(a, **a_in)
    (v,) = canary.poll()
    assert (v.slot, v.reasons) == (21, R.VERIFY_REAL_KV_HASH_MISMATCH)
    # Another owner.
    canary.record(a[:2], tag=5)
    canary.verify(a[:2], tag=6)
    assert {v.reasons for v in canary.poll()} == {R.VERIFY_OWNER_MISMATCH}


def test_log_line_is_sglangs_format(caplog):
    kv = _pool("cpu")
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), name="HEAD_K_FULL")
    slots, inputs = _request(canary, [3, 4], "cpu")
    kv[0, 0, 4, 0, 0] += 1
    canary.verify(slots, **dict(inputs, tokens=torch.tensor([100, 7])))
    with caplog.at_level(logging.WARNING, logger="torch_kvcanary"):
        (v,) = canary.poll()
    chain = v.stored_chain & MASK
    # Each chain as its fingerprint: BLAKE2b-32 of its 8 bytes, keyed with the process's key.
    fingerprint = hashlib.blake2b(chain.to_bytes(8, "little"), digest_size=4, key=kc.violations._FINGERPRINT_KEY).hexdigest()
    assert caplog.messages == [
        f"kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_real_kv_hash+verify_token slot_idx=4 position=1 "
        f"stored_token=101 expected_token=7 stored_chain_hash=fp:{fingerprint} expected_aux=fp:{fingerprint}"
    ]
    assert caplog.records[0].levelno == logging.WARNING and len(fingerprint) == 8
    assert f"{chain:016x}" not in caplog.messages[0]


def test_a_log_line_shows_which_chains_are_equal_but_not_the_chains():
    # A request's two slots read as chained through two slots never recorded: their stored
    # chains differ, their expected ones (the link of an empty record) are one value. The
    # lines' fingerprints are equal and differ as the chains do; no chain is in the line.
    kv = _pool("cpu")
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None)
    slots, inputs = _request(canary, [3, 4], "cpu")
    canary.verify(slots, **dict(inputs, prev_slots=torch.tensor([5, 6])))
    first, second = canary.poll()
    assert first.expected_aux == second.expected_aux and len({first.stored_chain, second.stored_chain, first.expected_aux}) == 3
    lines = [v.line("KV") for v in (first, second)]
    (stored_1, expected_1), (stored_2, expected_2) = [
        re.search(r"stored_chain_hash=fp:([0-9a-f]{8}) expected_aux=fp:([0-9a-f]{8})$", line).groups() for line in lines
    ]
    assert expected_1 == expected_2 and len({stored_1, stored_2, expected_1}) == 3
    assert first.line("KV") == lines[0]  # one process, one key: the same line again
    for v, line in zip((first, second), lines):
        assert f"{v.stored_chain & MASK:016x}" not in line and f"{v.expected_aux & MASK:016x}" not in line


def test_an_out_of_range_line_gives_its_previous_slot():
    # A row of bit 7 alone holds no chain: its previous slot is written out (SGLang's form).
    kv = _pool("cpu")
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None, capacity=8)
    canary.record(torch.tensor([2]), prev_slots=torch.tensor([9]), check_bounds=False)
    (v,) = canary.poll()
    assert v.reasons == kc.FailReason.SLOT_OUT_OF_RANGE
    assert v.line("KV").endswith(" stored_chain_hash=0x0000000000000000 expected_aux=0x0000000000000009")


def test_policies():
    kv = _pool("cpu")
    seen = []
    for policy in ("raise", seen.append, None):
        canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=policy)
        slots = torch.arange(4)
        canary.record(slots)
        assert canary.poll() == []  # nothing flagged: the policy is not applied
        canary.verify(slots, tag=3)
        if policy == "raise":
            with pytest.raises(kc.KvCorruptionError) as info:
                canary.poll()
            assert isinstance(info.value, RuntimeError) and len(info.value.lines) == 4
            assert str(info.value).startswith("kv_canary violation: launch_tag=KV fail_reason=verify_owner slot_idx=0 ")
            assert canary.poll() == []  # the ring was drained before raising
        else:
            assert len(canary.poll()) == 4
    assert [v.slot for v in seen[0]] == [0, 1, 2, 3]


def test_ring_overflow_is_counted(caplog):
    kv = _pool("cpu")
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), ring_capacity=3)
    slots = torch.arange(10)
    canary.record(slots)
    canary.verify(slots, tag=1)  # 10 violations, 3 rows
    assert canary.stats()["ring_write"] == 10
    with caplog.at_level(logging.WARNING, logger="torch_kvcanary"):
        assert [v.slot for v in canary.poll()] == [0, 1, 2]
    assert caplog.messages[-1].startswith("kv_canary: launch_tag=KV 7 more violations dropped (ring of 3 rows full)")
    canary.verify(slots[:2], tag=1)
    assert [v.slot for v in canary.poll()] == [0, 1]  # the ring is reused after a poll
    stats = canary.stats()
    assert stats == {
        "record_calls": 1, "verify_calls": 2, "slots_recorded": 10, "slots_verified": 12,
        "violations": 12, "ring_write": 0, "ring_overflow": 7,
    }  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_stats_without_waiting_never_run_ahead_of_the_device_and_catch_up(device):
    # Read each step by vLLM's connector, which must not wait for the device: each counter
    # read without waiting is one the eager read gave at or before that call, and once the
    # device is idle, two calls later (one copy queued, one read), the eager values.
    kv = _pool(device)
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"))
    slots = torch.arange(6, device=device)
    eager = []
    for calls in range(1, 5):
        canary.record(slots)
        canary.verify(slots)
        lagging = canary.stats(wait=False)
        eager.append(canary.stats())
        assert eager[-1]["record_calls"] == calls and eager[-1]["slots_verified"] == 6 * calls
        assert lagging in [{name: 0 for name in lagging}, *eager], (lagging, eager)
    if device == "cuda":
        torch.cuda.synchronize()
    canary.stats(wait=False)
    assert canary.stats(wait=False) == canary.stats()


@pytest.mark.parametrize("device", DEVICES)
def test_padding_slot_is_sglangs(device):
    kv = _pool(device)
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), padding_slot=0, on_violation=None)
    canary.record(torch.tensor([0, 5, 6], device=device), prev_slots=torch.tensor([-1, 0, 5], device=device))
    assert canary.records[0, 3] != 0  # recorded like any slot, as SGLang's write does
    kv[:, 0, 0] += 1  # slot 0's bytes change: never checked
    flags = canary.verify(torch.tensor([0, 5, -1], device=device), prev_slots=torch.tensor([-1, 0, -1], device=device))
    assert flags.tolist() == [False, False, False] and canary.stats()["slots_verified"] == 1


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_one_launch_per_verify():
    kv = _pool("cuda")
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None)
    slots, positions = torch.arange(32, device="cuda"), torch.arange(32, device="cuda")
    tokens, prev = torch.arange(32, device="cuda") + 7, torch.arange(-1, 31, device="cuda")
    canary.record(slots, positions=positions, tokens=tokens, prev_slots=prev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        canary.verify(slots, positions=positions, tokens=tokens, prev_slots=prev, tag=None)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "kernel" in e.name]
    assert len(kernels) == 1 and "verify_kernel" in kernels[0], kernels


def test_prometheus_export():
    prometheus_client = pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    kv = _pool("cpu")
    canary = kc.KvCanary(layouts.vllm(kv, layout="NHD"), name="layer0", on_violation=None)
    registry = prometheus_client.CollectorRegistry()
    registry.register(canary.prometheus_collector())
    canary.record(torch.arange(6))
    canary.verify(torch.arange(6), tag=9)
    value = lambda name: registry.get_sample_value(name, {"canary": "layer0"})  # noqa: E731
    assert value("kvcanary_record_calls_total") == 1 and value("kvcanary_slots_recorded_total") == 6
    assert value("kvcanary_violations_total") == 6 and value("kvcanary_ring_pending") == 6
    canary.poll()
    assert value("kvcanary_ring_pending") == 0 and value("kvcanary_ring_overflow_total") == 0


_TP_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import torch_kvcanary as kc
    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    pool = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16)  # this rank's heads of one layer
    canary = kc.KvCanary((kc.view_source(pool, read_bytes=128),), on_violation="raise")
    canary.record(torch.arange(64))
    assert canary.poll(group=dist.group.WORLD) == []
    if rank == 1:
        pool[2, 3, 1, 0] = 1.0  # only rank 1's bytes go bad
    canary.verify(torch.arange(64))
    try:
        canary.poll(group=dist.group.WORLD)
    except kc.KvCorruptionError as error:
        print(f"rank {rank} raised: {error.lines[-1] if rank == 0 else error.lines[0]}", flush=True)
    dist.destroy_process_group()
    """
)


def test_tensor_parallel_ranks_raise_together(tmp_path: Path):
    script = tmp_path / "worker.py"
    script.write_text(_TP_WORKER)
    store = tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(kc.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for rank in range(2)
    ]
    outputs = [w.communicate(timeout=120) for w in workers]
    for w, (_out, err) in zip(workers, outputs):
        assert w.returncode == 0, err
    # The workers' own lines: some torch versions' gloo logs its connections to stdout too.
    printed = [[line for line in out.splitlines() if not line.startswith("[Gloo]")] for out, _err in outputs]
    assert printed[0] == ["rank 0 raised: kv_canary: launch_tag=KV 1 violations on other ranks of the process group"]
    assert len(printed[1]) == 1
    assert printed[1][0].startswith("rank 1 raised: kv_canary violation: launch_tag=KV fail_reason=verify_real_kv_hash slot_idx=35 ")
