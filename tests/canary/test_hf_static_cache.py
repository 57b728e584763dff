"""A real client: a tiny randomly initialised Llama generating with a Hugging Face
StaticCache, fingerprinted after every step (needs the `hf` extra: transformers)."""

import pytest
import torch

import torch_kvcanary as kc
from torch_kvcanary import layouts

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

MAX_LEN = 32
PROMPT = 6
NEW_TOKENS = 12
# generate() takes the cache as `cache` in recent transformers (5.24), as `past_key_values` in
# older ones (5.17).
CACHE_KWARG = "cache" if "cache" in getattr(transformers.generation.utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


class CanaryProcessor(transformers.LogitsProcessor):
    """Called after each forward: the cache then holds positions 0..len-1. Verifies every
    earlier position of every batch row, then records the one just written."""

    def __init__(self, cache):
        self.cache = cache
        self.canary = None
        self.alarms = []
        self.steps = 0

    def _slots(self, batch, positions):
        rows = torch.arange(batch).unsqueeze(1)
        return layouts.hf_static_cache_slots(rows, positions.unsqueeze(0), MAX_LEN).flatten()

    def __call__(self, input_ids, scores):
        batch, length = input_ids.shape
        if self.canary is None:  # the cache's tensors exist from the first forward on
            sources = [s for layer in self.cache.layers for s in layouts.hf_static_cache(layer.keys, layer.values)]
            self.canary = kc.KvCanary(sources)
            self.canary.record(self._slots(batch, torch.arange(length)))
        else:
            earlier = self._slots(batch, torch.arange(length - 1))
            self.alarms += self.canary.violations(earlier)
            self.canary.record(self._slots(batch, torch.tensor([length - 1])))
        self.steps += 1
        return scores


@pytest.fixture(scope="module")
def generation():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    cache = transformers.StaticCache(config=config, max_cache_len=MAX_LEN)
    processor = CanaryProcessor(cache)
    prompt = torch.randint(0, 96, (2, PROMPT))
    with torch.no_grad():
        output = model.generate(
            prompt,
            **{CACHE_KWARG: cache},
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            logits_processor=[processor],
            pad_token_id=0,
        )
    return cache, processor, output


def test_no_false_alarm_over_a_generation(generation):
    _, processor, output = generation
    assert output.shape == (2, PROMPT + NEW_TOKENS)
    assert processor.steps == NEW_TOKENS and processor.alarms == []


def test_one_corrupted_position_is_flagged(generation):
    cache, processor, _ = generation
    written = processor._slots(2, torch.arange(PROMPT + NEW_TOKENS - 1))
    assert processor.canary.violations(written) == []
    values = cache.layers[1].values  # [batch, kv_heads, max_len, head_dim]
    values[1, 0, 7, 3] += 1.0
    assert processor.canary.violations(written) == [1 * MAX_LEN + 7]
