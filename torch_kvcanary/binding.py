"""Sources bound once: `SourceTable` validates the canary ops' sources a single time and
holds the table that the ops' ``.bound`` overloads take in place of ``Tensor[] sources,
SymInt[] read_bytes``, so that a call's host cost does not grow with the number of sources
(an 80-layer model's K and V are 160 sources). Beside it, the fake kernel of
``kvcanary::bind_sources`` and the table check the bound ops' fakes share."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from . import _library  # noqa: F401  (loads the ops' libraries, which the fake below registers with)

# The table's header (csrc/plan/bound_sources.h): its words before the sources' layouts, and
# the words of each layout.
TABLE_HEADER_WORDS = 7
LAYOUT_WORDS = 19
_BIND_AGAIN = "bind the sources again (torch_kvcanary.SourceTable, or a new KvCanary) and pass its table"


def check_table_fake(table: torch.Tensor) -> None:
    """The bound ops' check of their table (csrc/plan/bound_sources.cpp) that needs no data,
    with its message."""
    if table.dtype != torch.int64 or table.device.type != "cpu" or table.dim() != 1:
        raise ValueError(
            "kv-canary: sources_table must be a table made by bind_sources (a contiguous 1-D int64 CPU tensor), got a "
            f"{table.dtype} tensor of shape {list(table.shape)} on {table.device}; {_BIND_AGAIN}"
        )


@torch.library.register_fake("kvcanary::bind_sources")
def _bind_sources_fake(sources, read_bytes):
    # The checks of lay_out_sources (csrc/plan/fold_plan.cpp) that need no data, with its
    # messages; mixed devices reach this kernel when one is meta.
    if len(sources) != len(read_bytes):
        raise ValueError(f"kv-canary: got {len(sources)} sources but {len(read_bytes)} read_bytes; pass one read_bytes per source")
    for index, view in enumerate(sources):
        if view.device != sources[0].device:
            raise ValueError(
                f"kv-canary: source {index} is on {view.device} but source 0 is on {sources[0].device}; put them on one device"
            )
    return torch.empty(TABLE_HEADER_WORDS + LAYOUT_WORDS * len(sources), dtype=torch.int64, device="cpu")


def _invalidate(table: torch.Tensor) -> None:
    table[0] = 0  # the magic word (csrc/plan/bound_sources.h)


def _signature(view: torch.Tensor) -> tuple:
    """What a bound table assumes of a source: where its data lies and how it is laid out."""
    return view.data_ptr(), tuple(view.shape), view.stride(), view.dtype, view.device


class SourceTable:
    """The canary ops' sources, validated once (as ``fold`` validates them, with its
    ``kv-canary:`` errors) and bound into one int64 CPU tensor, `table`, that the ops'
    ``.bound`` overloads take: ``torch.ops.kvcanary.record.bound(table, slots, ...)``.

    The table holds the sources' data pointers and layouts, not the sources: this object
    keeps the views alive for as long as it is bound. A view must keep its data and layout
    while bound; `check` says whether it did (O(sources), for the places where a caller
    may rebind, never per step). `release` invalidates the table: a bound op then refuses
    it with a ``kv-canary:`` ValueError that says to bind again, as it refuses any tensor
    that is not a live table; so does collecting this object, so that a table kept past its
    owner is refused rather than read. When an engine re-allocates its KV cache (vLLM re-initialising
    it), the canary over the old cache is rebuilt over the new one, which binds again.

    A bound op's schema names the table, not the memory it points at, so torch.compile
    cannot order it against writes to the sources: compiled code calls the ``Tensor[]``
    forms (`KvCanary` does so by itself).

    Args:
        views: the sources as the ops take them (``[num_pages, page_size, *token_shape]``
            views, one device).
        read_bytes: the leading bytes of each token folded, one per view.
    """

    def __init__(self, views: Sequence[torch.Tensor], read_bytes: Sequence[int]):
        self._views = tuple(views)
        self._read_bytes = tuple(read_bytes)
        self._table = torch.ops.kvcanary.bind_sources(list(self._views), list(self._read_bytes))
        self._bound_as = tuple(_signature(v) for v in self._views)
        self._released = False
        self._release_table = weakref.finalize(self, _invalidate, self._table)

    @property
    def table(self) -> torch.Tensor:
        """The bound table: pass it as a ``.bound`` op's ``sources_table``."""
        if self._released:
            raise ValueError(f"kv-canary: this SourceTable was released; {_BIND_AGAIN}")
        return self._table

    @property
    def views(self) -> tuple[torch.Tensor, ...]:
        """The bound sources, which this table keeps alive (empty once released)."""
        return self._views

    @property
    def read_bytes(self) -> tuple[int, ...]:
        return self._read_bytes

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Invalidates the table (a bound op refuses it from now on) and lets go of the
        sources. Idempotent."""
        self._release_table()
        self._views = ()
        self._released = True

    def check(self) -> None:
        """Raises a ``kv-canary:`` ValueError naming the first source whose data pointer,
        shape, strides, dtype or device changed since it was bound (``set_``, ``resize_``,
        a storage re-allocated under it), or when the table was released; the table reads
        the old memory in such a case, so bind again. O(sources): call it where the sources
        may have been replaced (a KV cache re-initialised), not per step."""
        if self._released:
            raise ValueError(f"kv-canary: this SourceTable was released; {_BIND_AGAIN}")
        for index, (view, bound) in enumerate(zip(self._views, self._bound_as, strict=True)):
            now = _signature(view)
            if now != bound:
                fields = ("data pointer", "shape", "strides", "dtype", "device")
                changed = ", ".join(f"{name} {old} -> {new}" for name, old, new in zip(fields, bound, now, strict=True) if old != new)
                raise ValueError(f"kv-canary: source {index} changed since it was bound ({changed}); {_BIND_AGAIN}")
