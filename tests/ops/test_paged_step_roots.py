"""PagedStep with ``roots``: request r's root is the chain of its position 0 where the step
records it and what the step's context check expects there, a mismatch being
VERIFY_IDENTITY_MISMATCH with the root as expected_aux; without roots, the anchor as before.
Expected values written out by hand from the rule with spec_oracle's mix3 (the whole-spec
comparison on simulated engines is test_paged_step.py's), on the CPU and on CUDA (whole steps:
the block-packed phases are the CPU's)."""

import pytest
import torch
from helpers import DEVICES, RAW_OP_REFUSAL
from spec_oracle import ANCHOR, mix3, signed
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

import torch_kvcanary as kc
from torch_kvcanary import layouts
from torch_kvcanary.paged_step import PagedStep, StepPhase

BLOCK = 4
ROOTS = [signed(0xA5A5A5A5A5A5A5A5), 12345]
IDENTITY = kc.FailReason.VERIFY_IDENTITY_MISMATCH


class Step:
    """Two requests over one full-attention group, blocks [1, 2] and [3, 4], padding slot 0
    (the null block), with the engine's padded step buffers."""

    def __init__(self, device: str = "cpu", *, packed: bool = False):
        gen = torch.Generator().manual_seed(1)
        kv = torch.randint(0, 256, (2, 8, BLOCK, 1, 16), dtype=torch.uint8, generator=gen).view(torch.bfloat16)
        self.device, self.kv = device, kv.to(device)
        self.canary = kc.KvCanary(layouts.vllm(self.kv, layout="NHD"), on_violation=None, padding_slot=0)
        self.table = torch.tensor([[1, 2], [3, 4], [0, 0]], dtype=torch.int32, device=device)
        self.mapping = torch.full((16,), -1, dtype=torch.int64, device=device)
        self.op = PagedStep(self.canary, [self.table], [self.mapping], block_size=BLOCK)
        self.phases = [StepPhase.BEFORE_FORWARD, StepPhase.AFTER_FORWARD] if packed else [StepPhase.WHOLE_STEP]
        self.computed = [0, 0]
        self.steps = 0

    def slot(self, r: int, p: int) -> int:
        return int(self.table[r, p // BLOCK]) * BLOCK + p % BLOCK

    def token(self, r: int, p: int) -> int:
        return 100 * (r + 1) + p

    def run(self, runs: list[int], roots: list[int] | None) -> list[kc.Violation]:
        """One step, request r running runs[r] tokens; the ring rows it wrote."""
        qsl, seq_lens, positions, input_ids, slots = [0], [], [], [], []
        for r, n in enumerate(runs):
            c = self.computed[r]
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            positions += range(c, c + n)
            input_ids += [self.token(r, p) for p in range(c, c + n)]
            slots += [self.slot(r, p) for p in range(c, c + n)]
        self.mapping.fill_(-1)[: len(slots)] = torch.tensor(slots, device=self.device)
        padded = [torch.tensor(v + [0] * 4, dtype=torch.int64, device=self.device) for v in (qsl, seq_lens, positions, input_ids)]
        root_tensor = None if roots is None else torch.tensor(roots + [0], dtype=torch.int64, device=self.device)  # padded too
        for phase in self.phases:
            self.op(*padded, num_reqs=len(runs), num_tokens=len(slots), step=self.steps, phase=phase, roots=root_tensor)
        self.computed = [c + n for c, n in zip(self.computed, runs)]
        self.steps += 1
        return self.canary.poll()


@pytest.mark.parametrize("device, packed", [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=DEVICES[1].marks)])
def test_a_step_records_each_requests_position_zero_at_its_root(device, packed):
    step = Step(device, packed=packed)
    assert step.run([5, 3], ROOTS) == []
    for r, root in enumerate(ROOTS):
        chains = [step.canary.records[step.slot(r, p), 2].item() for p in range(3)]
        second = mix3(root, step.token(r, 0), 0)
        assert chains == [root, signed(second), signed(mix3(second, step.token(r, 1), 1))]
    assert step.run([1, 1], ROOTS) == []  # position 0 checked as context against the same roots


@pytest.mark.parametrize("device", DEVICES)
def test_position_zero_read_under_another_root_names_its_request(device):
    step = Step(device)
    step.run([5, 3], ROOTS)
    other = [ROOTS[0], 777]
    (row,) = step.run([1, 1], other)
    assert (row.slot, row.position, row.reasons) == (step.slot(1, 0), 0, IDENTITY)
    assert (row.stored_chain, row.expected_aux) == (ROOTS[1], 777)
    assert (row.step, row.group, row.row) == (1, 0, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_without_roots_position_zero_is_the_anchors(device):
    step = Step(device)
    assert step.run([5, 3], None) == []
    assert [step.canary.records[step.slot(r, 0), 2].item() for r in range(2)] == [signed(ANCHOR)] * 2
    assert step.run([1, 1], None) == []
    # Rooted records read without roots: the anchor's chain check, as before roots existed.
    rooted = Step(device)
    rooted.run([5, 3], ROOTS)
    rows = rooted.run([1, 1], None)
    assert sorted((row.row, row.reasons, row.expected_aux) for row in rows) == [
        (0, kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH, signed(ANCHOR)),
        (1, kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH, signed(ANCHOR)),
    ]


@pytest.mark.parametrize(
    "roots",
    [torch.zeros(1, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)[::2]],
    ids=["one for two requests", "2-D", "strided"],
)
def test_the_fake_refuses_the_roots_the_kernel_refuses(roots):
    # A step of two requests and no tokens: roots must be 1-D, contiguous, >= 2 entries. The fake
    # (FakeTensor, torch.compile) refuses them with the kernel's message, as a ValueError.
    step = Step()
    zeros = torch.zeros(4, dtype=torch.int64)
    buffers = (zeros, zeros[:2], zeros, zeros, None, None, None)
    args = (*step.op._groups, *buffers, *step.op._tables, 2, 0, BLOCK, StepPhase.WHOLE_STEP, 0, 1, 0, roots)
    op = torch.ops.kvcanary.paged_step.default
    with pytest.raises(RAW_OP_REFUSAL, match="^kv-canary: roots ") as real:
        op(*args)
    with FakeTensorMode() as mode, pytest.raises(ValueError) as fake:
        op(*tree_map_only(torch.Tensor, mode.from_tensor, args))
    assert str(fake.value) == str(real.value)
