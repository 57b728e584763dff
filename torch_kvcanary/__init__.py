"""torch_kvcanary: fingerprint KV-cache slots to catch silent cache corruption.

The core is ``torch.ops.kvcanary.fold``, SGLang's kv-canary fold (a splitmix64
chain over each slot's leading bytes across one or more sources) as a PyTorch
custom op; `fold` is its Python entry point.
"""

from importlib.metadata import version as _version

from . import layouts
from .canary import FailReason, KvCanary, KvCorruptionError, Violation, ViolationKind
from .ops import fold
from .reference import reference_fold
from .sources import (
    READ_ALIGN,
    HashMode,
    KvSource,
    RealKvSource,
    ViewSource,
    clip_read_bytes,
    make_packed_source,
    make_row_source,
    resolve_read_bytes,
    view_source,
)

__version__ = _version("torch_kvcanary")

__all__ = [
    "READ_ALIGN",
    "FailReason",
    "HashMode",
    "KvCanary",
    "KvCorruptionError",
    "KvSource",
    "RealKvSource",
    "ViewSource",
    "Violation",
    "ViolationKind",
    "clip_read_bytes",
    "fold",
    "layouts",
    "make_packed_source",
    "make_row_source",
    "reference_fold",
    "resolve_read_bytes",
    "view_source",
]
