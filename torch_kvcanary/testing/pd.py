"""A prefill and a decode `vllm serve` (vLLM's CPU build) with vLLM's NixlConnector, and the
proxy between them (`pd_proxy`), all on 127.0.0.1: what the P/D tests, the P/D chaos soak
and tools/vllm_pd.py (docs/vllm_connector.md's commands) start.

Each server of one tensor-parallel rank runs on a core of its own where the host has two
(``taskset``, and vLLM's ``VLLM_CPU_OMP_THREADS_BIND``), a server of several ranks one rank
per core; `pd_pair`'s ``tensor_parallel`` gives the prefill and decode sides their ranks
(NIXL's heterogeneous TP where they differ). UCX runs on the loopback (``UCX_NET_DEVICES=lo``) and
NIXL's side channel on 127.0.0.1. With the canary (``policy`` repair or quarantine) NIXL
is ``KvCanaryConnector``'s inner connector, which slows NIXL's progress thread down
(``PROGRESS_DELAY_US``); without it (``off``) NixlConnector serves alone, its progress
thread as NIXL ships it unless `progress_delay_env` gives it the connector's delay (through
a vLLM plugin of this module's own), so that the pairs differ by the canary alone.
`single_server` is one server of the pair's options without NIXL (the canary's own cost
beside which a pair's is read): ``KvCanaryConnector`` with no inner connector under the
policy, or no connector with ``off``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch_kvcanary.testing.pd_proxy import Proxy
from torch_kvcanary.testing.serve import Server, complete, free_port, install_vllm_plugin, path_with, server_options

# A tiny float32 model served greedily: the same answer, token for token, wherever the KV was computed.
PD_OPTIONS = server_options(dtype="float32", kv_bytes=8 << 20, tokens_per_step=512)
# Requests in flight through the proxy at once (`send`).
CONCURRENCY = 4
# NIXL's progress thread polls UCX without pause unless told otherwise (`adapter.nixl.delay_progress_thread`).
PROGRESS_DELAY_US = 1000


def nixl_config(*, canary: bool, failure_policy: str = "recompute", lease_s: int | None = None) -> dict:
    """The ``--kv-transfer-config`` of a P/D server: NixlConnector with the KV cache in host
    memory, pulling every prompt however short (``kv_recompute_threshold`` 0), holding P's
    blocks for D ``lease_s`` seconds (NIXL's default: 30), inside KvCanaryConnector with the canary."""
    extra = {"kv_recompute_threshold": 0, "num_threads": 1}
    if lease_s is not None:
        extra["kv_lease_duration"] = lease_s
    inner = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu", "kv_connector_extra_config": extra}
    if not canary:
        return inner
    return {
        "kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {"inner": inner, "nixl_progress_delay_us": PROGRESS_DELAY_US},
    }  # fmt: skip


# A vLLM plugin that gives NIXL's progress thread the connector's delay without the canary.
PROGRESS_DELAY_PLUGIN = f"""
def register():
    from torch_kvcanary.integrations.vllm.adapter.nixl import delay_progress_thread
    delay_progress_thread({PROGRESS_DELAY_US})
"""


def progress_delay_env(directory: Path) -> dict:
    """The environment of servers that load the progress-delay plugin, installed in ``directory``."""
    site = install_vllm_plugin(directory, "kvcanary_tools_nixl_progress_delay", PROGRESS_DELAY_PLUGIN)
    return {"PYTHONPATH": path_with(site)}


def _cores(index: int, ranks: int) -> list[str] | None:
    """The cores server ``index`` runs on, one per rank, where the host has one per server
    and rank: a server of one rank on a core of its own, a server of several ranks on the
    first ``ranks`` cores."""
    cores = sorted(os.sched_getaffinity(0))
    if ranks > 1:
        return [str(core) for core in cores[:ranks]] if len(cores) >= ranks else None
    return [str(cores[index])] if len(cores) >= 2 else None


def pd_server(
    model: Path, index: int, *, policy: str, env: dict | None = None, lease_s: int | None = None, tensor_parallel: int = 1
) -> Server:
    """Server ``index`` (0: prefill, 1: decode) of a pair, of ``tensor_parallel`` ranks;
    ``policy`` "off" serves NIXL without the canary."""
    canary = policy != "off"
    environment = {
        "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "KVCANARY_VLLM_SUMMARY_S": "0",
    }  # fmt: skip
    if canary:
        environment["KVCANARY_VLLM"] = policy
    cores = _cores(index, tensor_parallel)
    if cores is not None:
        environment["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(cores)
    environment.update(env or {})
    failure = "fail" if policy == "quarantine" else "recompute"
    config = nixl_config(canary=canary, failure_policy=failure, lease_s=lease_s)
    options = (*PD_OPTIONS, "--tensor-parallel-size", str(tensor_parallel), "--kv-transfer-config", json.dumps(config))
    pinned = cores is not None and tensor_parallel == 1 and shutil.which("taskset")
    return Server(model, environment, options, prefix=("taskset", "-c", cores[0]) if pinned else ())


def claim_dropper(dropped):
    """A router's rewrite of the params P answered (`Proxy`'s ``route``): for each request
    ``dropped(body)`` names, they lose the canary's key (P's claim of its records), as a
    router that rebuilds ``kv_transfer_params`` from the keys it knows does."""
    from torch_kvcanary.integrations.vllm.connector.nixl import RECORDS_KEY

    def route(body: dict, params: dict) -> dict:
        return {key: value for key, value in params.items() if key != RECORDS_KEY} if dropped(body) else params

    return route


@contextlib.contextmanager
def pd_pair(
    model: Path,
    *,
    policy: str = "repair",
    env: dict | None = None,
    lease_s: int | None = None,
    tensor_parallel: tuple[int, int] = (1, 1),
    side_env: tuple[dict, dict] = ({}, {}),
    route=None,
):
    """(prefill, decode, proxy), started and then stopped; ``tensor_parallel`` is the
    (prefill, decode) sides' tensor-parallel sizes, ``side_env`` what each side's environment
    adds to ``env``, ``route`` the proxy's rewrite of the params it hands the decode side."""
    prefill, decode = (
        pd_server(
            model, index, policy=policy, env={**(env or {}), **side_env[index]}, lease_s=lease_s, tensor_parallel=tensor_parallel[index]
        )
        for index in (0, 1)
    )
    with contextlib.ExitStack() as stack:
        for server in (prefill, decode):  # both start at once: each takes a minute on a core
            server.start()
            stack.push(server)
        for server in (prefill, decode):
            server.wait_healthy()
        with Proxy(prefill.url, decode.url, route=route) as proxy:
            yield prefill, decode, proxy


def single_server(model: Path, policy: str) -> Server:
    """One server of a pair's options and core, without NIXL: the canary under ``policy``
    with its connector and no inner one, or neither (``off``)."""
    environment = {"KVCANARY_VLLM_SUMMARY_S": "0"}
    options = PD_OPTIONS
    if policy != "off":
        environment["KVCANARY_VLLM"] = policy
        failure = "fail" if policy == "quarantine" else "recompute"
        config = {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_load_failure_policy": failure}
        options = (*PD_OPTIONS, "--kv-transfer-config", json.dumps(config))
    cores = _cores(0, 1)
    if cores is not None:
        environment["VLLM_CPU_OMP_THREADS_BIND"] = cores[0]
    pinned = cores is not None and shutil.which("taskset")
    return Server(model, environment, options, prefix=("taskset", "-c", cores[0]) if pinned else ())


def send(url: str, model: Path, prompts: list) -> str:
    """Sends ``prompts`` to ``url``, CONCURRENCY at a time: how many, the errors, the wall
    time and the output tokens per second, in words."""
    begin = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(lambda request: complete(url, model, *request), prompts))
    seconds = time.perf_counter() - begin
    errors = [answer for answer in answers if "error" in answer]
    tokens = sum(answer["usage"]["completion_tokens"] for answer in answers if "error" not in answer)
    return f"{len(prompts)} requests ({len(errors)} errors) in {seconds:.1f} s: {tokens / seconds:.1f} output tokens/s"
