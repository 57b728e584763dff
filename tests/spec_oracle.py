"""docs/spec.md transcribed in plain Python ints: the oracle of the fold, the canary records,
the identity's roots and words, and the digest, for the tests and for tools/make_golden.py;
and a paged serving step (`PagedStep`), from kvcanary::paged_step's contract.

It shares nothing with the package: bytes are taken from tensors by ordinary indexing in
logical order (`tensor_bytes`), words are read with int.from_bytes, and splitmix64 is
written out here, once. The identity is transcribed from the spec's section 8, not taken
from torch_kvcanary.identity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

MASK = (1 << 64) - 1
PARTIAL_READ_BYTES = 16
ANCHOR_SEED = 0xC0FFEE1234567890
ANCHOR = 0xDE7FAE23A9A1B716  # splitmix64(ANCHOR_SEED), the value docs/spec.md pins

# Verify's reason bits.
CHAIN, POSITION, FOLD, TOKEN, OWNER, OUT_OF_RANGE, IDENTITY = 1, 2, 4, 32, 64, 128, 256


# --- arithmetic ----------------------------------------------------------------------------


def splitmix64(x: int) -> int:
    x &= MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    return splitmix64(splitmix64(splitmix64(a) ^ (b & MASK)) ^ (c & MASK))


def signed(x: int) -> int:
    """``x`` modulo 2^64 as a two's complement int64."""
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def word_chain(data: bytes) -> int:
    """h = splitmix64(h ^ w) from h = 0, over the 8-byte little-endian words of ``data``
    in order, the last one zero-padded to 8 bytes."""
    h = 0
    for i in range(0, len(data), 8):
        h = splitmix64(h ^ int.from_bytes(data[i : i + 8].ljust(8, b"\0"), "little"))
    return h


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor``'s elements in logical row-major order."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).tolist())


# --- the fold ------------------------------------------------------------------------------


class Source(NamedTuple):
    """A source as the fold sees it: the bytes of slot ``s`` are ``token_bytes(s)``, and
    the first ``read_bytes`` of them are folded in ALL mode (0 leaves the source out)."""

    token_bytes: Callable[[int], bytes]
    read_bytes: int


