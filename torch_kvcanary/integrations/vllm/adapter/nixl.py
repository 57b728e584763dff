"""What the NIXL transport (`connector.nixl`) reads of vLLM's ``NixlConnector`` and of NIXL:
the keys of the ``kv_transfer_params`` NixlConnector hands between the prefill and the decode
side, its lease on a request's blocks, the host its side channel listens on, and the delay
of NIXL's progress thread."""

from __future__ import annotations

import logging

from .common import LOGGER

logger = logging.getLogger(LOGGER)

NIXL_LEASE_S = 30
"""NixlConnector's default ``kv_lease_duration``: how long P holds a request's blocks for D."""


def hands_over(params: dict) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this (prefill) side to hand its KV to a decode side."""
    return bool(params.get("do_remote_decode"))


def loads_remotely(params: dict) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this (decode) side to read its prompt's
    KV from a prefill side (NixlConnector clears it once the blocks are allocated), or, in the
    params P hands on, that the decode side will."""
    return bool(params.get("do_remote_prefill"))


def remote_request_id(params: dict) -> str | None:
    """The prefill side's id of the request whose KV the decode side reads."""
    return params.get("remote_request_id")


def lease_seconds(transfer_config) -> float:
    """NixlConnector's lease on a request's blocks on P (``kv_lease_duration``) under
    ``transfer_config``, its ``kv_transfer_config``."""
    return transfer_config.get_from_extra_config("kv_lease_duration", NIXL_LEASE_S)


def side_channel_host() -> str:
    """The host NixlConnector's side channel listens on (vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST``)."""
    from vllm import envs

    return envs.VLLM_NIXL_SIDE_CHANNEL_HOST


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
