"""The side channel of P's records (`nixl`): the prefill side's `RecordsServer` holds the
snapshots of the requests it hands over and serves them on the loopback; the decode side
fetches a request's with `fetch_records`."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time

import torch

from ....canary import RECORD_FIELDS

FETCH_TIMEOUT_S = 10.0
"""How long D waits for P's records of a request; past it, the request's blocks are load errors."""


class RecordsServer:
    """Serves the held snapshots on ``host:port``: a request is one JSON line
    ``{"request_id": ...}``; the answer one JSON line ``{"request_id": ..., "rows": n}``
    (``rows`` -1 when none is held) followed by the records, int64 ``[n, RECORD_FIELDS]``."""

    def __init__(self, host: str, port: int, max_age_s: float):
        self.max_age_s = max_age_s
        self._held: dict[str, tuple[float, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._answers = {"served": 0, "missing": 0}  # requests answered with records, and without
        held = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                request_id = json.loads(self.rfile.readline())["request_id"]
                records = held.get(request_id)
                held.count_answer("missing" if records is None else "served")
                rows = -1 if records is None else len(records)
                self.wfile.write(json.dumps({"request_id": request_id, "rows": rows}).encode() + b"\n")
                if records is not None:
                    self.wfile.write(records.numpy().tobytes())

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="kv-canary-records", daemon=True).start()

    def hold(self, request_id: str, records: torch.Tensor) -> None:
        """Holds ``records``; drops those held longer than ``max_age_s`` (a request NIXL
        never reported sent, say one aborted after its prefill: its blocks are long freed)."""
        now = time.monotonic()
        with self._lock:
            for stale in [key for key, (held, _) in self._held.items() if now - held > self.max_age_s]:
                del self._held[stale]
            self._held[request_id] = (now, records)

    def get(self, request_id: str) -> torch.Tensor | None:
        with self._lock:
            held = self._held.get(request_id)
        return None if held is None else held[1]

    def release(self, request_ids) -> None:
        with self._lock:
            for request_id in request_ids:
                self._held.pop(request_id, None)

    def count_answer(self, answer: str) -> None:
        """Counts a request answered with records (``"served"``) or without (``"missing"``)."""
        with self._lock:
            self._answers[answer] += 1

    def take_answers(self) -> dict[str, int]:
        """The requests answered with records (``served``) and without (``missing``) since the last call."""
        with self._lock:
            answers, self._answers = self._answers, dict.fromkeys(self._answers, 0)
        return answers

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def fetch_records(address: str, request_id: str, timeout: float = FETCH_TIMEOUT_S) -> tuple[torch.Tensor | None, str]:
    """P's records of its request ``request_id`` from the records server at ``address``:
    (records, "") or (None, why not)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as connection:
            connection.sendall(json.dumps({"request_id": request_id}).encode() + b"\n")
            stream = connection.makefile("rb")
            header = json.loads(stream.readline())
            if header.get("request_id") != request_id:
                return None, f"the records server answered for request {header.get('request_id')!r}"
            if header["rows"] < 0:
                return None, "the prefill side holds no records of it (its lease expired, or it was never snapshotted)"
            size = header["rows"] * len(RECORD_FIELDS) * 8
            data = stream.read(size)
            if len(data) != size:
                return None, "the records server's answer was cut short"
            return torch.frombuffer(bytearray(data), dtype=torch.int64).view(-1, len(RECORD_FIELDS)), ""
    except (OSError, ValueError, KeyError) as error:
        return None, f"the records server at {address} failed: {error}"
