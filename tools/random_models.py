"""Random Llama checkpoints made on the spot for the vLLM tests and tools/vllm_bench.py (no hub
access needed): transformers' LlamaConfig with random weights, and a byte-level BPE tokenizer
trained with the tokenizers library."""

from __future__ import annotations

from pathlib import Path

# The engine tests' model: CPU_ATTN needs a head size in {32, 64, 80, ...}.
TINY = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2
)


def make_llama(directory: Path, *, seed: int = 0, **config) -> Path:
    """Writes a random bf16 Llama (``config`` overrides `TINY`) and its tokenizer to ``directory``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    settings = {**TINY, **config}
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=settings["vocab_size"], special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([f"the quick brown fox jumps over the lazy dog {i}" for i in range(200)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16", **settings)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory
