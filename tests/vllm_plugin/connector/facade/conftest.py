"""The pooled engines the connector's in-process tests share (`engine_driver.ENGINES`): each
test leaves its engine serving, with its requests finished and its prefix cache reset (a
flipped block's bytes stay wrong until a forward writes it again). The drivers import vLLM:
only where a test module has imported it already."""

import pytest


@pytest.fixture
def repair_engine(tiny_llama):
    """The engine under ``KVCANARY_VLLM=repair`` (kv_load_failure_policy "recompute")."""
    from connector_driver import connector_engine
    from engine_driver import ENGINES

    return ENGINES.get(("connector", tiny_llama, "repair"), lambda: connector_engine(tiny_llama, "repair"))


@pytest.fixture
def quarantine_engine(tiny_llama):
    """The engine under ``KVCANARY_VLLM=quarantine`` (kv_load_failure_policy "fail")."""
    from connector_driver import connector_engine
    from engine_driver import ENGINES

    return ENGINES.get(("connector", tiny_llama, "quarantine"), lambda: connector_engine(tiny_llama, "quarantine"))
