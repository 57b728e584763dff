"""What the vLLM plugin costs: generated tokens per second with the plugin off, in PARTIAL
and in ALL, on random Llamas made on the spot (`torch_kvcanary.testing.random_models`).

    .venv-vllm/bin/python -m benchmarks.vllm_bench [--models tiny small] [--rounds 5]

One engine per model (in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, started with the
plugin on) serves the same workload in turns: with no canary (off: the plugin's hooks only
check that none is attached), with a PARTIAL canary and with an ALL canary, each built over
the engine's KV cache as the plugin builds it. The prefix cache is reset before each run, so
every run starts from an empty cache. Printed: the median tokens/s of each setting over
``--rounds`` turns, the median of its per-round ratio to off, and the range of its runs.

    .venv-vllm/bin/python -m benchmarks.vllm_bench --models tiny --step-time [--prompt-lens 200 2000]

``--step-time`` measures instead what the plugin costs per engine step as the context grows:
for each prompt length, ``--requests`` prompts of that length generate ``--output-len``
tokens under an ALL canary (``KVCANARY_VLLM_MODE`` to change it). Printed, as medians over
the steps: the plugin's time per step (its work before and after the forward, the canary's
kernel included: on vLLM's CPU build the device is the CPU), and its host work per step:
that time less its canary op's, the Python and NumPy work around it, what the host does per
step where a GPU runs the op asynchronously; and how the first splits into its parts
(`PHASES`).
Each length runs ``--rounds`` times in turns, and the least of
the runs' medians is printed (on a shared machine other work inflates some runs).
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

# The checkout itself, last (after the installed package), for the engine children this
# file runs as a script.
REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))
from torch_kvcanary.testing.random_models import TINY, make_llama  # noqa: E402

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
    # Many thin layers: each layer's forward is cheap, so the canary's host work per step,
    # which must not grow with the layers, weighs as it does beside a GPU's forward.
    "deep": dict(TINY, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=48),
}
SETTINGS = ("off", "partial", "all")


def workload(num_requests: int, prompt_len: int, output_len: int, *, cache_salts: bool = False):
    """Prompts sharing a one-block prefix, greedy, each generating ``output_len`` tokens;
    with ``cache_salts`` each under a cache salt of its own (an identity each request's
    records are rooted in, derived once per request)."""
    import random

    from vllm import SamplingParams

    rng = random.Random(0)
    prefix = [rng.randrange(2, 512) for _ in range(32)]
    prompts = [{"prompt_token_ids": prefix + [rng.randrange(2, 512) for _ in range(prompt_len - 32)]} for _ in range(num_requests)]
    if cache_salts:
        for number, prompt in enumerate(prompts):
            prompt["cache_salt"] = f"tenant-{number}"
    return prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def child(args) -> None:
    """One model: start an engine, warm up, then the settings in turns; one JSON line on stdout."""
    from vllm import LLM

    from torch_kvcanary import HashMode
    from torch_kvcanary.integrations.vllm import adapter, config, plugin, worker

    llm = LLM(
        model=args.model_dir, dtype="bfloat16", max_model_len=1024, block_size=32, enforce_eager=True,
        distributed_executor_backend="uni", enable_prefix_caching=True, kv_cache_memory_bytes=256 << 20,
        gpu_memory_utilization=0.05, max_num_seqs=args.requests,
    )  # fmt: skip
    runner = plugin.active().model_runner
    canaries = {
        "off": None,
        "partial": worker.WorkerCanary(runner, config.Settings("log", HashMode.PARTIAL, every=args.every)),
        "all": worker.WorkerCanary(runner, config.Settings("log", HashMode.ALL, every=args.every)),
    }
    prompts, params = workload(args.requests, args.prompt_len, args.output_len, cache_salts=args.cache_salts)
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


def step_time_child(args) -> None:
    """One model: per prompt length, the plugin's time per step and its host work per step
    (its time less that of its canary op), medians over the steps, in microseconds; one JSON
    line on stdout."""
    from vllm import LLM

    from torch_kvcanary.integrations.vllm import plugin

    longest = max(args.prompt_lens) + args.output_len
    llm = LLM(
        model=args.model_dir, dtype="bfloat16", max_model_len=longest, block_size=32, enforce_eager=True,
        distributed_executor_backend="uni", enable_prefix_caching=True, kv_cache_memory_bytes=512 << 20,
        gpu_memory_utilization=0.05, max_num_seqs=args.requests, max_num_batched_tokens=max(2048, longest),
    )  # fmt: skip
    watcher = plugin.active()
    begin_step, end_step = watcher.begin_step, watcher.end_step
    seconds: list[float] = []
    phases: list[dict[str, float]] = []  # per step, the seconds of each of `PHASES`
    _time_phases(watcher, phases)

    def timed(method, first: bool):
        def call(arg):
            if first:
                phases.append(dict.fromkeys(PHASES, 0.0))
            start = time.perf_counter()
            try:
                return method(arg)
            finally:
                elapsed = time.perf_counter() - start
                seconds.append(elapsed) if first else seconds.__setitem__(-1, seconds[-1] + elapsed)

        return call

    watcher.begin_step, watcher.end_step = timed(begin_step, True), timed(end_step, False)

    def run(prompt_len: int) -> None:
        llm.reset_prefix_cache()
        seconds.clear()
        phases.clear()
        llm.generate(*workload(args.requests, prompt_len, args.output_len), use_tqdm=False)

    # Each run's medians; a shared machine disturbs some runs, so the least of them is kept.
    runs: dict[int, list[tuple[float, float, int, dict[str, float]]]] = {prompt_len: [] for prompt_len in args.prompt_lens}
    run(args.prompt_lens[0])  # warms up
    for _ in range(args.rounds):
        for prompt_len in args.prompt_lens:
            run(prompt_len)
            wall = statistics.median(seconds) * 1e6
            host = statistics.median(total - step["step op"] for total, step in zip(seconds, phases)) * 1e6
            medians = {name: statistics.median(step[name] for step in phases) * 1e6 for name in PHASES}
            runs[prompt_len].append((wall, host, len(seconds), medians))
    result = {
        n: [min(w for w, _, _, _ in found), min(h for _, h, _, _ in found), found[0][2], min(found, key=lambda run: run[0])[3]]
        for n, found in runs.items()
    }
    print(json.dumps({"steps": result, "violations": watcher.canary.stats()["violations"]}))


# The parts of the plugin's step that --step-time times apart (calls that never nest): the
# step's rows, written on the host; the canary's op (`kvcanary::paged_step`, its dispatch and
# kernel), its calls before and after the forward; reading the violations (only when there
# are some).
PHASES = ("rows", "step op", "poll")


def _time_phases(watcher, phases: list[dict[str, float]]) -> None:
    """Wraps the calls of `PHASES` so that each adds its seconds to the current step's entry of ``phases``."""

    def timed(call, name: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                phases[-1][name] += time.perf_counter() - start

        return wrapper

    watcher._rows.fill = timed(watcher._rows.fill, "rows")
    watcher._paged._op = timed(watcher._paged._op, "step op")
    watcher.canary.poll = timed(watcher.canary.poll, "poll")


def run_step_time(model_dir: Path, args) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env.update(KVCANARY_VLLM="log", KVCANARY_VLLM_MODE=os.environ.get("KVCANARY_VLLM_MODE", "all"))
    # The random models hold 1,024 positions; RoPE runs past them (the tokens are random anyway).
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=args.cpus, VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    command = [sys.executable, __file__, "--child", "--step-time", "--model-dir", str(model_dir), "--requests", str(args.requests), "--rounds", str(args.rounds),
               "--output-len", str(args.output_len), "--prompt-lens", *map(str, args.prompt_lens)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{model_dir.name} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["violations"]:
        sys.exit(f"{model_dir.name}: violations on a clean run: {result['violations']}")
    for prompt_len, (total, host, steps, phases) in result["steps"].items():
        print(f"{model_dir.name:6s} prompts of {prompt_len:>5s} tokens: plugin {total:8.1f} us/step, "
              f"host work {host:7.1f} us/step (medians over {steps} steps, least of {args.rounds} runs)")  # fmt: skip
        print(
            f"{'':6s} its parts (medians per step, of the fastest run): " + ", ".join(f"{name} {us:.0f} us" for name, us in phases.items())
        )


def run_model(model_dir: Path, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env.update(KVCANARY_VLLM="log", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=args.cpus)
    command = [sys.executable, __file__, "--child", "--model-dir", str(model_dir), "--rounds", str(args.rounds),
               "--requests", str(args.requests), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
               "--every", str(args.every)] + (["--cache-salts"] if args.cache_salts else [])  # fmt: skip
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
    parser.add_argument("--every", type=int, default=1, help="the canaries' KVCANARY_VLLM_EVERY (sampled verification)")
    parser.add_argument(
        "--cache-salts",
        action="store_true",
        help="each request under a cache salt of its own (the cost of deriving and rooting identities)",
    )
    parser.add_argument("--step-time", action="store_true", help="the plugin's time per step as the context grows (see above)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[200, 2000], help="--step-time's prompt lengths")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        step_time_child(args) if args.step_time else child(args)
        return
    if args.step_time:
        print(
            f"{args.requests} requests generating {args.output_len} tokens after prompts of {args.prompt_lens} tokens; vLLM on cores {args.cpus}"
        )
        with tempfile.TemporaryDirectory() as scratch:
            for name in args.models:
                run_step_time(make_llama(Path(scratch) / name, **MODELS[name]), args)
        return
    print(f"{args.requests} requests of {args.prompt_len} prompt + {args.output_len} generated tokens, "
          f"{args.rounds} rounds of off/partial/all (every {args.every}{', each request salted' if args.cache_salts else ''}); vLLM on cores {args.cpus} of {os.cpu_count()}")  # fmt: skip
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
