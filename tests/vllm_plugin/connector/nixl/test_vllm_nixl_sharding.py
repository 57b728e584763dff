"""The NIXL transport's sharding of KV heads over tensor-parallel ranks, without NIXL or a server."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm

# vLLM's sharding of KV heads over tensor-parallel ranks, written out: with at least as many
# heads as ranks each rank holds a run of heads; with fewer, each head is replicated on
# tp // heads consecutive ranks (vLLM's QKVParallelLinear: head = rank // replicas).
SHARDINGS = {
    (1, 8): [range(0, 8)],
    (2, 8): [range(0, 4), range(4, 8)],
    (4, 2): [range(0, 1), range(0, 1), range(1, 2), range(1, 2)],
    (2, 1): [range(0, 1), range(0, 1)],  # MLA's latent: one head on every rank
}


@pytest.mark.parametrize("tp, heads", list(SHARDINGS))
def test_a_sharding_names_the_heads_of_each_rank_and_their_first_holder(tp, heads):
    from torch_kvcanary.integrations.vllm.connector import nixl

    sharding = nixl.Sharding(tp, heads)
    assert [sharding.heads(rank) for rank in range(tp)] == SHARDINGS[tp, heads]
    for head in range(heads):
        holders = [rank for rank in range(tp) if head in SHARDINGS[tp, heads][rank]]
        assert sharding.holder(head) == holders[0]


def test_a_decode_rank_asks_the_prefill_ranks_holding_its_heads():
    from torch_kvcanary.integrations.vllm.connector import nixl

    prefill = nixl.Sharding(2, 8)
    assert prefill.sources(nixl.Sharding(1, 8).heads(0)) == [0, 1]  # P_TP > D_TP: both halves
    assert [prefill.sources(nixl.Sharding(4, 8).heads(rank)) for rank in range(4)] == [[0], [0], [1], [1]]
    assert nixl.Sharding(4, 2).sources(range(0, 2)) == [0, 2]  # replicas: the first holder of each head
