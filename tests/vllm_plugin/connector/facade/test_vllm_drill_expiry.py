"""A fault drill whose flipped slot is never flagged expires (`drill.EXPIRY_STEPS` engine
steps after its flip) and is counted as ``drills_expired``, without an engine: on a fake
port whose one drill target is a tensor of the test's."""

import random

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

from torch_kvcanary.integrations.vllm import connector  # noqa: E402
from torch_kvcanary.integrations.vllm.connector import drill, stats  # noqa: E402


class OneSlotPort:
    """A `CanaryPort` as far as drills read it: its drill target is slot ``slot``, the first element of ``cache``."""

    def __init__(self, slot: int):
        self.slot = slot
        self.cache = torch.zeros(4, dtype=torch.float16)

    def drill_target(self, rng: random.Random):
        return self.slot, self.cache[:1]


def _drilled(slot: int, step: int) -> drill.Drill:
    drills = drill.Drill(1.0, random.Random(0))
    assert drills.run(OneSlotPort(slot), step)
    return drills


def test_a_drill_never_flagged_expires_after_its_steps_and_is_counted_once():
    assert drill.EXPIRY_STEPS == 1024
    drills = _drilled(slot=7, step=10)
    assert drills.expire(10 + drill.EXPIRY_STEPS) == 0 and drills.pending == {7: 10}  # still pending at the limit
    assert drills.expire(11 + drill.EXPIRY_STEPS) == 1 and drills.pending == {}
    assert drills.expire(12 + drill.EXPIRY_STEPS) == 0  # counted once
    # A flag of the slot after the drill expired is another fault's, not the drill's.
    assert drills.caught({7}, 20 + drill.EXPIRY_STEPS) == []


def test_a_drill_caught_in_time_does_not_expire():
    drills = _drilled(slot=3, step=5)
    assert drills.caught({3}, 6) == [1]
    assert drills.expire(5 + 10 * drill.EXPIRY_STEPS) == 0


def test_the_connector_counts_expired_drills_where_it_runs_drills():
    ours = object.__new__(connector.KvCanaryConnector)
    ours.stats, ours.port, ours._steps = connector.CanaryStats(), OneSlotPort(slot=2), 1
    ours.drill = _drilled(slot=2, step=1)
    ours.drill.probability = 0.0  # no new drill: the one above stays pending, never flagged
    ours._steps = 2 + drill.EXPIRY_STEPS
    ours._run_drill()
    assert ours.stats.data["drills_expired"] == 1 and ours.drill.pending == {}


def test_drills_expired_is_a_counter_of_the_table():
    counter = stats.BY_NAME["drills_expired"]
    assert counter.label is None and counter.logs_total
