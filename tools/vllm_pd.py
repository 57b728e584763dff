"""A prefill and a decode `vllm serve` (vLLM's CPU build) with vLLM's NixlConnector and the
proxy between them, all on 127.0.0.1 (`torch_kvcanary.testing.pd`), serving mixed requests:
what docs/vllm_connector.md's commands start.

    python tools/vllm_pd.py MODEL [--policy repair|quarantine|off] [--requests 20] [--progress-delay]
                                  [--tensor-parallel P D] [--single]

With ``--tensor-parallel P D`` the prefill side runs P ranks and the decode side D. Without
the canary (``off``) NixlConnector serves alone, its progress thread as NIXL ships it unless
``--progress-delay`` gives it the connector's delay, so that the pairs differ by the canary
alone. With ``--single`` the same requests go to one server of the pair's options without
NIXL (the canary's own cost beside which a pair's is read).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

from torch_kvcanary.testing.pd import pd_pair, progress_delay_env, send, single_server
from torch_kvcanary.testing.pd_proxy import Proxy
from torch_kvcanary.testing.serve import Server


def serve_single(model: Path, policy: str, prompts: list) -> None:
    """Sends ``prompts`` to `single_server`, CONCURRENCY at a time, and prints the output tokens per second."""
    with single_server(model, policy) as server:
        print(f"single server, policy {policy}: {send(server.url, model, prompts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--policy", default="repair", choices=("repair", "quarantine", "off"))
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument(
        "--progress-delay", action="store_true", help="with --policy off: NIXL's progress thread slowed as the connector slows it"
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        nargs=2,
        default=(1, 1),
        metavar=("P", "D"),
        help="the prefill and decode sides' tensor-parallel sizes",
    )
    parser.add_argument("--single", action="store_true", help="one server without NIXL, the canary under --policy (or off)")
    arguments = parser.parse_args()
    from torch_kvcanary.testing.random_models import VOCAB_SIZE  # noqa: PLC0415
    from torch_kvcanary.testing.serve import mixed_prompts  # noqa: PLC0415

    if arguments.progress_delay and arguments.policy != "off":
        parser.error("--progress-delay is for --policy off: the connector slows the progress thread itself")
    prompts = mixed_prompts(arguments.requests, VOCAB_SIZE)
    if arguments.single:
        serve_single(arguments.model, arguments.policy, prompts)
        return
    with contextlib.ExitStack() as stack:
        env = progress_delay_env(Path(stack.enter_context(tempfile.TemporaryDirectory()))) if arguments.progress_delay else None
        pair = pd_pair(arguments.model, policy=arguments.policy, env=env, tensor_parallel=tuple(arguments.tensor_parallel))
        prefill, decode, proxy = stack.enter_context(pair)
        serve(arguments.model, arguments.policy, prompts, prefill, decode, proxy)
    for server in (prefill, decode):
        print(
            "\n".join(
                line for line in server.log_path.read_text().splitlines() if "kv-canary: verified" in line or "kv-canary: wrote" in line
            )
        )


def serve(model: Path, policy: str, prompts: list, prefill: Server, decode: Server, proxy: Proxy) -> None:
    """Sends ``prompts`` through the proxy, CONCURRENCY at a time, and prints the output
    tokens per second, where the decode side's prompt tokens came from, and the canary's
    counters on both sides."""
    print(f"prefill {prefill.url} (log {prefill.log_path}), decode {decode.url} (log {decode.log_path}), proxy {proxy.url}")
    print(f"policy {policy}: {send(proxy.url, model, prompts)}")
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
    tokens_by_source = {source: decode.metric("vllm:prompt_tokens_by_source_total", source=source) for source in sources}
    print("decode side, prompt tokens: " + ", ".join(f"{source} {count:.0f}" for source, count in tokens_by_source.items()))
    if policy != "off":
        names = ("violations_total", "transfer_slots_verified_total", "transfer_slots_failed_total", "blocks_repaired_total")
        print("decode side: " + ", ".join(f"{name} {decode.metric('vllm:kv_canary_' + name):.0f}" for name in names))
        print(f"prefill side: transfer_slots_handed_over_total {prefill.metric('vllm:kv_canary_transfer_slots_handed_over_total'):.0f}")


if __name__ == "__main__":
    main()
