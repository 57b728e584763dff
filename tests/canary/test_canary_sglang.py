"""The canary against SGLang's own torch references of its write and verify kernels: a
scenario of prefill chunks, decode steps and bugs, the same records bit for bit after every
write, and the same violation rows (with the same reason bits) after every verify."""

import pytest
import torch
from helpers import DEVICES

import torch_kvcanary as kc

pytestmark = pytest.mark.contract  # every torch of .ci/run's TORCH_VERSIONS runs it

CAPACITY, TOKEN_BYTES = 96, 128


class Pair:
    """SGLang's canary buffer and ours over the same sources, driven with the same calls."""

    def __init__(self, sg, device, page_size):
        self.sg = sg
        gen = torch.Generator().manual_seed(7)
        # K and V pools in SGLang's row form: [pages, page_size * token bytes].
        shape = (CAPACITY // page_size, page_size * TOKEN_BYTES)
        self.k = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
        self.v = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
        pools = (self.k, self.v)
        self.ours = kc.KvCanary(
            [kc.RealKvSource(tensor=t, page_size=page_size, num_bytes_per_token=TOKEN_BYTES, read_bytes=TOKEN_BYTES) for t in pools],
            padding_slot=0, on_violation=None, ring_capacity=64,
        )  # fmt: skip
        theirs = tuple(
            sg.verify.RealKvSource(tensor=t, page_size=page_size, num_bytes_per_token=TOKEN_BYTES, read_bytes=TOKEN_BYTES) for t in pools
        )
        self.context = sg.verify.VerifyOrWriteContext(
            canary_buf=torch.zeros(CAPACITY, 32, dtype=torch.uint8, device=device),
            kernel_kind=sg.verify.CanaryLaunchTag.HEAD_K_FULL,
            violation_ring=torch.zeros(64, 8, dtype=torch.int64, device=device),
            violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
            slot_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
            kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=device),
            real_kv_sources=theirs,
            real_kv_hash_mode=sg.consts.RealKvHashMode.ALL,
            enable_chain_position_assert=torch.zeros(1, dtype=torch.int32, device=device),
        )
        self.device = device
        self.seen_rows = 0

    def write(self, requests):
        """requests: (seed slot or -1, slots, tokens, first position) per request, as one call."""
        t = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        slots, tokens, positions, prev, offsets = [], [], [], [], [0]
        for seed, req_slots, req_tokens, first in requests:
            slots += req_slots
            tokens += req_tokens
            positions += range(first, first + len(req_slots))
            prev += [seed] + req_slots[:-1]
            offsets.append(len(slots))
        plan = self.sg.write.WritePlan(
            write_offsets=t(offsets),
            write_seed_slot_indices=t([r[0] for r in requests]),
            write_num_valid_reqs=torch.tensor([len(requests)], dtype=torch.int32, device=self.device),
        )
        self.sg.write_ref.launch_canary_write_kernel_torch_reference(
            context=self.context, plan=plan, input_ids=t(tokens), positions=t(positions), out_cache_loc=t(slots),
            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
        )  # fmt: skip
        self.ours.record(t(slots), positions=t(positions), tokens=t(tokens), prev_slots=t(prev))
        assert torch.equal(self.ours.records, self.context.canary_buf.view(torch.int64))

    def verify(self, slots, positions, prev, tokens):
        t = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        n = len(slots)
        plan = self.sg.verify.VerifyPlan(
            verify_slot_indices=t(slots), verify_expected_tokens=t(tokens), verify_expected_positions=t(positions),
            verify_prev_slot_indices=t(prev), verify_num_valid=torch.tensor([n], dtype=torch.int32, device=self.device),
            enable=torch.ones(1, dtype=torch.int32, device=self.device),
        )  # fmt: skip
        self.sg.verify_ref.launch_canary_verify_kernel_torch_reference(context=self.context, plan=plan, check_verify_expected_token=True)
        flags = self.ours.verify(t(slots), positions=t(positions), prev_slots=t(prev), tokens=t(tokens))
        count = int(self.context.violation_write_index[0])
        theirs = self.context.violation_ring[self.seen_rows : count].tolist()
        self.seen_rows = count
        ours = self.ours.poll()
        # Field 0 is the launch kind: SGLang's launch tag there, ours ViolationKind.VERIFY.
        assert [[v.slot, v.position, v.stored_token, v.expected_token, v.stored_chain, v.expected_aux, int(v.reasons)] for v in ours] == [
            row[1:] for row in theirs
        ]
        assert all(v.kind == kc.ViolationKind.VERIFY for v in ours)
        assert sorted(int(s) for s in torch.tensor(slots)[flags.cpu()].tolist()) == sorted(v.slot for v in ours)
        return ours


