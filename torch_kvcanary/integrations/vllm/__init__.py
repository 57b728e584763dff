"""The vLLM plugin (`plugin`): vLLM runs `register` in every process through the
``vllm.general_plugins`` entry point."""

from .plugin import register

__all__ = ["register"]
