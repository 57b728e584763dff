"""The chaos soaks of `vllm serve` (tools/vllm_chaos.py, tools/vllm_chaos_pd.py, docs/chaos.md):
faults injected into live KV by a vLLM plugin of this package's own, and checks that the
canary named each one and that the policy did what it promises.

- `harness`: what both soaks share: the workload, a pass of requests (`run_pass`), the
  result and its report, the log's patterns, the injector's installation.
- `chaos`: a single server under ``repair`` or ``quarantine``, and its checks, each a function.
- `table_fault`: a block-table entry pointed at another request's block, and its checks.
- `chaos_pd`: a prefill/decode pair, faults on either side, and its checks.
- `unverified`: misconfigured pairs (a router dropping the canary's key, two fold modes).
- `memory`: the memory soak of `vllm serve` (tools/vllm_serve.py): passes of mixed requests,
  the engine's growth with the canary off, then on.
- `faults`: the injector itself, the source of a vLLM general plugin (read as text, never imported).
"""
