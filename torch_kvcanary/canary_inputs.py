"""What the canary's ops (``kvcanary::record``, ``refold``, ``verify``) take: the checks
`KvCanary` makes of its arguments in Python before a call, and the ops' fake kernels (those
of their ``.bound`` overloads too): the kernels' cheap checks (csrc/plan/canary_plan.cpp),
with their messages, and the outputs' shapes, for `torch.compile`, FakeTensorMode and
`opcheck`. Importing it (as `canary` does) registers the fakes."""

from __future__ import annotations

import torch

from .binding import check_table_fake
from .ops import check_index_dtype, check_sources_fake


def check_entry_input(value, name: str) -> None:
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"kv-canary: {name} must be an int32 or int64 tensor shaped like slots, got {type(value).__name__}")


def check_roots(roots) -> None:
    # Their dtype, which the kernels' refusal would report as a ValueError; the rest is checked
    # with the other inputs (csrc/plan/canary_plan.cpp).
    if roots is not None and (not isinstance(roots, torch.Tensor) or roots.dtype != torch.int64):
        got = roots.dtype if isinstance(roots, torch.Tensor) else type(roots).__name__
        raise TypeError(f"kv-canary: roots must be an int64 tensor shaped like slots, got {got}; pass roots as int64")


def given_roots(roots) -> tuple:
    """The trailing ``roots`` argument of an op call: none when not given, so that a call
    without roots passes the arguments it passed before the op took them."""
    return () if roots is None else (roots,)


def _check_canary_fake_inputs(sources, slots, entries, tables) -> None:
    # The canary kernels' cheap checks (csrc/plan/canary_plan.cpp): one value per slot, one
    # device. Mixed devices dispatch here when one of them is meta.
    for name, value in entries.items():
        if value is not None and value.numel() != slots.numel():
            raise ValueError(f"kv-canary: {name} has {value.numel()} entries but slots has {slots.numel()}; pass one value per slot")
    check_sources_fake(sources, slots, views=False)
    for table in tables:
        if table.device != slots.device:
            raise ValueError(
                f"kv-canary: the canary's tables are on {table.device} but slots are on {slots.device}; put slots on the canary's device"
            )


def _check_record_verify_fake(sources, slots, positions, tokens, prev_slots, roots, tables) -> None:
    # record's and verify's checks: roots' dtype and device first, then those of every call.
    if roots is not None and roots.dtype != torch.int64:
        raise ValueError(f"kv-canary: roots must be an int64 tensor (64-bit hashes), got {roots.dtype}; pass roots as int64")
    if roots is not None and roots.device != slots.device:
        raise ValueError(f"kv-canary: roots is on {roots.device} but slots are on {slots.device}; put them on one device")
    entries = {"positions": positions, "tokens": tokens, "prev_slots": prev_slots, "roots": roots}
    _check_canary_fake_inputs(sources, slots, entries, tables)


@torch.library.register_fake("kvcanary::record")
def _record_fake(
    sources, read_bytes, slots, positions, tokens, prev_slots, tags, records, owner_tags, counters, ring, check_bounds=True, roots=None
):
    _check_record_verify_fake(sources, slots, positions, tokens, prev_slots, roots, (records, owner_tags, counters, ring))


@torch.library.register_fake("kvcanary::refold")
def _refold_fake(sources, read_bytes, slots, records, check_bounds=True):
    check_index_dtype(slots, "slots")
    _check_canary_fake_inputs(sources, slots, {}, (records,))


@torch.library.register_fake("kvcanary::verify")
def _verify_fake(
    sources, read_bytes, slots, positions, tokens, prev_slots, tags, records, owner_tags, counters, ring,
    padding_slot=-1, check_bounds=True, roots=None,
):  # fmt: skip
    _check_record_verify_fake(sources, slots, positions, tokens, prev_slots, roots, (records, owner_tags, counters, ring))
    return slots.new_empty(slots.shape, dtype=torch.bool)


def _bound_fake(fake):
    """The fake of a bound overload: the table's check, then those of the Tensor[] form's
    `fake` over no sources."""

    def bound_fake(sources_table, slots, *args, **kwargs):
        check_table_fake(sources_table)
        return fake([], [], slots, *args, **kwargs)

    return bound_fake


for _op, _fake in (("record", _record_fake), ("refold", _refold_fake), ("verify", _verify_fake)):
    torch.library.register_fake(f"kvcanary::{_op}.bound")(_bound_fake(_fake))
