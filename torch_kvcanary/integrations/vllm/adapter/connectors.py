"""vLLM's KV connector internals the plugin reads: its connector factory's registry, the
privates of ``ExampleConnector`` that a verified disk transfer reads
(`connector.disk.DiskVerifier`), what a connector's worker side knows of its place among the
tensor-parallel ranks and the model's KV heads, how a request ended, and what the NIXL
transport reads of vLLM's scheduler (`connector.nixl`; NixlConnector's and NIXL's own internals are `nixl`'s)."""

from __future__ import annotations


def register_connector(name: str, module: str, class_name: str) -> None:
    """Makes ``name`` a KV connector vLLM's ``kv_transfer_config`` can name (class
    ``class_name`` of ``module``, imported when vLLM builds it); nothing when registered already."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, class_name)


def example_connector_requests(connector) -> list:
    """The requests of vLLM's ``ExampleConnector`` ``connector`` in this step (its
    metadata's ``requests``: ``is_store``, ``token_ids``, ``mm_hashes``, ``slot_mapping``);
    none while it holds no metadata."""
    if not connector.has_connector_metadata():
        return []
    return list(connector._get_connector_metadata().requests)


def example_connector_folder(connector, request) -> str:
    """The folder vLLM's ``ExampleConnector`` ``connector`` keeps ``request``'s files in
    (named by the hash of its tokens), created if missing."""
    return connector._generate_foldername_debug(request.token_ids, request.mm_hashes, create_folder=True)


def tensor_parallel_rank() -> int:
    """This worker's rank among its tensor-parallel ranks (vLLM builds a worker's KV
    connector once its process groups exist)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().rank_in_group


def total_kv_heads(vllm_config) -> int:
    """The model's KV heads over all ranks; MLA's latent counts as one (every rank holds it)."""
    model_config = vllm_config.model_config
    return 1 if model_config.use_mla else model_config.get_total_num_kv_heads()


def locally_cached_blocks(blocks) -> int:
    """How many of the first KV cache group's blocks of vLLM's ``KVCacheBlocks`` ``blocks``
    (a request's, as the scheduler allocated them) hold a local prefix-cache hit: those
    with a block hash, other than the null block."""
    return sum(block.block_hash is not None and not block.is_null for block in blocks.blocks[0])


def ended_with_error(request) -> bool:
    """Whether vLLM's scheduler ended ``request`` (a ``vllm.v1.request.Request``) with an error."""
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.FINISHED_ERROR
