"""LoRA adapters built on the spot for a model on disk (`make_lora`), in PEFT's format as vLLM
loads one (``adapter_config.json`` beside ``adapter_model.safetensors``): random A and B
matrices on the attention projections, so that an adapter changes the K and V a forward
writes to the KV cache, and two adapters of different seeds write different KV for the
same tokens. No hub access, no PEFT install: the files are written with safetensors."""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj")
"""The projections an adapter adapts by default: the query and the two that write the KV."""
KV_PROJECTIONS = ("k_proj", "v_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each attention projection of a Llama-like ``config``."""
    missing = [key for key in ("hidden_size", "num_attention_heads", "num_hidden_layers") if key not in config]
    if missing:
        raise ValueError(f"kv-canary: the model's config.json lacks {', '.join(missing)}: give make_lora a Llama-like decoder's directory")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }


def make_lora(directory: Path, model: Path, *, seed: int, rank: int = 8, targets: tuple[str, ...] = TARGETS, scale: float = 0.1) -> Path:
    """Writes a random LoRA adapter of ``rank`` for the model in ``model`` (a directory with
    a Llama-like ``config.json``) to ``directory``: for each layer and each projection of
    ``targets`` (which must include ``k_proj`` and ``v_proj``), A and B drawn from a normal
    of standard deviation ``scale`` with ``seed``, B non-zero (PEFT initialises B to zero,
    which would leave the model unchanged). ``lora_alpha`` equals ``rank``, so each
    projection's weight moves by ``B @ A``. Returns ``directory``, the path vLLM's
    ``LoRARequest`` takes."""
    import safetensors.torch
    import torch

    if rank <= 0:
        raise ValueError(f"kv-canary: a LoRA adapter's rank must be a positive int, got {rank!r}")
    config = json.loads((Path(model) / "config.json").read_text())
    shapes = _shapes(config)
    unknown = [name for name in targets if name not in shapes]
    if unknown or not set(KV_PROJECTIONS) <= set(targets):
        raise ValueError(
            f"kv-canary: make_lora's targets must include {', '.join(KV_PROJECTIONS)} (the adapter is to change the KV) "
            f"and name projections among {', '.join(shapes)}, got {list(targets)}"
        )
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            features_in, features_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, features_in, generator=generator) * scale
            weights[f"{prefix}.lora_B.weight"] = torch.randn(features_out, rank, generator=generator) * scale
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({name: value.contiguous() for name, value in weights.items()}, directory / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets), "bias": "none", "lora_dropout": 0.0}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory
