"""What the scheduler half orders the worker halves each step (`NixlOrders`): hand over a
request on P (`HandOverOrder`), verify a load on D (`LoadOrder`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class HandOverOrder:
    """P: a request whose prompt the step completes; its records of positions [0, tokens) are written for D."""

    request_id: str
    block_ids: list[int]
    tokens: int


@dataclass
class LoadOrder:
    """D: a request whose prompt positions [start, end) NIXL loads into ``block_ids``
    (all of the request's blocks) from a prefill side of ``remote_tp_size`` tensor-parallel
    ranks (`RECORDS_KEY`; None: there are no records of P's to compare with, for the reason
    ``unverified`` (`claim.Claims.judge`), or none known: then every slot is bad).
    ``identified``: D's request has an identity (a LoRA adapter, a cache salt), whose root
    its worker derives once the runner holds the request (`worker.NixlWorker`).
    ``unknown_keys``: how many ``kv_canary_*`` keys of its params D does not know (`claim.Claims.unknown_keys`).
    ``unclaimed``: its params carry no claim of P's records (`claim.Claims.unclaimed`): it is
    compared all the same, by token, position, chain and head digests."""

    request_id: str
    remote_tp_size: int | None
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    unverified: str | None = None
    identified: bool = False
    unknown_keys: int = 0
    unclaimed: bool = False


@dataclass
class NixlOrders:
    """What the scheduler side orders the workers to do this step: hand over on P, load on D."""

    handovers: list[HandOverOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)


def slots_of(block_ids: list[int], end: int, block_size: int, *, start: int = 0) -> np.ndarray:
    """The slots of a request's positions [start, end) in its blocks ``block_ids``, int64."""
    positions = np.arange(start, end, dtype=np.int64)
    return np.asarray(block_ids, dtype=np.int64)[positions // block_size] * block_size + positions % block_size
