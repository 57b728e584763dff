"""The vLLM plugin. vLLM runs `register` (`plugin`) in every process through the
``vllm.general_plugins`` entry point.

* `config`: the plugin's switches, names and checks (it imports nothing of the plugin);
* `worker`: the canary of one model runner, which decides what is verified, recorded and
  reported in each engine step;
* `reports`: violation lines, what the log says about them, and the policy over them;
* `connector`: the canary as a vLLM KV connector (vLLM imports it when configured);
* `adapter`: every vLLM internal the plugin touches, and the vLLM versions supported.
"""

from .plugin import register

__all__ = ["register"]
