"""`verify_transfer`: compare the digests of KV sent and KV received, per request and per
chunk, and apply the package's policy to the ones that differ.

The sender computes ``kv_digest`` of what it sends (a tensor-parallel group: the
``all_reduce(SUM)`` of its ranks' digests), the receiver the same over what landed in its
own pool, however it is sharded and paged, and a connector calls `verify_transfer` with
both. Both values are the same on every rank of a group after its all-reduce, so every rank
decides the same: one rank never waits in a collective for another that raised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .policy import apply_policy, check_policy
from .violations import KvCorruptionError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TransferCheck:
    """The outcome of `verify_transfer`: the indices of the requests and chunks whose digests
    differ (chunks: empty when no chunk digests were given), and one log line per mismatch."""

    requests: tuple[int, ...]
    chunks: tuple[int, ...]
    lines: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.requests and not self.chunks


class KvTransferError(KvCorruptionError):
    """Raised by `verify_transfer` under ``on_mismatch="raise"``; ``check`` is the
    `TransferCheck`, and the message holds its lines."""

    def __init__(self, check: TransferCheck):
        super().__init__(list(check.lines), [])
        self.check = check


def _digests(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
        raise TypeError(f"kv-canary: {name} must be a 1-D int64 tensor of digests (from kv_digest), got {_describe(value)}")
    return value


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _pair(sent, received, what: str, group) -> tuple[list[int], list[int]]:
    sent = _digests(sent, f"sent{what}")
    received = _digests(received, f"received{what}")
    if sent.shape != received.shape:
        raise ValueError(
            f"kv-canary: sent{what} has {sent.shape[0]} digests but received{what} has {received.shape[0]}; pass one per request (chunk) on both sides"
        )
    if group is not None:
        import torch.distributed as dist

        received = received.clone()
        dist.all_reduce(received, op=dist.ReduceOp.SUM, group=group)  # int64 sums wrap, as digests do
    return sent.tolist(), received.tolist()


def verify_transfer(
    sent: torch.Tensor,
    received: torch.Tensor,
    *,
    sent_chunks: torch.Tensor | None = None,
    received_chunks: torch.Tensor | None = None,
    request_ids: Sequence | None = None,
    group=None,
    on_mismatch: str | Callable[[TransferCheck], None] | None = "log",
    name: str = "transfer",
) -> TransferCheck:
    """Compare per-request (and, when given, per-chunk) digests of a transfer.

    Args:
        sent, received: int64 ``[num_requests]`` digests of the sender's KV and of the
            receiver's, from `kv_digest` with one group per request.
        sent_chunks, received_chunks: optional int64 ``[num_chunks]`` digests with one
            group per chunk (a page run, a layer range: whatever the connector moves at once),
            to say which chunks differ.
        request_ids: names of the requests for the log lines (default: their indices).
        group: a ``torch.distributed`` process group over which ``received`` and
            ``received_chunks`` are this rank's share: they are summed (``all_reduce``) first.
        on_mismatch: ``"log"`` (a WARNING on the ``torch_kvcanary`` logger per mismatch),
            ``"raise"`` (`KvTransferError`, a `KvCorruptionError`), a callable given the
            `TransferCheck`, or None (only return it).
        name: names the transfer in the log lines.

    Returns:
        the `TransferCheck` (syncs with the host: call it once per transfer, not per layer).
    """
    check_policy(on_mismatch, name="on_mismatch", choices="'log', 'raise', None or a callable")
    if (sent_chunks is None) != (received_chunks is None):
        raise ValueError("kv-canary: pass both sent_chunks and received_chunks, or neither")
    sent_list, received_list = _pair(sent, received, "", group)
    if request_ids is not None and len(request_ids) != len(sent_list):
        raise ValueError(f"kv-canary: got {len(request_ids)} request_ids for {len(sent_list)} requests")
    ids = list(range(len(sent_list))) if request_ids is None else list(request_ids)
    requests = [i for i, (a, b) in enumerate(zip(sent_list, received_list)) if a != b]
    lines = [
        f"kv-canary: {name} digest mismatch: request {ids[i]} sent={sent_list[i] & _MASK64:#018x} received={received_list[i] & _MASK64:#018x}"
        for i in requests
    ]
    chunks: list[int] = []
    if sent_chunks is not None:
        sent_c, received_c = _pair(sent_chunks, received_chunks, "_chunks", group)
        chunks = [c for c, (a, b) in enumerate(zip(sent_c, received_c)) if a != b]
        if chunks:
            lines.append(f"kv-canary: {name} digest mismatch in chunks {chunks} of {len(sent_c)}")
    check = TransferCheck(tuple(requests), tuple(chunks), tuple(lines))
    if not check.ok:
        apply_policy(on_mismatch, check, lines=lambda: lines, error=lambda _: KvTransferError(check))
    return check
