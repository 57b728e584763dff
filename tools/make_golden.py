"""Regenerates the golden vectors, tests/data/fold_vectors.json, from the spec transcription
of the tests (tests/spec_oracle.py, a plain-int reading of docs/spec.md that shares nothing
with the package's kernels nor with torch_kvcanary.reference).

What is regenerated: the expected fingerprints. The inputs of each case (storage bytes,
shapes, strides, offsets, slots, modes, read sizes) are pinned in the file: their bytes are
random and their seed is not recorded, so they cannot be drawn again. The script keeps
them, recomputes every case's ``expected`` from them, and writes the file in its canonical
form (JSON, one-space indent, final newline). tests/ops/test_golden.py checks that this gives
back the pinned file byte for byte.

Usage: python tools/make_golden.py [--check] [PATH]
    PATH     the golden file (default: tests/data/fold_vectors.json)
    --check  write nothing; exit 1 when the file differs from its regeneration
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import golden  # noqa: E402  (tests/golden.py, found through the path above)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=golden.GOLDEN_PATH, help="the golden file")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from its regeneration")
    args = parser.parse_args(argv)
    pinned = args.path.read_text()
    regenerated = golden.regenerate(pinned)
    if args.check:
        if regenerated != pinned:
            print(f"{args.path} differs from its regeneration by the spec transcription", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(regenerated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
