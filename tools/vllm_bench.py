"""What the vLLM plugin costs: generated tokens per second with the plugin off, in PARTIAL
and in ALL, on random Llamas made on the spot (tools/random_llama.py).

    .venv-vllm/bin/python tools/vllm_bench.py [--models tiny small] [--repeats 3] [--rounds 2]

vLLM reads the plugin's switches when an engine starts, so each setting runs in a process
of its own (in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the settings take
turns, ``--rounds`` times, and each process times the same workload ``--repeats`` times
after a warm-up. Printed: the median tokens/s of each setting, its ratio to off, and the
range of its runs.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_llama import TINY, make_llama  # noqa: E402

MODELS = {
    "tiny": TINY,
    # About 150 M parameters: the largest random Llama a 2-core CPU serves at a few tokens/s.
    "small": dict(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8, head_dim=64, num_hidden_layers=12),
}
SETTINGS = {"off": {}, "partial": {"KVCANARY_VLLM": "log", "KVCANARY_VLLM_MODE": "partial"}, "all": {"KVCANARY_VLLM": "log", "KVCANARY_VLLM_MODE": "all"}}


def workload(num_requests: int, prompt_len: int, output_len: int):
    """Prompts sharing a one-block prefix, greedy, each generating ``output_len`` tokens."""
    import random

    from vllm import SamplingParams

    rng = random.Random(0)
    prefix = [rng.randrange(2, 512) for _ in range(32)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(2, 512) for _ in range(prompt_len - 32)]} for _ in range(num_requests)]
    return prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def child(args) -> None:
    """One setting: start an engine, warm up, time the workload; one JSON line on stdout."""
    from vllm import LLM

    from torch_kvcanary.integrations import vllm as plugin

    llm = LLM(
        model=args.model_dir, dtype="bfloat16", max_model_len=1024, block_size=32, enforce_eager=True,
        distributed_executor_backend="uni", enable_prefix_caching=True, kv_cache_memory_bytes=256 << 20,
        gpu_memory_utilization=0.05, max_num_seqs=args.requests,
    )  # fmt: skip
    prompts, params = workload(args.requests, args.prompt_len, args.output_len)
    llm.generate(prompts[:2], params, use_tqdm=False)
    rates = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    state = plugin.active()
    stats = state.canary.stats() if state is not None else None
    print(json.dumps({"rates": rates, "violations": None if stats is None else stats["violations"]}))


def run_setting(model_dir: Path, setting: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env.update(SETTINGS[setting], VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=args.cpus)
    command = [sys.executable, __file__, "--child", "--model-dir", str(model_dir), "--repeats", str(args.repeats),
               "--requests", str(args.requests), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{setting} on {model_dir.name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--cpus", default="0",
        help="VLLM_CPU_OMP_THREADS_BIND: the cores vLLM's OpenMP threads run on (default one, so that load on "
        "the other cores of a shared machine slows the run in proportion instead of stalling every barrier)",
    )  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"{args.requests} requests of {args.prompt_len} prompt + {args.output_len} generated tokens, "
          f"median of {args.repeats} x {args.rounds} runs per setting; vLLM on cores {args.cpus} of {os.cpu_count()}")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            model_dir = make_llama(Path(scratch) / name, **MODELS[name])
            rates = {setting: [] for setting in SETTINGS}
            for _ in range(args.rounds):
                for setting in SETTINGS:
                    result = run_setting(model_dir, setting, args)
                    if result["violations"]:
                        sys.exit(f"{setting} on {name}: {result['violations']} violations on a clean run")
                    rates[setting] += result["rates"]
            base = statistics.median(rates["off"])
            for setting, values in rates.items():
                median = statistics.median(values)
                print(f"{name:6s} {setting:8s} {median:9.1f} tokens/s  {median / base:5.2f}x off  (runs {min(values):.1f} .. {max(values):.1f})")


if __name__ == "__main__":
    main()
