"""The host and device buffers a worker's canary fills each engine step: the forward's rows
for `PagedStep` (`StepRows`), and a copy of the token history where vLLM keeps it on the host
while the canary runs on a device (`TokenCopy`)."""

from __future__ import annotations

import numpy as np
import torch

from . import adapter


class StepRows:
    """The step's ``query_start_loc`` and ``seq_lens`` (int64; vLLM keeps them as int32) for
    `PagedStep`, from the forward's rows (the first stays 0), and each row's request's root
    (``roots``, from ``request_roots``, a `request_roots.RequestRoots`: a lookup per row):
    written on the host through a NumPy view, then, where the canary is on a device, copied
    there in one non-blocking copy (from pinned memory). Grows, once, past a batch larger
    than any before."""

    def __init__(self, device: torch.device, request_roots, rows: int = 256):
        self._device = device
        self._request_roots = request_roots
        self._allocate(rows)

    def _allocate(self, rows: int) -> None:
        on_device = self._device.type != "cpu"
        self._host = torch.zeros(3, rows + 1, dtype=torch.int64, pin_memory=on_device)
        self._values = self._host.numpy()
        self._copy = torch.empty_like(self._host, device=self._device) if on_device else None
        buffers = self._host if self._copy is None else self._copy
        self.query_start_loc, self.seq_lens, self.roots = buffers[0], buffers[1], buffers[2]

    def fill(self, forward: adapter.Step) -> int:
        """Writes the forward's rows; returns its number of tokens (the cumulative sum's last)."""
        rows = len(forward.num_scheduled)
        if rows + 1 > self._values.shape[1]:
            self._allocate(2 * rows)
        np.add.accumulate(forward.num_scheduled, out=self._values[0, 1 : rows + 1])
        np.add(forward.num_computed, forward.num_scheduled, out=self._values[1, :rows])
        self._request_roots.fill(forward.request_ids, self._values[2])
        if self._copy is not None:
            self._copy.copy_(self._host, non_blocking=True)
        return int(self._values[0, rows])


class TokenCopy:
    """The canary's copy of a Model Runner V1's token history: on the device where the runner
    keeps its own on the host (V1 on a GPU), so that the context's tokens are checked on the
    device without host work per slot, and where requests may give prompt embeddings, whose
    rows' words (int64) the runner's int32 history cannot hold. ``tokens[row, position]`` by
    input-batch row: what fed the position (a token id or a word), -1 where not known (the
    token check skips those). A request's context is copied from the host when it takes a row
    (`adapter.Runner.known_tokens`: exact there, under async scheduling too), its row is
    moved on the device when vLLM moves the request to another row, and each step's tokens
    are written on the device from its input ids after the forward (`record`), as the
    runner's own history would hold them under synchronous scheduling."""

    def __init__(self, rows: int, length: int, dtype: torch.dtype, device: torch.device):
        self.tokens = torch.full((rows, length), -1, dtype=dtype, device=device)
        self._row_of: dict[str, int] = {}  # each request's row at the last step

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes

    def follow(self, request_ids: list[str], known_tokens) -> adapter.TokenHistory:
        """Before a step's verify, with the input batch's request ids row by row: the rows
        of requests that moved are moved, those of requests that joined are copied from
        ``known_tokens(row)`` (the rest of the row set to -1)."""
        moved_from, moved_to, joined = [], [], []
        for row, request_id in enumerate(request_ids):
            before = self._row_of.get(request_id)
            if before is None:
                joined.append(row)
            elif before != row:
                moved_from.append(before)
                moved_to.append(row)
        if moved_to:  # whole rows; all sources are read before any destination is written
            self.tokens[moved_to] = self.tokens[moved_from]
        for row in joined:
            tokens = known_tokens(row)
            self.tokens[row, len(tokens) :].fill_(-1)
            self.tokens[row, : len(tokens)].copy_(tokens, non_blocking=True)
        self._row_of = dict(zip(request_ids, range(len(request_ids))))
        return adapter.TokenHistory(self.tokens, None)

    def record(self, forward: adapter.Step, num_tokens: int) -> None:
        """After a step's forward: what fed each (input-batch row, position) it wrote."""
        rows = np.repeat(np.arange(len(forward.num_scheduled)), forward.num_scheduled)
        rows = torch.from_numpy(rows).to(self.tokens.device, non_blocking=True)
        self.tokens[rows, forward.positions[:num_tokens]] = forward.input_ids[:num_tokens].to(self.tokens.dtype)
