"""``python -m torch_kvcanary``: what is installed, and the demos. The benchmarks are not
part of the package: ``python -m benchmarks.bench`` in a checkout."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from . import __version__
from ._library import has_cuda_library
from .demos import paged_cache as demo
from .demos import transfer as transfer_demo
from .ops import fold
from .reference import reference_fold
from .sources import HashMode, make_packed_source, make_row_source

_DISPATCH_KEYS = ("CPU", "CUDA", "Meta")


def fold_backends() -> list[str]:
    """Dispatch keys that have a kernel for kvcanary::fold."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [key for key in _DISPATCH_KEYS if has("kvcanary::fold", key)]


def _sample_fold(device: str) -> tuple[torch.Tensor, bool]:
    gen = torch.Generator().manual_seed(0)
    k = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=gen).to(device)
    pages = torch.randint(0, 256, (2, 4 * 32), dtype=torch.uint8, generator=gen).to(device)
    sources = make_row_source(layer_buffer=k, read_bytes=sys.maxsize) + make_packed_source(
        page_buffer=pages, page_size=4, bytes_per_token=32, read_bytes=sys.maxsize
    )
    slots = torch.tensor([0, 3, 7, -1], device=device)
    result = fold(sources, slots, mode=HashMode.ALL)
    return result, torch.equal(result, reference_fold(sources, slots))


def info(args: argparse.Namespace) -> int:
    backends = fold_backends()
    print(f"torch_kvcanary {__version__}")
    print(f"python         {platform.python_version()} ({platform.machine()})")
    print(f"torch          {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    print(f"kvcanary::fold kernels: {', '.join(backends)}")
    if not has_cuda_library():
        print("               (CPU-only build: no CUDA kernel was compiled)")
    elif "CUDA" not in backends:
        print("               (CPU-only torch: the CUDA kernels load under a CUDA build of torch)")
    devices = ["cpu"] + (["cuda"] if "CUDA" in backends and torch.cuda.is_available() else [])
    ok = True
    for device in devices:
        result, matches = _sample_fold(device)
        ok &= matches
        print(f"sample fold on {device}: {result.tolist()} ({'matches' if matches else 'DIFFERS from'} the reference)")
    return 0 if ok else 1


def run_demo(args: argparse.Namespace) -> int:
    return transfer_demo.main(args) if args.transfer else demo.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kvcanary", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, fold kernels, a sample fold").set_defaults(run=info)
    demo_parser = commands.add_parser(
        "demo",
        help="catch four classic KV-cache bugs in a paged cache",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.add_argument(
        "--transfer",
        action="store_true",
        help="instead: KV moved between processes over torch.distributed, and the transfer digests catching five bugs on the way",
    )
    demo_parser.set_defaults(run=run_demo)
    args = parser.parse_args(argv)
    return args.run(args)
