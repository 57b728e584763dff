"""What the vLLM plugin costs: generated tokens per second with the plugin off, in PARTIAL
and in ALL, on random Llamas made on the spot (tools/random_models.py).

    .venv-vllm/bin/python -m benchmarks.vllm_bench [--models tiny small] [--rounds 5]

One engine per model (in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, started with the
plugin on) serves the same workload in turns: with no canary (off: the plugin's hooks only
check that none is attached), with a PARTIAL canary and with an ALL canary, each built over
the engine's KV cache as the plugin builds it. The prefix cache is reset before each run, so
every run starts from an empty cache. Printed: the median tokens/s of each setting over
``--rounds`` turns, the median of its per-round ratio to off, and the range of its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from random_models import TINY, make_llama  # noqa: E402

MODELS = {
    "tiny": TINY,
    # About 150 M parameters: the largest random Llama a 2-core CPU serves at a sensible speed.
    "small": dict(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        num_hidden_layers=12,
    ),
}
SETTINGS = ("off", "partial", "all")


def workload(num_requests: int, prompt_len: int, output_len: int):
    """Prompts sharing a one-block prefix, greedy, each generating ``output_len`` tokens."""
    import random

    from vllm import SamplingParams

    rng = random.Random(0)
    prefix = [rng.randrange(2, 512) for _ in range(32)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(2, 512) for _ in range(prompt_len - 32)]} for _ in range(num_requests)]
    return prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def child(args) -> None:
    """One model: start an engine, warm up, then the settings in turns; one JSON line on stdout."""
    from vllm import LLM

    from torch_kvcanary import HashMode
    from torch_kvcanary.integrations.vllm import adapter, plugin

    llm = LLM(
        model=args.model_dir, dtype="bfloat16", max_model_len=1024, block_size=32, enforce_eager=True,
        distributed_executor_backend="uni", enable_prefix_caching=True, kv_cache_memory_bytes=256 << 20,
        gpu_memory_utilization=0.05, max_num_seqs=args.requests,
    )  # fmt: skip
    runner = plugin.active().runner
    canaries = {
        "off": None,
        "partial": plugin.WorkerCanary(runner, plugin.Settings("log", HashMode.PARTIAL)),
        "all": plugin.WorkerCanary(runner, plugin.Settings("log", HashMode.ALL)),
    }
    prompts, params = workload(args.requests, args.prompt_len, args.output_len)
    rates = {setting: [] for setting in SETTINGS}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for setting in SETTINGS:
            llm.reset_prefix_cache()
            adapter.watch(runner, canaries[setting])
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if round_:
                rates[setting].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    violations = {s: c.canary.stats()["violations"] for s, c in canaries.items() if c is not None}
    print(json.dumps({"rates": rates, "violations": violations}))


def run_model(model_dir: Path, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env.update(KVCANARY_VLLM="log", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=args.cpus)
    command = [sys.executable, __file__, "--child", "--model-dir", str(model_dir), "--rounds", str(args.rounds),
               "--requests", str(args.requests), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{model_dir.name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--cpus", default="0",
        help="VLLM_CPU_OMP_THREADS_BIND: the cores vLLM's OpenMP threads run on (default one, so that load on "
        "the other cores of a shared machine slows a run in proportion instead of stalling every barrier)",
    )  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"{args.requests} requests of {args.prompt_len} prompt + {args.output_len} generated tokens, "
          f"{args.rounds} rounds of off/partial/all; vLLM on cores {args.cpus} of {os.cpu_count()}")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            result = run_model(make_llama(Path(scratch) / name, **MODELS[name]), args)
            if any(result["violations"].values()):
                sys.exit(f"{name}: violations on a clean run: {result['violations']}")
            rates = result["rates"]
            for setting in SETTINGS:
                values = rates[setting]
                ratio = statistics.median(v / off for v, off in zip(values, rates["off"]))
                print(f"{name:6s} {setting:8s} {statistics.median(values):9.1f} tokens/s  {ratio:5.2f}x off  "
                      f"(runs {min(values):.1f} .. {max(values):.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
