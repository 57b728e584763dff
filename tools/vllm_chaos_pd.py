"""A chaos soak of a P/D pair (a prefill and a decode `vllm serve` through NIXL,
`KvCanaryConnector` around NixlConnector on both) under `repair` or `quarantine`: faults on
either side while the workload runs, then the checks (`torch_kvcanary.testing.soak.chaos_pd`,
docs/chaos.md); with ``--unverified``, misconfigured pairs instead of faults
(`torch_kvcanary.testing.soak.unverified`). Exits 1 if any check failed.

    python tools/vllm_chaos_pd.py --requests 1000 --policy repair|quarantine|both --faults K [--restart-prefill]
    python tools/vllm_chaos_pd.py --requests 1000 --policy quarantine --unverified
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch_kvcanary.testing.soak.chaos_pd import PdChaosResult, chaos_pd
from torch_kvcanary.testing.soak.harness import soak_parser, soak_policies
from torch_kvcanary.testing.soak.unverified import soak_unverified


def main(argv: list[str] | None = None) -> int:
    parser = soak_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--restart-prefill", action="store_true", help="kill the prefill server once mid-run and start it again")
    parser.add_argument(
        "--unverified", action="store_true", help="instead of faults: a router dropping the canary's key, then P and D in two fold modes"
    )
    args = parser.parse_args(argv)
    if args.unverified:
        return soak_unverified(args.policy, args.requests, args.model)
    from torch_kvcanary.testing.random_models import VOCAB_SIZE

    def run(model: Path, policy: str, site: Path) -> PdChaosResult:
        return chaos_pd(model, VOCAB_SIZE, policy, args.requests, args.faults, args.restart_prefill, site)

    return soak_policies("chaos-pd", args.policy, run, args.model)


if __name__ == "__main__":
    sys.exit(main())
