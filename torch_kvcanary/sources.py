"""The upstream read_bytes contract and the sources a fold reads.

A source says which bytes belong to a slot:

* `RealKvSource`, SGLang's row form: row ``s // page_size`` of a 2-D (or
  wider) tensor, bytes ``(s % page_size) * num_bytes_per_token`` onwards.
* `ViewSource`, the view form of other engines: ``view[s // P, s % P]`` of a
  view ``[num_pages, P, *token_shape]``, in logical row-major order.

Every helper here returns views of the caller's tensors, never copies.
"""

from __future__ import annotations

import abc
import enum
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch

READ_ALIGN = 16
"""Bytes per read: read sizes, token sizes, strides and addresses are multiples."""

_PARTIAL_READ_BYTES = 16


class HashMode(enum.IntEnum):
    """How much of each slot the fold reads (upstream ``RealKvHashMode``)."""

    OFF = 0  # nothing: every fingerprint is 0
    PARTIAL = 1  # the first 16 bytes of each source
    ALL = 2  # read_bytes of each source


_MODES = frozenset(HashMode)


def as_mode(mode) -> HashMode:
    """``mode`` as a HashMode; raises ValueError for anything else (bools included)."""
    if type(mode) is HashMode:
        return mode
    if isinstance(mode, bool) or mode not in _MODES:
        raise ValueError(f"kv-canary: mode must be a HashMode (OFF=0, PARTIAL=1, ALL=2), got {mode!r}")
    return HashMode(mode)


def resolve_read_bytes(mode: HashMode) -> int:
    """The read size a mode requests: OFF -> 0, PARTIAL -> 16, ALL -> sys.maxsize."""
    mode = as_mode(mode)
    if mode is HashMode.OFF:
        return 0
    if mode is HashMode.ALL:
        return sys.maxsize
    return _PARTIAL_READ_BYTES


def read_bytes_in_mode(mode: HashMode, read_bytes: int) -> int:
    """Leading bytes of each slot that a fold in ``mode`` reads from a source whose
    read_bytes is ``read_bytes``: 0 for OFF, 16 for PARTIAL, read_bytes for ALL."""
    mode = as_mode(mode)
    if mode is HashMode.OFF:
        return 0
    return _PARTIAL_READ_BYTES if mode is HashMode.PARTIAL else read_bytes


def _check_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"kv-canary: {name} must be an int, got {type(value).__name__}")


def folded_bytes(source: KvSource, mode: HashMode) -> int:
    """Leading bytes of each slot of ``source`` that a fold in ``mode`` reads."""
    return read_bytes_in_mode(mode, source.read_bytes)


def clip_read_bytes(*, requested: int, num_bytes_per_token: int) -> int:
    """Validate ``requested`` against a token of ``num_bytes_per_token`` bytes.

    ``0`` reads nothing, ``sys.maxsize`` reads the whole token; anything else must
    be a multiple of `READ_ALIGN` no larger than the token. Raises ValueError
    with upstream's messages, in upstream's order.
    """
    _check_int(requested, "read_bytes")
    _check_int(num_bytes_per_token, "num_bytes_per_token")
    if num_bytes_per_token <= 0 or num_bytes_per_token % READ_ALIGN != 0:
        raise ValueError(f"kv-canary: num_bytes_per_token must be a positive multiple of {READ_ALIGN}, got {num_bytes_per_token}")
    if requested == 0:
        return 0
    if requested == sys.maxsize:
        return num_bytes_per_token
    if requested < 0:
        raise ValueError(f"kv-canary: read_bytes must be non-negative, got {requested}")
    if requested > num_bytes_per_token:
        raise ValueError(f"kv-canary: read_bytes must be <= num_bytes_per_token ({num_bytes_per_token}), got {requested}")
    if requested % READ_ALIGN != 0:
        raise ValueError(f"kv-canary: read_bytes must be a multiple of {READ_ALIGN}, got {requested}")
    return requested


