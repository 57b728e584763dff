"""torch_kvcanary: fingerprint KV-cache slots to catch silent cache corruption.

The core is ``torch.ops.kvcanary.fold``, SGLang's kv-canary fold (a splitmix64
chain over each slot's leading bytes across one or more sources) as a PyTorch
custom op; `fold` is its Python entry point. ``torch.ops.kvcanary.digest`` (`kv_digest`)
gives one value per request or chunk of KV moved between machines, the same however each
side shards and pages the cache; `verify_transfer` compares them.
"""

from importlib.metadata import version as _version

# Importing the package registers every op's fake kernel, paged_step's among them.
from . import digest, layouts, paged_step  # noqa: F401
from .binding import SourceTable
from .canary import KvCanary
from .digest import kv_digest
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
from .transfer import KvTransferError, TransferCheck, verify_transfer
from .violations import FailReason, KvCorruptionError, Violation, ViolationKind

__version__ = _version("torch_kvcanary")

__all__ = [
    "READ_ALIGN",
    "FailReason",
    "HashMode",
    "KvCanary",
    "KvCorruptionError",
    "KvSource",
    "KvTransferError",
    "RealKvSource",
    "SourceTable",
    "TransferCheck",
    "ViewSource",
    "Violation",
    "ViolationKind",
    "clip_read_bytes",
    "digest",
    "fold",
    "kv_digest",
    "layouts",
    "make_packed_source",
    "make_row_source",
    "reference_fold",
    "resolve_read_bytes",
    "verify_transfer",
    "view_source",
]
