"""The SPEC's canary records transcribed in plain Python ints: the oracle of the record and
verify kernels. The slots' folds come from `reference_fold` (pure torch)."""

from __future__ import annotations

MASK = (1 << 64) - 1
ANCHOR = 0xDE7FAE23A9A1B716  # splitmix64(0xC0FFEE1234567890), the SPEC's value
CHAIN, POSITION, FOLD, TOKEN, OWNER, OUT_OF_RANGE = 1, 2, 4, 32, 64, 128


def splitmix64(x: int) -> int:
    x &= MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    return splitmix64(splitmix64(splitmix64(a) ^ (b & MASK)) ^ (c & MASK))


def signed(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


class Records:
    """records[s] = [token, position, chain, fold]; owners[s] = tag."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.records = [[0, 0, 0, 0] for _ in range(capacity)]
        self.owners = [-1] * capacity

    def link(self, p: int) -> int:
        if p < 0:
            return signed(ANCHOR)
        token, position, chain, _ = self.records[p]
        return signed(mix3(chain, token, position))

    def record(self, slots, folds, positions=None, tokens=None, prev_slots=None, tags=None):
        for i, s in enumerate(slots):
            if s < 0:
                continue
            p = prev_slots[i] if prev_slots is not None else -1
            chain = self.link(p)
            token = tokens[i] if tokens is not None else -1
            position = positions[i] if positions is not None else -1
            self.records[s] = [token, position, chain, folds[i]]
            self.owners[s] = tags[i] if tags is not None else -1

    def verify(self, slots, folds, positions=None, tokens=None, prev_slots=None, tags=None, padding_slot=None):
        """(flags, rows): rows are the SPEC's violation rows (kind 1 = verify)."""
        flags, rows = [], []
        for i, s in enumerate(slots):
            if s < 0 or s == padding_slot:
                flags.append(False)
                continue
            token, position, chain, fold = self.records[s]
            bits, expected = 0, chain
            if prev_slots is not None and not (prev_slots[i] >= 0 and prev_slots[i] == padding_slot):
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
