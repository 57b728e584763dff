"""Fault drills: a bit of a live cached slot flipped, to see the canary catch it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .port import CanaryPort

_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
EXPIRY_STEPS = 1024
"""Engine steps after its flip a drill stays pending. A drill flips a slot a request of its
step reads, which the canary verifies in that step, or within ``KVCANARY_VLLM_EVERY`` steps
while a request reads it; one not flagged by then was not read again (its requests finished),
and its block may since hold another request's KV, so a later flag of the slot is another
fault's, not the drill's. 1024 is far above any ``EVERY`` worth running."""


@dataclass
class Drill:
    """Fault drills: before a step's forward, with ``probability``, one bit of a slot that
    a request of the step reads flips (in the top byte of its first element in the first
    source, which every fold covers). ``pending`` maps each flipped slot to the step it
    flipped in, until the canary flags it or it expires (`EXPIRY_STEPS`)."""

    probability: float
    rng: random.Random = field(default_factory=random.Random)
    pending: dict[int, int] = field(default_factory=dict)

    def run(self, port: CanaryPort, step: int) -> bool:
        """With ``probability``, flips one bit of a slot a request of the input batch reads
        (`CanaryPort.drill_target`), as of engine step ``step``: whether it did (not where
        no request has context)."""
        if self.rng.random() >= self.probability:
            return False
        target = port.drill_target(self.rng)
        if target is None:
            return False
        slot, first = target
        first.view(_INTEGERS[first.element_size()]).bitwise_xor_(_top_byte_bit(first.element_size(), self.rng.randrange(8)))
        self.pending[slot] = step
        return True

    def caught(self, flagged: set[int], step: int) -> list[int]:
        """The engine steps each pending drill among ``flagged`` slots took to be caught, as
        of engine step ``step``; those drills are no longer pending."""
        return [step - self.pending.pop(slot) for slot in sorted(flagged & set(self.pending))]

    def expire(self, step: int) -> int:
        """Drops the drills pending for more than `EXPIRY_STEPS` steps as of engine step
        ``step``; how many."""
        expired = [slot for slot, flipped in self.pending.items() if step - flipped > EXPIRY_STEPS]
        for slot in expired:
            del self.pending[slot]
        return len(expired)


def _top_byte_bit(size: int, bit: int) -> int:
    """Bit ``bit`` of the most significant byte of a ``size``-byte integer (for a float: its
    sign or exponent bits, so that a drill changes the value a lot), as a value of the
    signed integer type of that size (uint8 for one byte)."""
    mask = 1 << (8 * (size - 1) + bit)
    return mask - (1 << 8 * size) if size > 1 and mask >= 1 << (8 * size - 1) else mask
