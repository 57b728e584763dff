"""vLLM's KV connector internals the plugin reads: its connector factory's registry, and
the privates of ``ExampleConnector`` that a verified disk transfer reads
(`connector.transfer.DiskTransfer`)."""

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
