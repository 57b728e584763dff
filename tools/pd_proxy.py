"""A prefill/decode proxy for two `vllm serve` with vLLM's NixlConnector, on 127.0.0.1
(`torch_kvcanary.testing.pd_proxy.Proxy`, run alone until interrupted).

    python tools/pd_proxy.py --prefill http://127.0.0.1:P --decode http://127.0.0.1:D --port N
"""

from __future__ import annotations

import argparse
import threading

from torch_kvcanary.testing.pd_proxy import Proxy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's URL")
    parser.add_argument("--decode", required=True, help="the decode server's URL")
    parser.add_argument("--port", type=int, default=8000)
    arguments = parser.parse_args()
    with Proxy(arguments.prefill, arguments.decode, arguments.port) as proxy:
        print(f"P/D proxy on {proxy.url}", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
