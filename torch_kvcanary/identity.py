"""A request's identity in its canary records (docs/spec.md, section 8, "Identity").

What covers the whole request (a LoRA adapter, a cache salt) makes the request's **root**,
the value its first position chains from (`request_root`, passed to record and verify as
``roots``); what covers some tokens (a multimodal item at its placeholder positions, a
prompt-embeds position) makes **words**, recorded in the token field of those positions
(`item_word`, `embedding_word`), so the chain of every later position depends on them and a
text prefix before them stays shared. A request with no identity keeps the anchor: its
records are SGLang's, bit for bit.

Every function is computed once per request (or once per adapter load), on the host, from
plain values and CPU copies of tensors; nothing here runs per step.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping
from typing import NamedTuple

import torch

_MASK64 = (1 << 64) - 1
# Words recorded in the token field have the top bit clear: they are never -1 (a token not
# given), and read as non-negative token values by every consumer of a record.
WORD_MASK = (1 << 63) - 1
ANCHOR = 0xDE7FAE23A9A1B716 - (1 << 64)  # splitmix64(0xC0FFEE1234567890) as int64, SGLang's anchor

# The field tags of docs/spec.md: each value mixed into a root or a word is keyed by one. Tag 1
# is retired: a tag never means two things across versions, so a new field takes one above 6.
TAG_LORA_NAME = 2
TAG_LORA_WEIGHTS = 3
TAG_CACHE_SALT = 4
TAG_ITEM = 5
TAG_EMBEDDING = 6

_HASH_CHUNK = 1 << 24  # bytes of a tensor handed to the hash at a time


def _splitmix64(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix3(a: int, b: int, c: int) -> int:
    return _splitmix64(_splitmix64(_splitmix64(a & _MASK64) ^ (b & _MASK64)) ^ (c & _MASK64))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def _check_int(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"kv-canary: {name} must be an int, got {type(value).__name__}")
    if not low <= value < high:
        raise ValueError(f"kv-canary: {name} must be in [{low}, {high}), got {value}")
    return value


def _check_str(value, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"kv-canary: {name} must be a str, got {type(value).__name__}")
    return value


def _utf8(text: str) -> bytes:
    """``text``'s UTF-8 bytes, a lone surrogate (a Python str can hold one, a client can send
    one) in the three-byte form of its code point (``surrogatepass``): any str has bytes,
    and two strs have the same bytes only where they are equal."""
    return text.encode("utf-8", "surrogatepass")


def _field(data: bytes) -> bytes:
    """``data`` preceded by its length (8 bytes, little-endian): fields never run together."""
    return len(data).to_bytes(8, "little") + data


def _digest_word(hasher) -> int:
    return _signed(int.from_bytes(hasher.digest(), "little"))


def _hash_tensor(hasher, tensor: torch.Tensor) -> None:
    """Feed ``tensor``'s record to ``hasher``: field(dtype name), ndim and each size (8 bytes
    each, little-endian), then field(its bytes in logical row-major order), read from a
    contiguous CPU copy."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"kv-canary: expected a torch.Tensor, got {type(tensor).__name__}")
    flat = tensor.detach().to("cpu").reshape(-1).clone()  # its own storage, exactly its bytes
    nbytes = flat.numel() * flat.element_size()
    hasher.update(_field(str(flat.dtype).removeprefix("torch.").encode()))
    hasher.update(b"".join(n.to_bytes(8, "little") for n in (tensor.dim(), *tensor.shape)))
    hasher.update(nbytes.to_bytes(8, "little"))
    for start in range(0, nbytes, _HASH_CHUNK):
        hasher.update(ctypes.string_at(flat.data_ptr() + start, min(_HASH_CHUNK, nbytes - start)))


def text_word(text: str) -> int:
    """The word of a text (an adapter's name, a cache salt, an mm_hash): the first 8 bytes,
    little-endian, of blake2b(digest_size=8) of its UTF-8 bytes (`_utf8`), as int64."""
    return _digest_word(hashlib.blake2b(_utf8(_check_str(text, "text")), digest_size=8))


def tensor_word(tensor: torch.Tensor) -> int:
    """blake2b(digest_size=8) of ``tensor``'s record (its dtype, shape and bytes), as int64."""
    hasher = hashlib.blake2b(digest_size=8)
    _hash_tensor(hasher, tensor)
    return _digest_word(hasher)


def lora_weights_word(tensors: Mapping[str, torch.Tensor]) -> int:
    """The word of an adapter's weights as loaded: blake2b(digest_size=8) over, for each
    tensor in ascending order of name, field(its UTF-8 name) then its record (dtype, shape,
    bytes), as int64. Any dtype and device (bfloat16 included); read from CPU copies."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"kv-canary: lora_weights_word takes a mapping of name -> tensor, got {type(tensors).__name__}")
    hasher = hashlib.blake2b(digest_size=8)
    for name in sorted(_check_str(n, "a LoRA weight's name") for n in tensors):
        hasher.update(_field(_utf8(name)))
        _hash_tensor(hasher, tensors[name])
    return _digest_word(hasher)


class LoraIdentity(NamedTuple):
    """A LoRA adapter as loaded: its name and the word of its weights (`lora_weights_word`).
    Not the int id an engine numbers it by: each server numbers its adapters in its own
    order, and the same files loaded anywhere, in any order, are the same identity; an
    in-place reload with other weights is another."""

    name: str
    weights_word: int


def request_root(*, lora: LoraIdentity | None = None, cache_salt: str | None = None) -> int:
    """The root of a request's chain (int64): `ANCHOR` when it has no identity, else
    ``h = ANCHOR``, then ``h = mix3(h, tag, word)`` for the adapter's name and weights and
    for the cache salt, in that order, each where given. An empty salt is no salt, as in
    vLLM's block hashes."""
    h = ANCHOR & _MASK64
    if lora is not None:
        if not isinstance(lora, LoraIdentity):
            raise TypeError(f"kv-canary: lora must be a LoraIdentity or None, got {type(lora).__name__}")
        h = _mix3(h, TAG_LORA_NAME, text_word(lora.name))
        h = _mix3(h, TAG_LORA_WEIGHTS, _check_int(lora.weights_word, "the LoRA weights word", -(1 << 63), 1 << 63))
    if cache_salt is not None and _check_str(cache_salt, "cache_salt"):
        h = _mix3(h, TAG_CACHE_SALT, text_word(cache_salt))
    return _signed(h)


def multimodal_item_word(mm_hash: str) -> int:
    """The identity of a multimodal item from vLLM's ``mm_hash`` string: its `text_word`,
    the ``item`` that `item_word` takes."""
    return text_word(_check_str(mm_hash, "mm_hash"))


def item_word(item: int, offset: int) -> int:
    """The token-field value of the position at ``offset`` (0 at its first placeholder)
    within an item whose identity is ``item`` (int64): ``mix3(TAG_ITEM, item, offset)``
    with the top bit cleared."""
    _check_int(item, "item", -(1 << 63), 1 << 63)
    _check_int(offset, "offset", 0, 1 << 63)
    return _mix3(TAG_ITEM, item, offset) & WORD_MASK


def embedding_word(row: torch.Tensor) -> int:
    """The token-field value of a position given as an embedding (``prompt_embeds``): ``row``
    is that position's embedding, any dtype; ``mix3(TAG_EMBEDDING, tensor_word(row), 0)``
    with the top bit cleared."""
    return _mix3(TAG_EMBEDDING, tensor_word(row), 0) & WORD_MASK
