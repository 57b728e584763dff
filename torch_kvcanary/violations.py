"""What the canary reports: `Violation`, one row of its violation ring; `FailReason`, why
the row's entry was flagged (SGLang's bits, then this package's); `ViolationKind`, the call
that flagged it; the row's log line (docs/spec.md, "Log line"); and `KvCorruptionError`,
what the raise policy raises."""

from __future__ import annotations

import enum
import hashlib
import os
from dataclasses import dataclass

_MASK64 = (1 << 64) - 1
VIOLATION_FIELDS = 8
"""The fields of a ring row (`Violation.from_row`)."""
ORIGIN_FIELDS = 3
"""The fields of a ring row's origin: the (step, group, row) of the paged step that wrote it."""


class FailReason(enum.IntFlag):
    """Why an entry was flagged: SGLang's bit values, then this package's."""

    VERIFY_CHAIN_HASH_MISMATCH = 1 << 0
    VERIFY_POSITION_MISMATCH = 1 << 1
    VERIFY_REAL_KV_HASH_MISMATCH = 1 << 2
    WRITE_TOKEN_MISMATCH = 1 << 3  # SGLang's write-input assert; never set here
    WRITE_POSITION_MISMATCH = 1 << 4  # SGLang's write-input assert; never set here
    VERIFY_TOKEN_MISMATCH = 1 << 5
    VERIFY_OWNER_MISMATCH = 1 << 6  # the slot was recorded under another tag
    # A slot or previous slot past the capacity, met where the call could not raise
    # (CUDA-graph capture, compiled CUDA code): the entry was skipped.
    SLOT_OUT_OF_RANGE = 1 << 7
    # A request's first position whose chain is not the root its call gave (the request's
    # identity: its KV was written under another one); in place of VERIFY_CHAIN_HASH_MISMATCH.
    VERIFY_IDENTITY_MISMATCH = 1 << 8

    @property
    def labels(self) -> list[str]:
        """SGLang's labels of the set bits, in bit order (``verify_chain_hash``, ...)."""
        return [bit.name.lower().removesuffix("_mismatch") for bit in FailReason if self & bit]


class ViolationKind(enum.IntEnum):
    """The call that flagged a violation."""

    RECORD = 0  # only SLOT_OUT_OF_RANGE
    VERIFY = 1


@dataclass(frozen=True)
class Violation:
    """One row of the violation ring. ``position``, ``stored_token`` and ``stored_chain`` are
    the slot's record; ``expected_token`` is the token given to verify (-1: none) and
    ``expected_aux`` the chain it expected. For SLOT_OUT_OF_RANGE, ``slot`` and ``position``
    are the entry's inputs and ``expected_aux`` its previous slot."""

    kind: ViolationKind
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain: int
    expected_aux: int
    reasons: FailReason
    # The paged step behind the row (`paged_step.PagedStep`): its step, KV cache group and
    # row (request); -1 for rows of the other calls.
    step: int = -1
    group: int = -1
    row: int = -1

    @classmethod
    def from_row(cls, row: list[int], origin: list[int] = (-1, -1, -1)) -> Violation:
        kind, slot, position, stored_token, expected_token, stored_chain, expected_aux, bits = row
        return cls(ViolationKind(kind), slot, position, stored_token, expected_token, stored_chain, expected_aux, FailReason(bits), *origin)

    def line(self, name: str) -> str:
        """SGLang's log line for this violation, with ``launch_tag=name``; its chains as
        `chain_fingerprint` gives them (docs/spec.md, "Log line")."""
        labels = "+".join(self.reasons.labels) or "none"
        # A row of SLOT_OUT_OF_RANGE alone holds no chain: a 0 and the entry's previous slot.
        shown = _hex64 if self.reasons == FailReason.SLOT_OUT_OF_RANGE else chain_fingerprint
        return (
            f"kv_canary violation: launch_tag={name} fail_reason={labels} slot_idx={self.slot} "
            f"position={self.position} stored_token={self.stored_token} expected_token={self.expected_token} "
            f"stored_chain_hash={shown(self.stored_chain)} expected_aux={shown(self.expected_aux)}"
        )


# A chain is never logged in full: a request's root is the chain of its first position, an
# unkeyed hash of its identity (a cache salt can be guessed from it offline), and any later
# chain gives the root back with the request's tokens. The key is drawn once per process, so
# lines of one process show which chains are equal and no one can compute a fingerprint.
_FINGERPRINT_KEY = os.urandom(16)


def chain_fingerprint(chain: int) -> str:
    """How a log line shows a chain: ``fp:`` and 8 hex digits of BLAKE2b (``digest_size=4``)
    of its 8 little-endian bytes keyed with this process's random key."""
    digest = hashlib.blake2b((chain & _MASK64).to_bytes(8, "little"), digest_size=4, key=_FINGERPRINT_KEY)
    return f"fp:{digest.hexdigest()}"


def _hex64(value: int) -> str:
    return f"{value & _MASK64:#018x}"


class KvCorruptionError(RuntimeError):
    """Raised by `KvCanary.poll` under ``on_violation="raise"``; ``lines`` holds one log line
    per violation (and a summary line for violations dropped or seen on other ranks)."""

    def __init__(self, lines: list[str], violations: list[Violation]):
        super().__init__("\n".join(lines))
        self.lines = lines
        self.violations = violations
