"""Random checkpoints made on the spot for the vLLM tests and benchmarks/vllm_bench.py (no hub
access needed): a transformers config class with random bf16 weights, and a byte-level BPE
tokenizer trained with the tokenizers library. One maker per model kind the vLLM plugin
watches: dense full attention (Llama), a sliding window (Mistral), full and sliding layers
in separate KV cache groups (Gemma 2), chunked-local and full layers (Llama 4), MLA
(DeepSeek V2) and M-RoPE (Qwen2-VL); and an EAGLE drafter for the Llama (`make_eagle`)."""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512

# The engine tests' model: CPU_ATTN needs a head size in {32, 64, 80, ...}.
TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
)

# Each kind's transformers config and model class, and its settings over `TINY`.
KINDS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # Every layer attends to the last `sliding_window` tokens: one SlidingWindowSpec group.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=48)),
    # Layer 0 slides, layer 1 attends to everything: two KV cache groups over one pool.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(sliding_window=48, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=64),
    ),
    # vLLM's CPU MLA kernels need kv_lora_rank 512 and qk_rope_head_dim 64; no MoE layer.
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            q_lora_rank=None,
            first_k_dense_replace=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            num_key_value_heads=4,
        ),
    ),
    # Layer 0 attends within chunks of 64 tokens (with RoPE), layer 1 to everything (NoPE):
    # a ChunkedLocalAttentionSpec and a FullAttentionSpec group over one pool; no MoE layer.
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(attention_chunk_size=64, no_rope_layers=[1, 0], interleave_moe_layer_step=3, intermediate_size_mlp=512, num_local_experts=2),
    ),
    # M-RoPE: vLLM's runner keeps [3, tokens] positions for the model beside the 1-D ones.
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", dict(head_dim=64)),
}


# Qwen2-VL's vision tokens, which its processor finds by name in the tokenizer.
QWEN2_VL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def _tokenizer(directory: Path, extra_special: tuple[str, ...] = ()) -> dict[str, int]:
    """Trains and saves the tokenizer; the ids of ``extra_special``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>", *extra_special], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([f"the quick brown fox jumps over the lazy dog {i}" for i in range(200)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(directory)
    return {token: tokenizer.token_to_id(token) for token in extra_special}


def make_model(directory: Path, kind: str = "llama", *, seed: int = 0, **config) -> Path:
    """Writes a random bf16 model of ``kind`` (a `KINDS` key; ``config`` overrides its
    settings) and its tokenizer to ``directory``."""
    import torch
    import transformers

    config_class, model_class, settings = KINDS[kind]
    settings = {**TINY, **settings, **config}
    directory.mkdir(parents=True, exist_ok=True)
    special = _tokenizer(directory, QWEN2_VL_TOKENS if kind == "qwen2_vl" else ())
    torch.manual_seed(seed)
    common = dict(bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    if kind == "qwen2_vl":
        config = _qwen2_vl_config(directory, settings, common, special)
    else:
        config = getattr(transformers, config_class)(max_position_embeddings=1024, **common, **settings)
    getattr(transformers, model_class)(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _qwen2_vl_config(directory: Path, text: dict, common: dict, tokens: dict[str, int]):
    """A Qwen2-VL config (M-RoPE over a head of 64: sections of 8, 12 and 12 frequencies)
    with a one-block vision tower, and its image processor beside the tokenizer."""
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessor

    rope = {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 10000.0}
    text = {**text, "max_position_embeddings": 1024, "rope_parameters": rope, **common}
    vision = dict(depth=1, embed_dim=64, hidden_size=text["hidden_size"], num_heads=2)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    special = {name: tokens[token] for name, token in zip(names, QWEN2_VL_TOKENS)}
    Qwen2VLImageProcessor().save_pretrained(directory)
    return Qwen2VLConfig(text_config=text, vision_config=vision, **special, **common)


def make_llama(directory: Path, *, seed: int = 0, **config) -> Path:
    """Writes a random bf16 Llama (``config`` overrides `TINY`) and its tokenizer to ``directory``."""
    return make_model(directory, "llama", seed=seed, **config)


def make_eagle(directory: Path, *, seed: int = 0) -> Path:
    """Writes a random bf16 EAGLE drafter for `make_llama`'s models to ``directory``, as
    vLLM's ``EagleLlamaForCausalLM`` loads one: one decoder layer without its input norm,
    the ``fc`` that joins a token's embedding with the target's hidden state, no final norm
    and no LM head (the target's is shared)."""
    import json

    import safetensors.torch
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1}, bos_token_id=0, eos_token_id=1, max_position_embeddings=1024)
    layer = transformers.LlamaForCausalLM(config).to(torch.bfloat16).state_dict()
    dropped = ("lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight")
    weights = {name.removeprefix("model."): value.contiguous() for name, value in layer.items() if name not in dropped}
    hidden = TINY["hidden_size"]
    weights["fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.02).to(torch.bfloat16)
    safetensors.torch.save_file(weights, directory / "model.safetensors")
    settings = {**config.to_dict(), "architectures": ["EagleLlamaForCausalLM"], "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(settings))
    return directory
