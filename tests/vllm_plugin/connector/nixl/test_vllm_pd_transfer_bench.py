"""The P/D transfer benchmark (`benchmarks/pd_transfer.py`) on the plugin's canary, without NIXL or a server."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.vllm


def test_the_transfer_benchmark_times_a_comparison_that_finds_a_flipped_byte(capsys):
    """`benchmarks.pd_transfer`'s cell: a byte of a prompt's KV flipped after P wrote its
    rows is found by D's landing (the benchmark times a comparison that compares), and the
    benchmark prints its table."""
    from benchmarks import pd_transfer
    from torch_kvcanary.integrations.vllm.connector import nixl
    from torch_kvcanary.testing.fake_runner import BLOCK_SIZE

    cell = pd_transfer.TransferCell(layers=2, requests=2, tokens=40)
    cell.write()
    block = cell.buffers.block_of(1, 17)
    cell.buffers.caches[1].view(torch.int16)[block, 0, 17 % BLOCK_SIZE, 0] ^= 1
    cell.land()
    assert cell.canary.canary.verify(torch.from_numpy(nixl.slots_of(cell.blocks[0], 40, BLOCK_SIZE))).sum() == 0
    assert cell.canary.canary.verify(torch.from_numpy(nixl.slots_of(cell.blocks[1], 40, BLOCK_SIZE))).nonzero().flatten().tolist() == [17]
    assert pd_transfer.main(["--layers", "1", "--requests", "2", "--tokens", "16", "--calls", "1"]) == 0
