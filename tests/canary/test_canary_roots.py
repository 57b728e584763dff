"""KvCanary.record and verify with ``roots``: a request's identity as the chain of its first
position (docs/spec.md, "The canary records"). Expected chains are written out by hand from
the rule with spec_oracle's mix3: link(p) is roots[i] where prev_slots[i] < 0 and roots are
given, the anchor where they are not, mix3(chain, token, position) of p's record otherwise;
verify flags a first position read under another root with VERIFY_IDENTITY_MISMATCH alone.
Without roots every call is as before."""

import pytest
import torch
from helpers import DEVICES
from spec_oracle import ANCHOR, mix3, signed

import torch_kvcanary as kc
from torch_kvcanary import layouts

ROOT = signed(0x9E3779B97F4A7C15)  # a root with its top bit set: negative as an int64
OTHER = 0x0123456789ABCDEF
IDENTITY = kc.FailReason.VERIFY_IDENTITY_MISMATCH


def _canary(device: str, **kwargs) -> kc.KvCanary:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 8, 16, 2, 32, generator=gen).to(torch.bfloat16).to(device)  # capacity 128
    return kc.KvCanary(layouts.vllm(kv, layout="NHD"), on_violation=None, **kwargs)


def _longs(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def _request(device, first: int = 5):
    """A 3-position request at slots first..first+2: (slots, positions, tokens, prev_slots)."""
    slots = _longs([first, first + 1, first + 2], device)
    return {"slots": slots, "positions": _longs([0, 1, 2], device), "tokens": _longs([11, 12, 13], device), "prev_slots": slots - 1}


def _first(entries):
    return {**entries, "prev_slots": torch.cat([entries["prev_slots"][:1].fill_(-1), entries["prev_slots"][1:]])}


def _rooted(device, root: int, first: int = 5):
    entries = _first(_request(device, first))
    return entries, _longs([root, 99, -99], device)  # only entry 0 is a first position: the rest are not read


def _recorded_rooted(device):
    """A canary that has recorded a request rooted at ROOT, the request's entries and roots."""
    canary = _canary(device)
    entries, roots = _rooted(device, ROOT)
    canary.record(**entries, roots=roots)
    return canary, entries, roots


@pytest.mark.parametrize("device", DEVICES)
def test_a_rooted_request_chains_from_its_root(device):
    canary, entries, roots = _recorded_rooted(device)
    second = mix3(ROOT, 11, 0)
    assert canary.records[5:8, 2].tolist() == [ROOT, signed(second), signed(mix3(second, 12, 1))]
    assert canary.records[5:8, :2].tolist() == [[11, 0], [12, 1], [13, 2]]
    canary.record(**_first(_request(device, 20)))  # no roots: the anchor
    assert canary.records[20, 2].item() == signed(ANCHOR)
    assert canary.records[21, 2].item() == signed(mix3(ANCHOR, 11, 0))


@pytest.mark.parametrize("device", DEVICES)
def test_a_first_position_read_under_another_root_is_an_identity_violation(device):
    canary, entries, roots = _recorded_rooted(device)
    assert canary.verify(**entries, roots=roots).tolist() == [False, False, False]
    assert canary.poll() == []
    flags = canary.verify(**entries, roots=_longs([OTHER, 0, 0], device))
    assert flags.tolist() == [True, False, False]
    (row,) = canary.poll()
    assert row.reasons == IDENTITY and not row.reasons & kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH
    assert (row.slot, row.stored_chain, row.expected_aux) == (5, ROOT, OTHER)
    assert row.reasons.labels == ["verify_identity"]
    assert "fail_reason=verify_identity slot_idx=5 " in row.line("KV")
    # Read without roots, the rooted record fails the anchor's chain check, as before.
    assert canary.verify(**entries).tolist() == [True, False, False]
    (row,) = canary.poll()
    assert row.reasons == kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH and row.expected_aux == signed(ANCHOR)


@pytest.mark.parametrize("device", DEVICES)
def test_roots_none_is_the_call_without_them(device):
    # Two canaries over one pool: every call with roots=None on one, without the argument on
    # the other; a slot's bytes change between the calls so that rows are written.
    plain, explicit = _canary(device), _canary(device)
    assert plain.sources[0].as_view().data_ptr() != explicit.sources[0].as_view().data_ptr()
    entries = _first(_request(device))
    for canary, extra in ((plain, {}), (explicit, {"roots": None})):
        canary.record(**entries, **extra)
        canary.sources[0].as_view()[0, 6] += 1  # slot 6's K bytes
        canary.verify(**entries, **extra)
        canary.verify(**{**entries, "positions": entries["positions"] + 1}, **extra)
    assert torch.equal(plain.records, explicit.records)
    assert plain.stats() == explicit.stats()
    assert plain.poll() == explicit.poll() != []


@pytest.mark.parametrize("device", DEVICES)
def test_a_mixed_batch_roots_the_others_at_the_anchor(device):
    # Request A (slots 5..7) has a root; request B (slots 40..42), none: the anchor's value.
    a, b = _first(_request(device)), _first(_request(device, 40))
    batch = {key: torch.cat([a[key], b[key]]) for key in a}
    roots = _longs([ROOT, 0, 0, signed(ANCHOR), 0, 0], device)
    mixed, plain = _canary(device), _canary(device)
    mixed.record(**batch, roots=roots)
    plain.record(**b)
    assert mixed.records[5, 2].item() == ROOT
    assert mixed.records[40:43].tolist() == plain.records[40:43].tolist()
    assert mixed.verify(**batch, roots=roots).tolist() == [False] * 6
    assert mixed.verify(**b).tolist() == [False] * 3  # B's records are as without roots
    flags = mixed.verify(**batch, roots=_longs([ROOT, 0, 0, OTHER, 0, 0], device))
    assert flags.tolist() == [False, False, False, True, False, False]
    assert [(row.slot, row.reasons, row.expected_aux) for row in mixed.poll()] == [(40, IDENTITY, OTHER)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_tensor_list_form_takes_roots_as_the_bound_one(device):
    # The Tensor[] form is what compiled code calls; the bound one is eager's.
    bound, listed = _canary(device), _canary(device)
    entries, roots = _rooted(device, ROOT)
    bound.record(**entries, roots=roots)
    args = (entries["slots"], entries["positions"], entries["tokens"], entries["prev_slots"], listed._no_tag)
    tables = (listed._records, listed._owner_tags, listed._counters, listed._ring)
    torch.ops.kvcanary.record(listed._views, listed._read_bytes, *args, *tables, True, roots)
    assert torch.equal(bound.records, listed.records)
    other = _longs([OTHER, 0, 0], device)
    flags = torch.ops.kvcanary.verify(listed._views, listed._read_bytes, *args[:4], None, *tables, -1, True, roots=other)
    assert flags.tolist() == [True, False, False]
    assert [(row.reasons, row.expected_aux) for row in listed.poll()] == [(IDENTITY, OTHER)]


@pytest.mark.parametrize("device", DEVICES)
def test_an_entry_past_the_capacity_reports_its_previous_slot_not_its_root(device):
    canary = _canary(device, capacity=100)
    slots, prev = _longs([3, 100], device), _longs([-1, -1], device)
    canary.record(slots, prev_slots=prev, roots=_longs([ROOT, OTHER], device), check_bounds=False)
    assert canary.records[3, 2].item() == ROOT
    (row,) = canary.poll()
    assert (row.slot, row.expected_aux, row.reasons) == (100, -1, kc.FailReason.SLOT_OUT_OF_RANGE)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_refuses_roots_without_prev_slots(device):
    # Without prev_slots verify checks no chain, so no root would be compared: a caller who
    # passes roots means them to be checked. Refused before anything runs.
    canary, entries, roots = _recorded_rooted(device)
    without = {key: value for key, value in entries.items() if key != "prev_slots"}
    before = canary.stats()
    with pytest.raises(ValueError, match=r"^kv-canary: verify was given roots but no prev_slots.*; pass prev_slots"):
        canary.verify(**without, roots=_longs([OTHER, 0, 0], device))
    assert canary.stats() == before
    assert canary.verify(**without).tolist() == [False, False, False]  # without roots: no chain checked, as before
