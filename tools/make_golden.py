"""Regenerates the golden vectors, tests/data/fold_vectors.json and
tests/data/chain_vectors.json, from the spec transcription of the tests
(tests/spec_oracle.py, a plain-int reading of docs/spec.md that shares nothing with the
package's kernels, torch_kvcanary.reference or torch_kvcanary.identity).

What is regenerated: the expected values (fingerprints; words, roots, records and verify
rows). The inputs of each case (storage bytes, shapes, strides, offsets, slots, modes, read
sizes; identities, tensors and calls) are pinned in the files: their bytes are random and
their seed is not recorded, so they cannot be drawn again. The script keeps them,
recomputes every expected value from them, and writes each file in its canonical form
(JSON, one-space indent, final newline). tests/ops/test_golden.py checks that this gives
back the pinned files byte for byte.

Usage: python tools/make_golden.py [--check] [--chains CHAINS] [PATH]
    PATH     the fold vectors (default: tests/data/fold_vectors.json)
    CHAINS   the chain vectors (default: tests/data/chain_vectors.json)
    --check  write nothing; exit 1 when a file differs from its regeneration
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import chain_golden  # noqa: E402  (tests/chain_golden.py, found through the path above)
import golden  # noqa: E402  (tests/golden.py, found through the path above)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=golden.GOLDEN_PATH, help="the fold vectors")
    parser.add_argument("--chains", type=Path, default=chain_golden.CHAIN_PATH, help="the chain vectors")
    parser.add_argument("--check", action="store_true", help="exit 1 when a file differs from its regeneration")
    args = parser.parse_args(argv)
    status = 0
    for path, regenerate in ((args.path, golden.regenerate), (args.chains, chain_golden.regenerate)):
        pinned = path.read_text()
        regenerated = regenerate(pinned)
        if not args.check:
            path.write_text(regenerated)
        elif regenerated != pinned:
            print(f"{path} differs from its regeneration by the spec transcription", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
