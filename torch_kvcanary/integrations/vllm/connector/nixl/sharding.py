"""How the two sides of a P/D pair hold the model's KV heads (`Sharding`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    """How a server's ``tp_size`` tensor-parallel ranks hold the model's ``num_kv_heads``
    KV heads, as vLLM shards them: evenly where there are at least as many heads as ranks,
    else each head on ``tp_size // num_kv_heads`` consecutive ranks (MLA's latent is one
    head, on every rank)."""

    tp_size: int
    num_kv_heads: int

    def heads(self, rank: int) -> range:
        """The global heads rank ``rank`` holds."""
        if self.num_kv_heads >= self.tp_size:
            per_rank = self.num_kv_heads // self.tp_size
            return range(rank * per_rank, (rank + 1) * per_rank)
        head = rank // (self.tp_size // self.num_kv_heads)
        return range(head, head + 1)

    def holder(self, head: int) -> int:
        """The first rank holding global head ``head``."""
        if self.num_kv_heads >= self.tp_size:
            return head // (self.num_kv_heads // self.tp_size)
        return head * (self.tp_size // self.num_kv_heads)

    def sources(self, heads: range) -> list[int]:
        """The ranks whose records of ``heads`` a rank holding ``heads`` reads: for each head, its first holder."""
        return sorted({self.holder(head) for head in heads})
