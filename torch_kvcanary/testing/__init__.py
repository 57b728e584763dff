"""Test support for torch_kvcanary: what the tests, the command-line programs under tools/ and
the benchmarks share (as torchao's torchao/testing/), one home for each helper, by public names.

- `fake_runner`: a double of vLLM's model runner (`FakeRunner` over `StepBuffers`), which
  drives the plugin's step code without vLLM.
- `random_models`: small random checkpoints of each model kind the plugin watches, made on
  the spot for a vLLM engine or server to load.
- `lora`: LoRA adapters built on the spot for such a model.
- `vllm_cli`: vLLM's command line on vLLM's CPU build, as a script `serve.Server` runs.
- `serve`: `vllm serve` in a child process (`Server`, free ports, its process group killed),
  its requests and plugins of the tests' own.
- `pd`, `pd_proxy`: a prefill/decode pair of servers through NIXL, and the proxy between them.
- `metrics_capture`: the server and fault whose /metrics the Prometheus rules are tested on.
- `soak`: the chaos soaks of a server and of a pair, their fault injector and their checks,
  each a function; the memory soak of a server.

Importing this package imports nothing else: vLLM, transformers and NIXL are imported inside
the functions that need them, so ``import torch_kvcanary`` and the wheel's tests run under
plain torch.
"""
