"""The vLLM plugin: `plugin` decides what the canary verifies, records and reports, and
`adapter` holds every vLLM internal it touches. vLLM runs `register` in every process
through the ``vllm.general_plugins`` entry point."""

from .plugin import register

__all__ = ["register"]
