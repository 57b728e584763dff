"""A prefill/decode proxy for two `vllm serve` with vLLM's NixlConnector, on 127.0.0.1, in a
thread of the process that starts it (`Proxy`; tools/pd_proxy.py runs one alone).

Each OpenAI completion (POST /v1/completions, not streamed) goes first to the prefill server
with ``max_tokens`` 1 and ``kv_transfer_params`` ``{"do_remote_decode": true}``, which
computes the prompt's KV and keeps its blocks for the decode side; then to the decode
server with the ``kv_transfer_params`` the prefill server answered, so that the decode
server reads those blocks over NIXL instead of computing the prompt. The decode server's
answer is the proxy's. (vLLM's own toy proxy is in its source tree's examples, which its
wheel does not ship.)
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TIMEOUT_S = 600


def _post(url: str, body: dict, retry_s: float = 0.0) -> tuple[int, bytes]:
    """(status, body) of ``url``'s answer; 502 with the error where the server did not answer
    (stopped, restarting), after trying again every second for ``retry_s`` seconds."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    deadline = time.monotonic() + retry_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except OSError as error:  # refused, reset: no answer from the server
            if time.monotonic() >= deadline:
                return 502, json.dumps({"error": f"{url} did not answer: {type(error).__name__}: {error}"}).encode()
        time.sleep(1.0)


def disaggregated(prefill: str, decode: str, body: dict, retry_s: float = 0.0, route=None) -> tuple[int, bytes]:
    """One completion through the prefill server then the decode server: (status, body).
    The prefill server is tried again for ``retry_s`` seconds while it does not answer.
    ``route(body, params)``, where given, is what the decode server is handed instead of the
    prefill server's ``params`` (a router that rebuilds them)."""
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    first.pop("max_completion_tokens", None)
    status, answer = _post(prefill + "/v1/completions", first, retry_s)
    if status != 200:
        return status, answer
    params = json.loads(answer).get("kv_transfer_params")
    if route is not None:
        params = route(body, params)
    return _post(decode + "/v1/completions", {**body, "kv_transfer_params": params})


class Proxy:
    """The proxy on 127.0.0.1:``port`` (0: a free one) in a thread of this process; it tries
    a prefill server that does not answer again for ``retry_s`` seconds (a restart); ``route``
    rewrites the params the decode server is handed (`disaggregated`)."""

    def __init__(self, prefill: str, decode: str, port: int = 0, retry_s: float = 0.0, route=None):
        urls = (prefill, decode)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the standard library's name)
                if self.path != "/v1/completions":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = disaggregated(*urls, body, retry_s, route)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):  # one line per request would drown the servers' logs
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Proxy:
        threading.Thread(target=self._server.serve_forever, name="pd-proxy", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