def _check_strided(tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"kv-canary: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"kv-canary: {what} must be a strided (dense) tensor, got {tensor.layout}")


class KvSource(abc.ABC):
    """What every source is: the view form of its bytes, ``[num_pages, page_size,
    *token_shape]`` (`as_view`), and ``read_bytes``, the leading bytes of each token folded."""

    read_bytes: int

    @abc.abstractmethod
    def as_view(self) -> torch.Tensor:
        """The view ``[num_pages, page_size, *token_shape]`` of the source's bytes."""

    @property
    def capacity(self) -> int:
        """Slots in the source: num_pages * page_size."""
        view = self.as_view()
        return view.shape[0] * view.shape[1]

    @property
    def device(self) -> torch.device:
        return self.as_view().device


@dataclass(frozen=True, kw_only=True)
class RealKvSource(KvSource):
    """SGLang's row form: slot ``s`` is ``num_bytes_per_token`` bytes of row ``s // page_size``,
    starting at byte ``(s % page_size) * num_bytes_per_token``; ``read_bytes`` of them are folded.

    ``tensor`` is at least 2-D, any dtype; each row (dims 1..) holds ``page_size`` tokens
    and possibly trailing bytes that are never read.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def __post_init__(self) -> None:
        for name in ("page_size", "num_bytes_per_token", "read_bytes"):
            _check_int(getattr(self, name), f"RealKvSource.{name}")
        if self.page_size < 1:
            raise ValueError(f"kv-canary: RealKvSource.page_size must be >= 1, got {self.page_size}")
        if self.num_bytes_per_token <= 0 or self.num_bytes_per_token % READ_ALIGN != 0:
            raise ValueError(
                f"kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of {READ_ALIGN}, got {self.num_bytes_per_token}"
            )
        if not (0 < self.read_bytes <= self.num_bytes_per_token and self.read_bytes % READ_ALIGN == 0):
            raise ValueError(
                f"kv-canary: RealKvSource.read_bytes must be a positive multiple of {READ_ALIGN} in "
                f"(0, num_bytes_per_token={self.num_bytes_per_token}], got {self.read_bytes}"
            )
        _check_strided(self.tensor, "RealKvSource.tensor")
        if self.tensor.dim() < 2:
            raise ValueError(f"kv-canary: RealKvSource.tensor must be at least 2-D, got shape {tuple(self.tensor.shape)}")
        row_bytes = math.prod(self.tensor.shape[1:]) * self.tensor.element_size()
        if row_bytes % READ_ALIGN != 0:
            raise ValueError(
                f"kv-canary: RealKvSource.tensor dim-1 byte width must be a multiple of {READ_ALIGN}, got "
                f"{row_bytes} bytes (shape={tuple(self.tensor.shape)}, dtype={self.tensor.dtype})"
            )
        page_bytes = self.page_size * self.num_bytes_per_token
        if page_bytes > row_bytes:
            raise ValueError(
                f"kv-canary: RealKvSource page of {self.page_size} x {self.num_bytes_per_token} bytes "
                f"does not fit in a row of {row_bytes} bytes (tensor shape {tuple(self.tensor.shape)}, "
                f"dtype {self.tensor.dtype}); lower page_size or num_bytes_per_token"
            )

    def as_view(self) -> torch.Tensor:
        """The view form ``[num_rows, page_size, *token]`` of the same bytes, without a copy."""
        t, page_size = self.tensor, self.page_size
        num_rows, itemsize = t.shape[0], t.element_size()
        token_elems = self.num_bytes_per_token // itemsize  # element sizes divide READ_ALIGN
        if math.prod(t.shape[1:]) == page_size * token_elems:
            # The row is exactly one page, whatever its strides: index it directly.
            if page_size == 1:
                return t.unsqueeze(1)
            if t.dim() > 2 and t.shape[1] == page_size:
                return t
        try:
            rows = t.view(num_rows, -1)
        except RuntimeError:
            raise ValueError(
                f"kv-canary: RealKvSource.tensor with shape {tuple(t.shape)} and strides {t.stride()} "
                "cannot be read as rows without a copy; make each row (dims 1..) contiguous, "
                "or describe the layout with view_source"
            ) from None
        return rows[:, : page_size * token_elems].view(num_rows, page_size, token_elems)


@dataclass(frozen=True, kw_only=True)
class ViewSource(KvSource):
    """The view form: slot ``s`` is ``view[s // page_size, s % page_size]`` of a view
    ``[num_pages, page_size, *token_shape]``; its first ``read_bytes`` bytes are folded
    (0 leaves the source out). Build it with `view_source`."""

    view: torch.Tensor
    read_bytes: int

    def as_view(self) -> torch.Tensor:
        return self.view


def as_sources(sources: KvSource | Iterable[KvSource]) -> list[KvSource]:
    """One source or an iterable of them, as a list; raises TypeError for anything else."""
    if isinstance(sources, KvSource):
        return [sources]
    sources = list(sources)
    for source in sources:
        if not isinstance(source, KvSource):
            raise TypeError(
                "kv-canary: sources must be RealKvSource or ViewSource objects (from make_row_source, "
                f"make_packed_source or view_source), got {type(source).__name__}"
            )
    return sources


def active_sources(sources: KvSource | Iterable[KvSource], mode: HashMode) -> list[KvSource]:
    """The sources a fold in ``mode`` reads: none for OFF, else those with read_bytes > 0."""
    sources = as_sources(sources)
    return [s for s in sources if s.read_bytes > 0] if mode is not HashMode.OFF else []


def token_bytes(view: torch.Tensor) -> int:
    """Bytes per token of a view ``[num_pages, page_size, *token_shape]``."""
    return math.prod(view.shape[2:]) * view.element_size()


def view_source(view: torch.Tensor, *, read_bytes: int) -> ViewSource:
    """A source over ``view`` (``[num_pages, page_size, *token_shape]``, any dtype and strides).

    ``read_bytes`` is clipped against the token's byte size (`clip_read_bytes`). Strides
    and alignment are checked when the source is folded.

    It returns one source, like the `RealKvSource` constructor, where `make_row_source` and
    `make_packed_source` keep upstream's contract of a tuple (empty when nothing is read): a
    ViewSource whose read_bytes is 0 is simply left out of a fold.
    """
    _check_strided(view, "view_source's view")
    if view.dim() < 2:
        raise ValueError(f"kv-canary: view_source needs a view [num_pages, page_size, *token_shape], got shape {tuple(view.shape)}")
    clipped = clip_read_bytes(requested=read_bytes, num_bytes_per_token=token_bytes(view))
    return ViewSource(view=view, read_bytes=clipped)


def _byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as uint8 rows ``[dim 0, bytes]``, as upstream passes it, when that is a
    view; a tensor whose rows are not contiguous runs stays as it is (upstream copies it)."""
    try:
        return tensor.view(torch.uint8).view(tensor.shape[0], -1)
    except RuntimeError:
        return tensor


def _row_source(tensor: torch.Tensor, page_size: int, bytes_per_token: int, read_bytes: int):
    """The helpers' common tail; read_bytes is not 0 here (that gave ``()`` already)."""
    clipped = clip_read_bytes(requested=read_bytes, num_bytes_per_token=bytes_per_token)
    rows = _byte_rows(tensor)
    return (RealKvSource(tensor=rows, page_size=page_size, num_bytes_per_token=bytes_per_token, read_bytes=clipped),)


def make_row_source(*, layer_buffer: torch.Tensor, read_bytes: int) -> tuple[RealKvSource, ...]:
    """One slot per entry of dim 0 of ``layer_buffer`` (``[num_slots, ...]``, any dtype and
    strides), page_size 1, the whole entry as the token.

    Returns ``()`` when ``read_bytes`` is 0 or the buffer has no slots.
    """
    _check_strided(layer_buffer, "layer_buffer")
    if layer_buffer.dim() == 0 or layer_buffer.shape[0] == 0 or read_bytes == 0:
        return ()
    rows = layer_buffer.unsqueeze(1) if layer_buffer.dim() == 1 else layer_buffer
    return _row_source(rows, 1, math.prod(rows.shape[1:]) * rows.element_size(), read_bytes)


def make_packed_source(*, page_buffer: torch.Tensor, page_size: int, bytes_per_token: int, read_bytes: int) -> tuple[RealKvSource, ...]:
    """``page_size`` tokens of ``bytes_per_token`` bytes per row of ``page_buffer``
    (dim 0 indexes pages; a 1-D buffer is one row).

    Returns ``()`` when ``read_bytes`` is 0 or the buffer is empty.
    """
    _check_strided(page_buffer, "page_buffer")
    if read_bytes == 0 or page_buffer.numel() == 0:
        return ()
    rows = page_buffer.unsqueeze(0) if page_buffer.dim() == 1 else page_buffer
    return _row_source(rows, page_size, bytes_per_token, read_bytes)
