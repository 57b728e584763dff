"""The side channel of P's records (`nixl`): the prefill side's `RecordsServer` holds the
snapshots of the requests it hands over and serves them on the loopback; the decode side's
`RecordsClient` fetches a step's, over one connection per server that it keeps open.

What a prefill rank holds of a request is a `Snapshot`: the canary's records of the
request's prompt slots and each slot's transfer digest over each KV head the rank holds.

The protocol is line-framed over TCP. A question is one JSON line ``{"request_id": ...}``;
its answer is one JSON line ``{"request_id": ..., "rows": n, "first_head": f, "heads": h}``
(``rows`` -1 when none is held) followed by the records, int64 ``[n, RECORD_FIELDS]``, and
the digests, int64 ``[n, h]``. A connection carries any number of questions, answered in
order, so a step's questions go out together and cost one round trip."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO

import torch

from .....canary import RECORD_FIELDS

FETCH_TIMEOUT_S = 10.0
"""How long D waits for P's records of a request; past it, the request's blocks are load errors."""

MAX_QUESTION_BYTES = 4096
"""The longest question line the server reads; a longer one ends its connection."""


@dataclass
class Snapshot:
    """What a prefill rank holds of a request it hands over: the canary's records of the
    prompt's slots (int64 ``[n, RECORD_FIELDS]``, by position) and each slot's transfer
    digest over each KV head the rank holds (int64 ``[n, len(heads)]``, `digest.kv_digest`
    of the head's K and V over every layer, numbered by global head)."""

    records: torch.Tensor
    digests: torch.Tensor
    heads: range

    def digest_of(self, head: int) -> torch.Tensor:
        """The digest column of global ``head`` (one of `heads`)."""
        return self.digests[:, head - self.heads.start]


Answer = tuple[Snapshot | None, str]
"""P's snapshot of one request, or None and why not."""


class RecordsServer:
    """Serves the held snapshots on ``host:port`` (the module's protocol), each connection
    in a thread of its own; `close` ends the open connections too."""

    def __init__(self, host: str, port: int, max_age_s: float):
        self.max_age_s = max_age_s
        self._held: dict[str, tuple[float, Snapshot]] = {}
        self._lock = threading.Lock()
        self._answers = {"served": 0, "missing": 0}  # requests answered with records, and without
        self._connections: set[socket.socket] = set()
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                server.connection_opened(self.connection)
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:  # each question, until the client closes the connection
                    while question := self.rfile.readline(MAX_QUESTION_BYTES):
                        self.wfile.write(server.answer(question))
                except (OSError, ValueError, KeyError):  # a client gone, or one that does not speak the protocol
                    pass
                finally:
                    server.connection_closed(self.connection)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="kv-canary-records", daemon=True).start()

    def answer(self, question: bytes) -> bytes:
        """The answer to one question line, counted."""
        request_id = json.loads(question)["request_id"]
        held = self.get(request_id)
        self.count_answer("missing" if held is None else "served")
        if held is None:
            return json.dumps({"request_id": request_id, "rows": -1}).encode() + b"\n"
        header = {"request_id": request_id, "rows": len(held.records), "first_head": held.heads.start, "heads": len(held.heads)}
        return json.dumps(header).encode() + b"\n" + held.records.numpy().tobytes() + held.digests.numpy().tobytes()

    def hold(self, request_id: str, snapshot: Snapshot) -> None:
        """Holds ``snapshot``; drops those held longer than ``max_age_s`` (a request NIXL
        never reported sent, say one aborted after its prefill: its blocks are long freed)."""
        now = time.monotonic()
        with self._lock:
            for stale in [key for key, (held, _) in self._held.items() if now - held > self.max_age_s]:
                del self._held[stale]
            self._held[request_id] = (now, snapshot)

    def get(self, request_id: str) -> Snapshot | None:
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

    def connection_opened(self, connection: socket.socket) -> None:
        """A client connected (`close` ends its connection)."""
        with self._lock:
            self._connections.add(connection)

    def connection_closed(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed by its client meanwhile
                pass


class RecordsClient:
    """D: fetches P's records, the questions of a step to one server in one round trip, over
    one connection per records server that it keeps open; a kept connection that fails (its
    server restarted, say) is opened again once. ``timeout`` bounds each wait on a server."""

    def __init__(self, timeout: float = FETCH_TIMEOUT_S):
        self.timeout = timeout
        self._connections: dict[str, tuple[socket.socket, BinaryIO]] = {}

    def fetch(self, questions: list[tuple[str, str]]) -> list[Answer]:
        """The `Answer` of each ``(address, request_id)``'s server, in order."""
        answers: list[Answer] = [(None, "")] * len(questions)
        by_address: dict[str, list[int]] = {}
        for index, (address, _) in enumerate(questions):
            by_address.setdefault(address, []).append(index)
        for address, indexes in by_address.items():
            request_ids = [questions[i][1] for i in indexes]
            try:
                answered = self._ask(address, request_ids)
            except (OSError, ValueError, KeyError) as error:
                self._drop(address)
                answered = [(None, f"the records server at {address} failed: {error}")] * len(request_ids)
            for index, answer in zip(indexes, answered):
                answers[index] = answer
        return answers

    def close(self) -> None:
        for address in list(self._connections):
            self._drop(address)

    def _ask(self, address: str, request_ids: list[str]) -> list[Answer]:
        """The answers of ``address`` to ``request_ids``; a kept connection that its server
        closed or reset is replaced by a new one, once (one that timed out is not)."""
        reused = address in self._connections
        try:
            return self._round_trip(address, request_ids)
        except ConnectionError:
            self._drop(address)
            if not reused:
                raise
        return self._round_trip(address, request_ids)

    def _round_trip(self, address: str, request_ids: list[str]) -> list[Answer]:
        connection, stream = self._connection(address)
        connection.sendall(b"".join(json.dumps({"request_id": r}).encode() + b"\n" for r in request_ids))
        return [_read_answer(stream, request_id) for request_id in request_ids]

    def _connection(self, address: str) -> tuple[socket.socket, BinaryIO]:
        if address not in self._connections:
            host, _, port = address.rpartition(":")
            connection = socket.create_connection((host, int(port)), timeout=self.timeout)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connections[address] = (connection, connection.makefile("rb"))
        return self._connections[address]

    def _drop(self, address: str) -> None:
        connection, stream = self._connections.pop(address, (None, None))
        if connection is not None:
            stream.close()
            connection.close()


def _read_answer(stream: BinaryIO, request_id: str) -> Answer:
    line = stream.readline()
    if not line:
        raise ConnectionError("it closed the connection")
    header = json.loads(line)
    if header.get("request_id") != request_id:
        raise ValueError(f"it answered for request {header.get('request_id')!r}, not {request_id!r}")
    if header["rows"] < 0:
        return None, "the prefill side holds no records of it (its lease expired, or it was never snapshotted)"
    rows, heads = header["rows"], header["heads"]
    records = _read_int64(stream, rows, len(RECORD_FIELDS))
    digests = _read_int64(stream, rows, heads)
    return Snapshot(records, digests, range(header["first_head"], header["first_head"] + heads)), ""


def _read_int64(stream: BinaryIO, rows: int, columns: int) -> torch.Tensor:
    size = rows * columns * 8
    data = stream.read(size)
    if len(data) != size:
        raise ConnectionError("its answer was cut short")
    return (
        torch.frombuffer(bytearray(data), dtype=torch.int64).view(rows, columns) if size else torch.zeros(rows, columns, dtype=torch.int64)
    )