def _context(req):
    """(slots, positions, prev slots, tokens) of a request's whole context."""
    slots, tokens = req["slots"], req["tokens"]
    return slots, list(range(len(slots))), [-1] + slots[:-1], tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_scenario_matches_sglang(sglang, device, page_size):
    pair = Pair(sglang, device, page_size)
    a = {"slots": list(range(1, 9)), "tokens": [11, 12, 13, 14, 15, 16, 17, 18]}
    b = {"slots": [40, 41, 42, 43, 60], "tokens": [21, 22, 23, 24, 25]}
    # Prefill: A's first chunk (5 tokens) and B's whole prompt (4 tokens) in one call.
    pair.write([(-1, a["slots"][:5], a["tokens"][:5], 0), (-1, b["slots"][:4], b["tokens"][:4], 0)])
    # A's second chunk chains through its first; B decodes one token into another page.
    pair.write([(5, a["slots"][5:8], a["tokens"][5:8], 5), (43, [60], [25], 4)])
    for req in (a, b):
        assert pair.verify(*_context(req)) == []

    # A flipped byte in V of A's slot 3.
    pair.v.view(-1)[3 * TOKEN_BYTES + 77] ^= 0x10
    (hit,) = pair.verify(*_context(a))
    assert hit.slot == 3 and hit.reasons == kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    pair.write([(2, [3], [13], 2)])  # a legitimate rewrite (position 2) records it again

    # A block table pointing B's position 2 at A's slot 6: every byte intact.
    slots, positions, prev, tokens = _context(b)
    slots = slots[:2] + [6] + slots[3:]
    prev = [-1] + slots[:-1]
    hits = pair.verify(slots, positions, prev, tokens)
    assert {v.slot for v in hits} == {6, 43}  # slot 6's own record, and B's slot 3 that chains through it
    six = next(v for v in hits if v.slot == 6)
    assert (
        six.reasons
        == kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH | kc.FailReason.VERIFY_POSITION_MISMATCH | kc.FailReason.VERIFY_TOKEN_MISMATCH
    )

    # B's slot 41 freed and reused by request C while B still reads it.
    pair.write([(-1, [41, 70], [91, 92], 0)])
    hits = pair.verify(*_context(b))
    assert {v.slot for v in hits} == {41, 42}

    # An off-by-one position and an unknown token (-1 skips the token check).
    slots, positions, prev, tokens = _context(a)
    hits = pair.verify(slots, [p + 1 for p in positions], prev, [-1] * len(tokens))
    assert {v.reasons for v in hits} == {kc.FailReason.VERIFY_POSITION_MISMATCH}

    # SGLang's padding slot 0: never checked, and a chain through it not checked.
    assert pair.verify([0, 5], [0, 9], [-1, 0], [1, 2])[0].slot == 5


@pytest.mark.parametrize("device", DEVICES)
def test_many_requests_chain_like_sglang(sglang, device):
    """Random prefill chunks and decode steps of many requests over a shuffled pool."""
    pair = Pair(sglang, device, page_size=2)
    gen = torch.Generator().manual_seed(3)
    free = (torch.randperm(CAPACITY - 1, generator=gen) + 1).tolist()
    requests = [{"slots": [], "tokens": []} for _ in range(6)]
    for _ in range(8):
        call = []
        for req in requests:
            count = int(torch.randint(0, 4, (), generator=gen))
            if count == 0 or len(free) < count:
                continue
            new = [free.pop() for _ in range(count)]
            tokens = torch.randint(0, 512, (count,), generator=gen).tolist()
            call.append((req["slots"][-1] if req["slots"] else -1, new, tokens, len(req["slots"])))
            req["slots"] += new
            req["tokens"] += tokens
        if call:
            pair.write(call)
    for req in requests:
        if req["slots"]:
            assert pair.verify(*_context(req)) == []
