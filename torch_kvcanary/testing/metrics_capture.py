"""What `vllm serve` with the plugin exports in ``/metrics``, taken from a real server
(`capture`): the input the Prometheus rules' unit tests are written against
(deploy/prometheus/tests/vllm_metrics.txt, written by tools/vllm_metrics_capture.py), and the
server and fault the real-Prometheus test (tests/vllm_plugin/serve/test_prometheus.py) runs.

The server runs the plugin under ``repair`` with `KvCanaryConnector` (the counters exist only
with the connector) and fault drills (probability 0.5 a step), serves a prompt, has one byte of that prompt's cached
block flipped (`serve.FLIP_PLUGIN`, called through /collective_rpc, as
tests/vllm_plugin/serve/test_vllm_serve.py does), and serves two requests that read the block and one that does not.
The ``vllm:`` families of its ``/metrics`` are written out; the process's own (python_*,
process_*) are left out.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch_kvcanary.testing import serve
from torch_kvcanary.testing.serve import SERVE_OPTIONS, Server, path_with

# The prompt whose cached block is flipped, and the flipped position: in its last full block.
PROMPT = list(range(10, 110))
FLIPPED = 90


def connector_server(model: Path, site: Path, drill: float = 0.0) -> Server:
    """`vllm serve` of ``model`` under ``repair`` with `KvCanaryConnector`, fault drills of
    probability ``drill``, and the flip plugin installed in ``site`` (`serve.install_flip_plugin`)."""
    transfer = json.dumps({"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"})
    env = dict(
        KVCANARY_VLLM="repair",
        KVCANARY_VLLM_DRILL=str(drill),
        KVCANARY_VLLM_SUMMARY_S="0",
        VLLM_SERVER_DEV_MODE="1",
        PYTHONPATH=path_with(site),
    )
    return Server(model, env, (*SERVE_OPTIONS, "--no-async-scheduling", "--kv-transfer-config", transfer))


def flip(server: Server) -> int:
    """Flips a bit of the slot of `PROMPT`'s token at `FLIPPED` (served before, so cached)
    in the server's worker; the slot."""
    return serve.flip(server, PROMPT[FLIPPED], FLIPPED)


def read_flipped(server: Server) -> list[dict]:
    """Two requests extending `PROMPT`: they read the flipped block."""
    return [server.complete(PROMPT + [200 + i], 8) for i in range(2)]


def vllm_families(metrics: str) -> str:
    """The lines of ``metrics`` (Prometheus's text format) of the ``vllm:`` families."""
    kept = []
    for line in metrics.splitlines():
        name = line.split()[2] if line.startswith("# ") else line.split("{")[0].split(" ")[0]
        if name.startswith("vllm:"):
            kept.append(line)
    return "\n".join(kept) + "\n"


def capture(model: Path, site: Path) -> str:
    with connector_server(model, site, drill=0.5) as server:
        assert "error" not in server.complete(PROMPT, 4)
        flip(server)
        answers = [*read_flipped(server), server.complete(list(range(300, 340)), 16)]
        if any("error" in answer for answer in answers):
            raise RuntimeError(f"a request failed: {answers}")
        return vllm_families(server.metrics())
