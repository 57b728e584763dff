"""The canary's records as a region NIXL transfers with the KV (`RecordsRegion`).

Each worker of either side holds, beside its KV cache, an int64 tensor indexed by block like
a KV layer: ``[num_blocks, heads, block_size, len(FIELDS)]``, the rank's KV heads outermost
in a block as in the KV layers NIXL splits between tensor-parallel ranks of different sizes.
The connector hands it to ``NixlConnector`` as one more layer (`adapter.nixl.with_records_region`),
so NIXL's own read of a request's blocks brings each block's rows too, each rank's heads from
the prefill ranks holding them: no port and no round trip of the canary's own.

P writes the rows of a request's prompt slots in the step that completes the prompt, after
the forward recorded them (`write`); the rows then live exactly as long as the blocks: a block
freed and reused is rewritten by its next owner or holds its former owner's rows, and either
differs from what a reader of the reused block expects. D reads the rows of the slots NIXL
landed (`read`) and compares them with its own records of what landed.
"""

from __future__ import annotations

import torch

from .....canary import RECORD_FIELDS

FIELDS = (*RECORD_FIELDS, "digest")
"""The row of a slot and head: the canary's record of the slot (its token, position, chain and
fold over the rank's heads) and the transfer digest of the head (`digest.kv_digest_by_head`)."""
DIGEST = FIELDS.index("digest")
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
