"""What the NIXL transport (`connector.nixl`) reads of vLLM's ``NixlConnector`` and of NIXL:
the keys of the ``kv_transfer_params`` NixlConnector hands between the prefill and the decode
side, how one more layer joins the ones its worker registers
with NIXL, and the delay of NIXL's progress thread."""

from __future__ import annotations

import dataclasses
import logging

from .common import LOGGER

logger = logging.getLogger(LOGGER)


def hands_over(params: dict) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this (prefill) side to hand its KV to a decode side."""
    return bool(params.get("do_remote_decode"))


def loads_remotely(params: dict) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this (decode) side to read its prompt's
    KV from a prefill side (NixlConnector clears it once the blocks are allocated), or, in the
    params P hands on, that the decode side will."""
    return bool(params.get("do_remote_prefill"))


def transfer_geometry(nixl_connector) -> tuple[int, int, int]:
    """(blocks, KV heads of this rank, slots of a kernel block) of the caches a worker's
    ``NixlConnector`` moves: NIXL moves kernel blocks, which may be smaller than vLLM's."""
    worker = _nixl_worker(nixl_connector)
    spec = _transfer_spec(worker)
    return worker.kv_cache_config.num_blocks, spec.num_heads, worker.block_size


def add_transfer_layer(nixl_connector, name: str, cell_bytes: int, page_bytes: int) -> None:
    """Makes the worker of ``nixl_connector`` (built, its caches not yet registered) move a
    layer ``name`` of its own with the model's KV: the worker registers with NIXL only the
    layers its KV cache config names, each with the spec it derives from that config, and
    reads each layer's blocks and each rank's share of its heads by that spec. The layer
    joins the first transferable group (its block ids are the request's blocks) under a
    spec of the group's kind (full attention or MLA, which decides whether NIXL splits its
    heads between ranks) whose cell of a head and slot is ``cell_bytes``; its page (one
    block) must be ``page_bytes``. The worker gets a copy of the config; the engine's is
    left as it was. Call it on both sides of a transfer, with the same name."""
    worker = _nixl_worker(nixl_connector)
    config = worker.kv_cache_config
    group_index = config.transfer_group_ids[0]
    group = config.kv_cache_groups[group_index]
    spec = dataclasses.replace(_transfer_spec(worker), state_content_bytes=cell_bytes, page_size_padded=None)
    if spec.page_size_bytes != page_bytes:
        raise ValueError(
            f"kv-canary: NixlConnector would move pages of {spec.page_size_bytes} bytes of the canary's layer, not its "
            f"{page_bytes}: serve NixlConnector without KvCanaryConnector"
        )
    groups = list(config.kv_cache_groups)
    groups[group_index] = dataclasses.replace(group, layer_names=[*group.layer_names, name])
    worker.kv_cache_config = dataclasses.replace(config, kv_cache_groups=groups)
    worker._layer_specs[name] = spec


def _nixl_worker(nixl_connector):
    worker = getattr(nixl_connector, "connector_worker", None)
    if worker is None or not isinstance(getattr(worker, "_layer_specs", None), dict):
        raise ValueError(
            f"kv-canary: this vLLM's NixlConnector ({type(nixl_connector).__name__}) keeps no worker with per-layer specs "
            "(connector_worker._layer_specs, vLLM 0.32), which the canary's records ride with: serve vLLM 0.32, or "
            "NixlConnector without KvCanaryConnector"
        )
    return worker


def _transfer_spec(worker):
    """The spec of the first layer of the worker's first transferable group."""
    config = worker.kv_cache_config
    group = config.kv_cache_groups[config.transfer_group_ids[0]]
    return worker._layer_specs[group.layer_names[0]]


def delay_progress_thread(delay_us: int) -> None:
    """Makes NIXL's agents created from here on in this process wait ``delay_us``
    microseconds between the polls of their progress thread. NIXL's Python layer (1.5)
    sets the delay to 0, so that each agent's progress thread polls UCX without pause and
    takes a core even while idle, which stalls a host with few cores; vLLM exposes no
    setting for it. The agent's config class is replaced by one whose ``pthrDelay`` is at
    least ``delay_us``."""
    import nixl._api as api  # noqa: PLC0415 (NIXL is imported only where it is configured)

    bind = api.nixlBind
    base = getattr(bind.nixlAgentConfig, "kv_canary_base", bind.nixlAgentConfig)

    class AgentConfig(base):
        kv_canary_base = base

        @property
        def pthrDelay(self):  # noqa: N802 (NIXL's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), delay_us))

    bind.nixlAgentConfig = AgentConfig
    logger.info("kv-canary: NIXL's progress thread waits %d us between polls in this process", delay_us)
