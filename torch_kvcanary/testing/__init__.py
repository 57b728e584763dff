"""Test support for torch_kvcanary: what the tests, the command-line tools under tools/ and
the benchmarks share (as torchao's torchao/testing/), one home for each helper.

Public names live in submodules, each imported by what needs it:

- ``fake_runner``: a stand-in for vLLM's model runner, driving the plugin's worker without a model.
- ``random_models``: small randomly initialised models written to disk for a vLLM server to load.
- ``serve``: a vLLM server in a child process (free ports, start, wait, stop its process group).
- ``pd``: a prefill/decode pair of servers joined by the NIXL connector, and its proxy.
- ``soak``: the soak harness and its checks, each a named function.
- ``lora``: LoRA adapters built on the spot.

Importing this package imports nothing else: vLLM and transformers are imported inside the
submodules that need them, so ``import torch_kvcanary`` and the wheel's tests run under plain torch.
"""
