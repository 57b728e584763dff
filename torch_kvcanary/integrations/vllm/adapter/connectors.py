"""vLLM's KV connector internals the plugin reads."""

from __future__ import annotations


def register_connector(name: str, module: str, class_name: str) -> None:
    """Makes ``name`` a KV connector vLLM's ``kv_transfer_config`` can name (class
    ``class_name`` of ``module``, imported when vLLM builds it); nothing when registered already."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, class_name)
