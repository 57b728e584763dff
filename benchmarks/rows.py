"""What the step benchmarks (`engine_step`, `pd_transfer`, `paged_step_device`) share: the
``--json`` option and the file it writes (`write_rows`), and the host line their tables
start with (`parse_args`)."""

from __future__ import annotations

import argparse
import json
import platform

import torch


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, host_line: bool = True) -> argparse.Namespace:
    """``parser``'s arguments with ``--json`` added; then, with ``host_line``, prints the host
    the numbers are of (its processor, torch and torch's threads)."""
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if host_line:
        print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    return args


def write_rows(path: str | None, rows: list[dict]) -> None:
    """Writes ``rows`` as JSON to ``path`` (``--json``), where one is given."""
    if path:
        with open(path, "w") as out:
            json.dump(rows, out, indent=1)
