"""Benchmarks of torch_kvcanary, run from a checkout: `python -m benchmarks.bench`
(the fold, the canary and the digest beside their baselines) and `python -m
benchmarks.vllm_bench` (the vLLM plugin's cost). Not part of the installed package."""
