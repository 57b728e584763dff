"""`verify_transfer`: which requests and chunks differ, the policies (log, raise, callable,
None) and a group's all-reduce; and `demo --transfer`; its refused arguments."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import torch_kvcanary as kc
from torch_kvcanary.transfer import KvTransferError, TransferCheck, verify_transfer

SENT = torch.tensor([5, -1, 1 << 62], dtype=torch.int64)
SENT_CHUNKS = torch.tensor([1, 2, 3, 4], dtype=torch.int64)


def test_equal_digests_pass_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="torch_kvcanary"):
        check = verify_transfer(SENT, SENT.clone(), sent_chunks=SENT_CHUNKS, received_chunks=SENT_CHUNKS.clone(), on_mismatch="raise")
    assert check == TransferCheck((), (), ()) and check.ok and caplog.records == []


def test_mismatches_are_logged(caplog):
    received = SENT.clone()
    received[1] = 7
    chunks = SENT_CHUNKS.clone()
    chunks[2] += 1
    with caplog.at_level(logging.WARNING, logger="torch_kvcanary"):
        check = verify_transfer(SENT, received, sent_chunks=SENT_CHUNKS, received_chunks=chunks, request_ids=["a", "b", "c"], name="pd")
    assert check.requests == (1,) and check.chunks == (2,) and not check.ok
    assert [r.getMessage() for r in caplog.records] == [
        "kv-canary: pd digest mismatch: request b sent=0xffffffffffffffff received=0x0000000000000007",
        "kv-canary: pd digest mismatch in chunks [2] of 4",
    ]
    assert all(r.levelno == logging.WARNING and r.name == "torch_kvcanary" for r in caplog.records)


def test_raise_and_callable_policies():
    received = SENT + 1
    with pytest.raises(KvTransferError) as info:
        verify_transfer(SENT, received, on_mismatch="raise")
    assert isinstance(info.value, kc.KvCorruptionError) and str(info.value).startswith("kv-canary: transfer digest mismatch: request 0")
    assert info.value.check.requests == (0, 1, 2)
    seen = []
    assert verify_transfer(SENT, received, on_mismatch=seen.append).requests == (0, 1, 2)
    assert seen[0].requests == (0, 1, 2)
    assert verify_transfer(SENT, received, on_mismatch=None).requests == (0, 1, 2)


def test_group_all_reduce(tmp_path):
    """With group, received is this rank's share and is summed over the group first (here a
    group of one gloo rank; test_digest_distributed runs several)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        share = SENT.clone()
        assert verify_transfer(SENT, share, group=dist.group.WORLD, on_mismatch="raise").ok
        assert torch.equal(share, SENT)  # the caller's tensor is left alone
    finally:
        dist.destroy_process_group()


def test_demo_transfer_command():
    proc = subprocess.run(
        [sys.executable, "-m", "torch_kvcanary", "demo", "--transfer"], capture_output=True, text=True, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every transfer bug was caught at its request and chunk" in proc.stdout
    for fault in ("one flipped bit", "two positions swapped", "one page never sent", "scales lost", "two top-bit flips in one unit"):
        assert f"{fault}" in proc.stdout
    assert "NOT CAUGHT" not in proc.stdout and "FALSE ALARM" not in proc.stdout


def test_verify_transfer_refuses_bad_arguments():
    sent, sent_chunks = torch.tensor([5, -1, 1 << 62]), torch.tensor([1, 2, 3, 4])
    cases = {
        "kv-canary: sent must be a 1-D int64 tensor of digests (from kv_digest), got a torch.int32 tensor of shape (3,)": lambda: (
            verify_transfer(sent.int(), sent)
        ),
        "kv-canary: received must be a 1-D int64 tensor of digests (from kv_digest), got list": lambda: verify_transfer(sent, [1, 2, 3]),
        "kv-canary: sent has 3 digests but received has 2; pass one per request (chunk) on both sides": lambda: verify_transfer(
            sent, sent[:2]
        ),
        "kv-canary: pass both sent_chunks and received_chunks, or neither": lambda: verify_transfer(sent, sent, sent_chunks=sent_chunks),
        "kv-canary: on_mismatch must be 'log', 'raise', None or a callable, got 'warn'": lambda: verify_transfer(
            sent, sent, on_mismatch="warn"
        ),
        "kv-canary: got 1 request_ids for 3 requests": lambda: verify_transfer(sent, sent, request_ids=["x"]),
    }
    for message, call in cases.items():
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        assert str(info.value) == message
