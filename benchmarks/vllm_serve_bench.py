"""What the vLLM plugin costs through the server: `vllm bench serve` against `vllm serve`
(vLLM's default multiprocess engine, the OpenAI API on 127.0.0.1) with the plugin off, in
PARTIAL and in ALL, on a random Llama made on the spot (`torch_kvcanary.testing.random_models`).

    .venv-vllm/bin/python -m benchmarks.vllm_serve_bench [--model tiny] [--rounds 3]

The three servers run side by side (one per setting, each on its own port; off is a server
without `KVCANARY_VLLM`, so the plugin never attaches), and each round benchmarks them in
turns with the same workload: vLLM's random dataset, 128 input and 64 output tokens, 64
prompts at concurrency 8 (`--ignore-eos`). Printed: each setting's output tokens/s per round,
the median, and the median of its per-round ratio to off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from benchmarks.vllm_bench import MODELS
from torch_kvcanary.testing.random_models import make_llama
from torch_kvcanary.testing.serve import VLLM_CLI, Server

SETTINGS = {
    "off": {},
    "partial": dict(KVCANARY_VLLM="log", KVCANARY_VLLM_MODE="partial"),
    "all": dict(KVCANARY_VLLM="log", KVCANARY_VLLM_MODE="all"),
}

# The servers' options: a KV cache large enough that no request waits for blocks, and vLLM's
# default token budget per step.
BENCH_SERVE_OPTIONS = (
    "--max-model-len", "512", "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20),
    "--max-num-seqs", "8", "--dtype", "bfloat16",
)  # fmt: skip


def bench_serve(server: Server, args: argparse.Namespace, result_dir: Path, name: str) -> float:
    """One `vllm bench serve` run against ``server``: its output tokens per second."""
    command = [
        sys.executable, str(VLLM_CLI), "bench", "serve",
        "--base-url", server.url, "--model", str(server.model), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos",
        "--seed", "0", "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json",
    ]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}")
    return json.loads((result_dir / f"{name}.json").read_text())["output_throughput"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as servers:
        scratch = Path(scratch)
        model = make_llama(scratch / args.model, **MODELS[args.model])
        running = {name: servers.enter_context(Server(model, env, BENCH_SERVE_OPTIONS)) for name, env in SETTINGS.items()}
        runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for round_index in range(args.rounds):
            for name, server in running.items():
                runs[name].append(bench_serve(server, args, scratch, f"{name}-{round_index}"))
            print(f"round {round_index}: " + ", ".join(f"{name} {r[-1]:.1f} tok/s" for name, r in runs.items()), flush=True)
    print(
        f"model {args.model}: vllm bench serve, random {args.input_len}+{args.output_len} tokens, {args.num_prompts} prompts at concurrency {args.concurrency}"
    )
    for name, rates in runs.items():
        ratios = [rate / off for rate, off in zip(rates, runs["off"])]
        print(
            f"{name:8} median {statistics.median(rates):8.1f} output tok/s, x{statistics.median(ratios):.2f} of off "
            f"(runs {', '.join(f'{r:.1f}' for r in rates)})"
        )


if __name__ == "__main__":
    main()