def row_form(tensor: torch.Tensor, page_size: int, num_bytes_per_token: int, read_bytes: int) -> Source:
    """The row form: slot ``s`` is ``num_bytes_per_token`` bytes of row ``s // page_size``
    (dims 1.. of ``tensor`` in logical order), from byte ``(s % page_size) * num_bytes_per_token``."""

    def token_bytes(s: int) -> bytes:
        start = (s % page_size) * num_bytes_per_token
        return tensor_bytes(tensor[s // page_size])[start : start + num_bytes_per_token]

    return Source(token_bytes, read_bytes)


def view_form(view: torch.Tensor, read_bytes: int) -> Source:
    """The view form: slot ``s`` is ``view[s // page_size, s % page_size]`` of a view
    ``[num_pages, page_size, *token_shape]``."""
    page_size = view.shape[1]
    return Source(lambda s: tensor_bytes(view[s // page_size, s % page_size]), read_bytes)


def fold(sources: Sequence[Source], slot: int, mode: str) -> int:
    """The fold of one slot over ``sources`` in ``mode`` ("OFF", "PARTIAL" or "ALL")."""
    if mode == "OFF" or slot < 0:
        return 0
    acc = 0
    for source in sources:
        if source.read_bytes == 0:
            continue
        n = PARTIAL_READ_BYTES if mode == "PARTIAL" else source.read_bytes
        acc = splitmix64(acc ^ word_chain(source.token_bytes(slot)[:n]))
    return signed(acc)


# --- the canary records --------------------------------------------------------------------


class Records:
    """A canary's tables: records[s] = [token, position, chain, fold], owners[s] = tag."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.records = [[0, 0, 0, 0] for _ in range(capacity)]
        self.owners = [-1] * capacity

    def link(self, p: int, root: int | None = None) -> int:
        """The chain a slot chaining through ``p`` expects: ``root`` (the anchor when None)
        at a first position."""
        if p < 0:
            return signed(ANCHOR) if root is None else root
        token, position, chain, _ = self.records[p]
        return signed(mix3(chain, token, position))

    def record(self, slots, folds, positions=None, tokens=None, prev_slots=None, tags=None, roots=None):
        for i, s in enumerate(slots):
            if s < 0:
                continue
            p = prev_slots[i] if prev_slots is not None else -1
            chain = self.link(p, roots[i] if roots is not None else None)
            token = tokens[i] if tokens is not None else -1
            position = positions[i] if positions is not None else -1
            self.records[s] = [token, position, chain, folds[i]]
            self.owners[s] = tags[i] if tags is not None else -1

    def verify(self, slots, folds, positions=None, tokens=None, prev_slots=None, tags=None, padding_slot=None, roots=None):
        """(flags, rows): rows are the violation rows (kind 1 = verify)."""
        flags, rows = [], []
        for i, s in enumerate(slots):
            if s < 0 or s == padding_slot:
                flags.append(False)
                continue
            token, position, chain, fold = self.records[s]
            bits, expected = 0, chain
            if prev_slots is not None and prev_slots[i] < 0 and roots is not None:
                expected = roots[i]
                bits |= IDENTITY if chain != expected else 0
            elif prev_slots is not None and not (prev_slots[i] >= 0 and prev_slots[i] == padding_slot):
                expected = self.link(prev_slots[i])
                bits |= CHAIN if chain != expected else 0
            if positions is not None and position != positions[i]:
                bits |= POSITION
            if fold != folds[i]:
                bits |= FOLD
            expected_token = tokens[i] if tokens is not None else -1
            if expected_token != -1 and token != expected_token:
                bits |= TOKEN
            if tags is not None and self.owners[s] != tags[i]:
                bits |= OWNER
            flags.append(bits != 0)
            if bits:
                rows.append([1, s, position, token, expected_token, chain, expected, bits])
        return flags, rows


# --- identity: roots and words ----------------------------------------------------------------

TAG_LORA_NAME, TAG_LORA_WEIGHTS, TAG_CACHE_SALT, TAG_ITEM, TAG_EMBEDDING = 2, 3, 4, 5, 6  # tag 1 is retired
WORD_BITS = (1 << 63) - 1


def blake64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def le64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def field(data: bytes) -> bytes:
    return le64(len(data)) + data


def utf8(text: str) -> bytes:
    """UTF-8, each code point by its own form; a surrogate code point (U+D800 to U+DFFF, which
    a Python str can hold alone) in the three-byte form of its number."""
    out = b""
    for char in text:
        point = ord(char)
        if 0xD800 <= point <= 0xDFFF:
            out += bytes([0xE0 | point >> 12, 0x80 | (point >> 6) & 0x3F, 0x80 | point & 0x3F])
        else:
            out += char.encode("utf-8")
    return out


def text_word(text: str) -> int:
    return signed(blake64(utf8(text)))


def tensor_record(tensor: torch.Tensor) -> bytes:
    dtype = str(tensor.dtype).removeprefix("torch.")
    sizes = b"".join(le64(n) for n in tensor.shape)
    return field(dtype.encode()) + le64(tensor.dim()) + sizes + field(tensor_bytes(tensor))


def weights_word(tensors: dict[str, torch.Tensor]) -> int:
    return signed(blake64(b"".join(field(utf8(name)) + tensor_record(tensors[name]) for name in sorted(tensors))))


def root(lora: tuple[str, int] | None = None, cache_salt: str | None = None) -> int:
    """A request's root from its adapter (name, weights word) and its cache salt."""
    h = ANCHOR
    if lora is not None:
        name, weights = lora
        h = mix3(mix3(h, TAG_LORA_NAME, text_word(name)), TAG_LORA_WEIGHTS, weights)
    if cache_salt:
        h = mix3(h, TAG_CACHE_SALT, text_word(cache_salt))
    return signed(h)


def item_word(item: int, offset: int) -> int:
    return mix3(TAG_ITEM, item, offset) & WORD_BITS


def embedding_word(row: torch.Tensor) -> int:
    return mix3(TAG_EMBEDDING, blake64(tensor_record(row)), 0) & WORD_BITS


# --- the digest ----------------------------------------------------------------------------


def unit_fold(data: bytes) -> int:
    assert len(data) % 4 == 0
    return word_chain(data)


def unit_bytes(view: torch.Tensor, slot: int, unit: int) -> bytes:
    """The bytes of unit ``unit`` of slot ``slot`` of a digest view, in logical row-major order."""
    page_size = view.shape[1]
    return tensor_bytes(view[slot // page_size, slot % page_size, unit])


def _ints(values) -> list[int]:
    return [int(v) for v in torch.as_tensor(values).reshape(-1).tolist()]


def digest(views, slots, positions, unit_offsets, groups=None, num_groups: int = 1) -> list[int]:
    views = [v.cpu() for v in views]
    slots, positions = _ints(slots), _ints(positions)
    groups = [0] * len(slots) if groups is None else _ints(groups)
    out = [0] * num_groups
    for s, p, g in zip(slots, positions, groups):
        if s < 0:
            continue
        for view, offset in zip(views, unit_offsets):
            for k in range(view.shape[2]):
                out[g] = (out[g] + mix3(offset + k, p, unit_fold(unit_bytes(view, s, k)))) & MASK
    return [signed(x) for x in out]


# --- the slots of a step's ranges ------------------------------------------------------------


def range_entries(table: list[list[int]], lengths: list[int], starts: list[int], block_size: int, cut_slot: int = -1) -> list[list[int]]:
    """[slots, positions, prev_slots, rows] of one range of positions per row, entry by entry:
    ``lengths[r]`` positions of row ``r`` from ``starts[r]``, each read through ``table[r]``;
    a row's first position > 0 chains through ``cut_slot`` when it is >= 0."""

    def slot(row: int, p: int) -> int:
        return table[row][p // block_size] * block_size + p % block_size

    out: list[list[int]] = [[], [], [], []]
    for row, (length, start) in enumerate(zip(lengths, starts)):
        for p in range(start, start + length):
            if p == 0:
                prev = -1
            elif p == start and cut_slot >= 0:
                prev = cut_slot
            else:
                prev = slot(row, p - 1)
            for column, value in zip(out, (slot(row, p), p, prev, row)):
                column.append(value)
    return out


def verify_ranges(
    records: Records,
    fold_of: Callable[[list[int]], list[int]],
    table: list[list[int]],
    lengths: list[int],
    starts: list[int],
    block_size: int,
    *,
    cut_slot: int = -1,
    written: Sequence[int] = (),
    deferred: bool = False,
    every: int = 1,
    turn: int = 0,
    history: list[list[int]] | None = None,
    known: list[list[bool]] | None = None,
    history_rows: list[int] | None = None,
    padding_slot: int | None = None,
    roots: list[int] | None = None,
) -> tuple[list[int], list[int], list[bool], int, list[list[int]]]:
    """(slots, rows, flags, waiting, violation rows) of a step's context check, entry by entry:
    `range_entries`' entries, each chosen or not (a slot in ``written`` waits for the
    ``deferred`` call; under ``every`` > 1 the blocks of the turn and each row's last block),
    then `Records.verify` of the chosen ones with the folds ``fold_of`` gives (``roots``: one
    per row, the root of its position 0)."""
    slots, positions, prev_slots, rows = range_entries(table, lengths, starts, block_size, cut_slot)
    checked, tokens, waiting = [], [], 0
    for slot, p, r in zip(slots, positions, rows):
        is_written = slot in written
        last = starts[r] + lengths[r] - 1
        sampled = every <= 1 or (p // block_size) % every == turn or p // block_size == last // block_size
        chosen = slot >= 0 and (is_written if deferred else not is_written and sampled)
        waiting += slot >= 0 and is_written and not deferred
        checked.append(slot if chosen else -1)
        token = -1
        if chosen and history is not None:
            h = r if history_rows is None else history_rows[r]
            if 0 <= h < len(history) and p < len(history[h]) and (known is None or known[h][p]):
                token = history[h][p]
        tokens.append(token)
    entry_roots = None if roots is None else [roots[r] for r in rows]
    flags, ring = records.verify(
        checked, fold_of(checked), positions=positions, tokens=tokens, prev_slots=prev_slots, padding_slot=padding_slot,
        roots=entry_roots,
    )  # fmt: skip
    return checked, rows, flags, waiting, ring


# --- a paged serving step ------------------------------------------------------------------


class PagedStep:
    """kvcanary::paged_step (its contract is in csrc/ops.cpp) over `Records`, entry by
    entry: ``tables[g]`` and ``slot_mappings[g]`` are group ``g``'s block table (lists of
    blocks per row) and slot mapping, ``windows[g]`` and ``chunks[g]`` its sliding window and
    attention chunk (0: none). `step` returns the ring rows of one call, each with its
    (step, group, row); the flagged slots of a step's first phase stay for its refold.
    ``roots`` (one per row, or None) roots each request's position 0."""

    def __init__(
        self, records: Records, fold_of: Callable[[list[int]], list[int]], tables, slot_mappings, windows, chunks, block_size: int
    ):
        self.records, self.fold_of = records, fold_of
        self.tables, self.slot_mappings = tables, slot_mappings
        self.windows, self.chunks, self.block_size = windows, chunks, block_size
        self.flagged: set[int] = set()

    def slot(self, g: int, r: int, p: int) -> int:
        table = self.tables[g][r]
        if p < 0 or p // self.block_size >= len(table) or table[p // self.block_size] < 0:
            return -1
        return table[p // self.block_size] * self.block_size + p % self.block_size

    def first(self, g: int, computed: int) -> int:
        if self.windows[g]:
            return max(0, computed - self.windows[g] + 1)
        if self.chunks[g]:
            return computed // self.chunks[g] * self.chunks[g]
        return 0

    def step(self, qsl, seq_lens, positions, input_ids, *, phase: int, step: int, every: int = 1, padding_slot=None,
             history=None, known=None, history_rows=None, roots=None) -> list[tuple[list[int], tuple[int, int, int]]]:  # fmt: skip
        rows = len(seq_lens)
        scheduled = [qsl[r + 1] - qsl[r] for r in range(rows)]
        computed = [seq_lens[r] - scheduled[r] for r in range(rows)]
        groups = range(len(self.tables))
        num_tokens = qsl[rows] if rows else 0
        written = {self.slot_mappings[g][t] for g in groups for t in range(num_tokens)}
        out: list[tuple[list[int], tuple[int, int, int]]] = []
        if phase != 2:
            self.flagged = set()

        def check_context(deferred: bool, with_written: bool) -> None:
            for g in groups:
                starts = [self.first(g, computed[r]) for r in range(rows)]
                lengths = [computed[r] - starts[r] for r in range(rows)]
                checked, entry_rows, flags, _, ring = verify_ranges(
                    self.records, self.fold_of, [self.tables[g][r] for r in range(rows)], lengths, starts, self.block_size,
                    cut_slot=-1 if padding_slot is None else padding_slot, written=written if with_written else (),
                    deferred=deferred, every=every, turn=step % every, history=history, known=known,
                    history_rows=history_rows, padding_slot=padding_slot, roots=roots,
                )  # fmt: skip
                flagged_rows = [r for r, flag in zip(entry_rows, flags) if flag]
                out.extend((row, (step, g, r)) for row, r in zip(ring, flagged_rows))

        def record() -> None:
            order = sorted(range(rows), key=lambda r: computed[r])
            slots, pos, tokens, prev, entry_roots = [], [], [], [], []
            for g in groups:
                for r in order:
                    for j in range(scheduled[r]):
                        t = qsl[r] + j
                        slots.append(self.slot_mappings[g][t])
                        pos.append(positions[t])
                        tokens.append(input_ids[t] if input_ids is not None else -1)
                        prev.append(self.slot(g, r, computed[r] + j - 1))
                        entry_roots.append(roots[r] if roots is not None else None)
            self.records.record(
                slots, self.fold_of(slots), positions=pos, tokens=tokens, prev_slots=prev, roots=None if roots is None else entry_roots
            )

        if phase == 0:
            record()
            check_context(deferred=False, with_written=False)
        elif phase == 1:
            check_context(deferred=False, with_written=True)
            for g in groups:
                for r in range(rows):
                    end = -(-computed[r] // self.block_size) * self.block_size
                    tail = [self.slot(g, r, p) for p in range(min(computed[r] + scheduled[r], end), end)]
                    tail = [s for s in tail if s >= 0]
                    _, ring = self.records.verify(tail, self.fold_of(tail), padding_slot=padding_slot)
                    out.extend((row, (step, g, r)) for row in ring)
            self.flagged = {row[1] for row, _ in out}
        else:
            record()
            blocks = set()
            for g in groups:
                for r in range(rows):
                    if scheduled[r]:
                        start = computed[r] // self.block_size * self.block_size
                        end = -(-(computed[r] + scheduled[r]) // self.block_size) * self.block_size
                        blocks.update(self.slot(g, r, p) for p in range(start, end))
            slots = sorted(s for s in blocks - self.flagged if s >= 0)
            for s, fold in zip(slots, self.fold_of(slots)):
                self.records.records[s][3] = fold
            check_context(deferred=True, with_written=True)
        return out
