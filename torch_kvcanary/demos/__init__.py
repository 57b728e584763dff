"""The demos behind `python -m torch_kvcanary demo`: `paged_cache` (the canary catching bugs in
a paged KV cache) and `transfer` (`--transfer`: the transfer digests between processes)."""
