"""What the kvcanary ops' Python wrappers share (how a refusal reaches the caller, the integer
view of an input, whether a call may check bounds), and the fold's wrapper
`fold` beside its fake kernel. The other ops' wrappers and fakes: canary.py with
canary_inputs.py (record, verify, refold), digest.py (digest), paged_step.py (paged_step)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _library  # noqa: F401  (loads the ops' libraries, which the fakes below register with)
from .binding import check_table_fake
from .sources import HashMode, KvSource, active_sources, as_mode, folded_bytes


def c10_dtype_name(dtype: torch.dtype) -> str:
    """The name C++ prints for ``dtype`` ("Float", "Short", ...), as the kernels' messages say it."""
    return torch.empty((), dtype=dtype, device="cpu").type().removeprefix("torch.").removesuffix("Tensor")


# How a kernel's refusal reaches the caller (csrc/plan/checks.h): a `kv-canary:` message in
# an IndexError (a slot or group out of range) or in a ValueError, which torch raises as a
# RuntimeError from torch 2.15 on; no kernel can raise TypeError, so a refused index dtype
# arrives as a ValueError too. The package's functions raise `refusal(error, ...)` for what an
# op raised: a TypeError where one of their index tensors has a dtype the kernels refuse, a
# refusal that reached them as a RuntimeError as the ValueError it is. Each error then has its
# documented type on every torch, at no cost to a call that succeeds.
_INDEX_DTYPES = (torch.int32, torch.int64)


def index_dtype_error(value: torch.Tensor, name: str) -> TypeError | None:
    """The kernels' index-dtype check (csrc/plan/checks.cpp), with its message, as a TypeError;
    None when ``value`` is int32 or int64."""
    if value.dtype in _INDEX_DTYPES:
        return None
    return TypeError(f"kv-canary: {name} must be an int32 or int64 tensor, got {c10_dtype_name(value.dtype)}")


def check_index_dtype(value: torch.Tensor, name: str) -> None:
    """Raises `index_dtype_error`."""
    if (error := index_dtype_error(value, name)) is not None:
        raise error


def refusal(error: Exception, index_tensors: dict[str, torch.Tensor | None]) -> Exception:
    """The exception to raise for ``error``, raised by an op a package function called with
    ``index_tensors`` (by name; None: not given): when it is a kernel's refusal (a plain
    ValueError or RuntimeError with a `kv-canary:` message), a TypeError for the first of them
    whose dtype the kernels refuse, else a ValueError; ``error`` itself otherwise."""
    if type(error) not in (ValueError, RuntimeError) or not str(error).startswith("kv-canary: "):
        return error
    for name, value in index_tensors.items():
        if value is not None and (dtype_error := index_dtype_error(value, name)) is not None:
            return dtype_error
    return ValueError(str(error)) if type(error) is RuntimeError else error


def may_check_bounds(slots: torch.Tensor) -> bool:
    """Whether an op over ``slots`` may check their range. Off a CPU the check synchronises
    with the host, so it is never made while torch.compile traces (the CUDA kernels
    themselves skip it while a CUDA graph is being captured)."""
    return not (torch.compiler.is_compiling() and slots.device.type != "cpu")


_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def integer_view(view: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer dtype of the same size: the op hashes bytes, and
    tools that inspect its inputs (opcheck, FakeTensor) need no float8 arithmetic."""
    dtype = _INTEGER_OF_SIZE.get(view.element_size(), view.dtype)
    return view if view.dtype == dtype else view.view(dtype)


@torch.library.register_fake("kvcanary::fold")
def _fold_fake(sources, slots, read_bytes, check_bounds=True):
    # The checks of make_fold_plan (csrc/plan/fold_plan.cpp) that need no data nor guards on
    # symbolic sizes, with its messages; mixed devices reach this kernel when one is meta.
    check_index_dtype(slots, "slots")
    if len(sources) != len(read_bytes):
        raise ValueError(f"kv-canary: got {len(sources)} sources but {len(read_bytes)} read_bytes; pass one read_bytes per source")
    check_sources_fake(sources, slots, views=True)
    return slots.new_empty(slots.shape, dtype=torch.int64)


def check_sources_fake(sources, slots: torch.Tensor, *, views: bool) -> None:
    """The sources' checks that need no data, in source order, with the kernels' messages:
    each on the slots' device and, with ``views``, a view [num_pages, page_size, ...]. Mixed
    devices reach a fake kernel when one of them is meta."""
    for index, view in enumerate(sources):
        if view.device != slots.device:
            raise ValueError(f"kv-canary: source {index} is on {view.device} but slots are on {slots.device}; put them on one device")
        if views and view.dim() < 2:
            raise ValueError(f"kv-canary: source {index} must be a view [num_pages, page_size, *token_shape], got shape {list(view.shape)}")


@torch.library.register_fake("kvcanary::fold.bound")
def _fold_bound_fake(sources_table, slots, check_bounds=True):
    check_index_dtype(slots, "slots")
    check_table_fake(sources_table)
    return slots.new_empty(slots.shape, dtype=torch.int64)


def fold(
    sources: KvSource | Iterable[KvSource],
    slots: torch.Tensor,
    *,
    mode: HashMode = HashMode.ALL,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Fingerprint ``slots`` over ``sources``: SGLang's kv-canary fold, a splitmix64 chain
    over each slot's leading bytes across the sources, in order.

    Args:
        sources: one source or a sequence of them, folded in order; sources whose
            read_bytes is 0 are left out.
        slots: int32 or int64 tensor of any shape on the sources' device; negative
            slots are padding and give 0.
        mode: OFF gives zeros, PARTIAL folds the first 16 bytes of each source,
            ALL folds each source's read_bytes.
        check_bounds: raise IndexError for a slot >= the smallest source capacity.
            With False such slots give 0; nothing is ever read out of bounds. On CUDA
            the check costs a host sync, so it is skipped under torch.compile and
            CUDA-graph capture.

    Returns:
        int64 tensor shaped like ``slots``.
    """
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"kv-canary: slots must be an int32 or int64 tensor, got {type(slots).__name__}")
    mode = as_mode(mode)
    active = active_sources(sources, mode)
    views = [integer_view(s.as_view()) for s in active]
    read_bytes = [folded_bytes(s, mode) for s in active]
    check_bounds = check_bounds and may_check_bounds(slots)
    try:
        return torch.ops.kvcanary.fold(views, slots, read_bytes, check_bounds)
    except (ValueError, RuntimeError) as error:
        raise refusal(error, {"slots": slots}) from None
