"""A chaos soak of `vllm serve` with the canary under `repair` or `quarantine`: faults injected
into live KV while the workload runs, then the checks (`torch_kvcanary.testing.soak.chaos`,
docs/chaos.md); exits 1 if any check failed.

    python tools/vllm_chaos.py --requests 1000 --policy repair|quarantine|both --faults K [--table-fault]
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch_kvcanary.testing.soak.chaos import FLIP_KINDS, ChaosResult, chaos
from torch_kvcanary.testing.soak.harness import soak_parser, soak_policies


def main(argv: list[str] | None = None) -> int:
    parser = soak_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(FLIP_KINDS), help="fault kinds armed in turn (single, shared, preempted)")
    parser.add_argument("--table-fault", action="store_true", help="last, point a block-table entry at another request's block (checked)")
    args = parser.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    from torch_kvcanary.testing.random_models import VOCAB_SIZE

    def run(model: Path, policy: str, site: Path) -> ChaosResult:
        return chaos(model, VOCAB_SIZE, policy, args.requests, args.faults, kinds, args.table_fault, site)

    return soak_policies("chaos", args.policy, run, args.model)


if __name__ == "__main__":
    sys.exit(main())
