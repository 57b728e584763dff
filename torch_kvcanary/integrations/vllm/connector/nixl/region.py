"""The canary's records as a region NIXL transfers with the KV (`RecordsRegion`): an int64
tensor beside each worker's KV cache, indexed by block like a KV layer,
``[num_blocks, heads, block_size, len(FIELDS)]`` (the rank's KV heads outermost in a block,
as in the KV layers NIXL splits between tensor-parallel ranks of different sizes), which the
connector registers as one more layer (`adapter.nixl.add_transfer_layer`). P writes the rows
of a prompt's slots (`write`) and marks those of KV its canary flagged (`mark`), D reads those
NIXL landed (`read`): the protocol is in
docs/vllm_internals.md ("Prefill/decode through NIXL").
"""

from __future__ import annotations

import torch

from .....records import RECORD_FIELDS

FIELDS = (*RECORD_FIELDS, "digest")
"""The row of a slot and head: the canary's record of the slot (its token, position, chain and
fold over the rank's heads) and the transfer digest of the head (`digest.kv_digest_by_head`)."""
DIGEST = FIELDS.index("digest")
MARKED = FIELDS.index("fold")
"""The fields from which on a marked row differs from the row of the same KV (`RecordsRegion.mark`)."""
LAYER_NAME = "~kv_canary.transfer_records"
"""The region's name among the layers NixlConnector registers, the same on every side. It
sorts after every model layer's name ("~" after letters and digits): NixlConnector orders its
regions by name and takes its first region for a KV layer (its block length, when it matches
the two sides' head splits)."""


class RecordsRegion:
    """The region of a rank holding ``heads`` KV heads in ``num_blocks`` blocks of
    ``block_size`` slots; NIXL moves it in kernel blocks of ``kernel_block_size`` slots
    (vLLM's kernel blocks may be smaller than its blocks), so the tensor NIXL registers is
    ``[num_blocks * block_size // kernel_block_size, heads, kernel_block_size, len(FIELDS)]``."""

    def __init__(self, num_blocks: int, heads: int, block_size: int, kernel_block_size: int, device: torch.device):
        if kernel_block_size <= 0 or block_size % kernel_block_size:
            raise ValueError(
                f"kv-canary: NixlConnector moves kernel blocks of {kernel_block_size} slots, which do not divide the "
                f"blocks of {block_size} slots: serve with a block size that is a multiple of the kernel's"
            )
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        per_block = block_size // kernel_block_size
        self.tensor = torch.zeros(num_blocks * per_block, heads, kernel_block_size, len(FIELDS), dtype=torch.int64, device=device)

    @property
    def page_bytes(self) -> int:
        """The bytes of one kernel block of the region (the page NixlConnector moves)."""
        return self.tensor[0].nbytes

    def _rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel block and the offset in it of each of ``slots``."""
        slots = slots.to(self.tensor.device, torch.int64)
        return slots // self.kernel_block_size, slots % self.kernel_block_size

    def write(self, slots: torch.Tensor, records: torch.Tensor, digests: torch.Tensor) -> None:
        """P: the rows of ``slots`` from their records (int64 ``[n, RECORD_FIELDS]``, every
        head alike) and their digests (int64 ``[n, heads]``), on the region's device."""
        blocks, offsets = self._rows(slots)
        rows = torch.cat([records[:, None, :].expand(-1, digests.shape[1], -1), digests[:, :, None]], dim=2)
        self.tensor[blocks, :, offsets] = rows

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """D: the rows of ``slots``, int64 ``[n, heads, len(FIELDS)]``."""
        blocks, offsets = self._rows(slots)
        return self.tensor[blocks, :, offsets]

    def mark(self, slots: torch.Tensor, where: torch.Tensor) -> None:
        """P: marks the rows of ``slots`` where ``where`` (a bool tensor shaped like them)
        holds, as rows of KV P does not hand over as its own (its canary flagged the step
        that computed it): their fold and every head digest changed (the lowest bit
        flipped), their token, position and chain kept. A row so marked differs from the
        fold and the digests of the KV it sits beside, so D, whichever of them it compares,
        finds each such slot bad. Nothing waits on the device."""
        blocks, offsets = self._rows(slots)
        rows = self.tensor[blocks, :, offsets]
        rows[:, :, MARKED:] ^= where.to(torch.int64)[:, None, None]
        self.tensor[blocks, :, offsets] = rows
