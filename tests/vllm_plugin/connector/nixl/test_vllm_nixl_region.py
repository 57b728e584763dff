"""The NIXL transport's records region, without NIXL or a server: where a slot's rows lie, read back as written."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm


def test_the_records_region_holds_each_slots_rows_by_kernel_block_heads_outermost():
    """A slot's rows lie in its kernel block, each head's rows of a kernel block contiguous
    (NIXL splits a block's bytes between tensor-parallel ranks by heads), and read back as
    written: the records alike for every head, each head's digest its own."""
    from torch_kvcanary.integrations.vllm.connector.nixl import region

    records_region = region.RecordsRegion(num_blocks=3, heads=2, block_size=8, kernel_block_size=4, device=torch.device("cpu"))
    assert records_region.tensor.shape == (6, 2, 4, 5) and records_region.page_bytes == 2 * 4 * 5 * 8
    slots = torch.tensor([17, 6, 9])  # block 2 offset 1, block 0 offset 6, block 1 offset 1
    records = torch.arange(12, dtype=torch.int64).view(3, 4) + 100
    digests = torch.tensor([[1, 2], [3, 4], [5, 6]])
    records_region.write(slots, records, digests)
    rows = records_region.read(slots)
    assert rows.shape == (3, 2, 5)
    assert torch.equal(rows[:, :, : region.DIGEST], records[:, None, :].expand(3, 2, 4))
    assert torch.equal(rows[:, :, region.DIGEST], digests)
    # slot 6: kernel block 1, offset 2; head 1's rows of that kernel block follow head 0's.
    assert records_region.tensor[1, 1, 2].tolist() == [104, 105, 106, 107, 4]
    assert int(records_region.tensor.count_nonzero()) == 3 * 2 * 5
    with pytest.raises(ValueError, match=r"^kv-canary: NixlConnector moves kernel blocks of 3 slots, which do not divide"):
        region.RecordsRegion(num_blocks=3, heads=2, block_size=8, kernel_block_size=3, device=torch.device("cpu"))
