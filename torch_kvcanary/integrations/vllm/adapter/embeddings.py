"""What fed each position of a runner started with ``enable_prompt_embeds``: its forward then
runs on ``inputs_embeds`` and gets no input ids, so the plugin takes the token ids from the
runner's buffers and gives each position fed by an embedding row that row's word
(`torch_kvcanary.identity.embedding_word`, docs/spec.md section 8).

`PromptWords` derives a request's words once, at its first step (one BLAKE2b of each
embedding row, on the host), and keeps them until vLLM finishes the request; a step then
gathers them in O(rows) NumPy for the rows that run embedding positions, and a step that
runs none reads the runner's input ids as they are."""

from __future__ import annotations

import time

import numpy as np
import torch

from .... import identity
from .identity import runner_state

_WORDS = "_kvcanary_prompt_words"
NOT_EMBEDDED = -1
"""A prompt position given as a token id in a request's words (`PromptWords.words`)."""


class PromptWords:
    """The words of the embedding rows of a runner's requests, by request id: int64
    ``[prompt positions given]``, `NOT_EMBEDDED` at a position given as a token id.
    ``rows`` counts the rows digested, ``seconds`` the host time that took."""

    def __init__(self):
        self._words: dict[str, np.ndarray | None] = {}
        self.rows = 0
        self.seconds = 0.0

    def forget(self, finished) -> None:
        for request_id in finished:
            self._words.pop(request_id, None)

    def words(self, model_runner, request_id: str) -> np.ndarray | None:
        """Request ``request_id``'s words (None: it gives no embedding row), derived at first use."""
        if request_id in self._words:
            return self._words[request_id]
        state = model_runner.requests[request_id]
        embeds = state.prompt_embeds
        found = None
        if embeds is not None:
            start = time.perf_counter()
            embedded = np.ones(len(embeds), dtype=bool)
            if getattr(state, "prompt_is_token_ids", None) is not None:
                embedded = ~np.asarray(state.prompt_is_token_ids, dtype=bool)[: len(embeds)]
            found = np.full(len(embeds), NOT_EMBEDDED, dtype=np.int64)
            rows = embeds.detach().cpu()
            for position in np.flatnonzero(embedded):
                found[position] = identity.embedding_word(rows[position])
            self.rows += int(embedded.sum())
            self.seconds += time.perf_counter() - start
        self._words[request_id] = found
        return found


def prompt_words(model_runner) -> PromptWords:
    """The runner's `PromptWords`, made at first use."""
    return runner_state(model_runner, _WORDS, PromptWords)


def step_input_words(model_runner, request_ids: list[str], num_scheduled: np.ndarray, num_computed: np.ndarray) -> torch.Tensor:
    """What fed each token of a V1 runner's forward on ``inputs_embeds``: the runner's input
    ids where ``is_token_ids`` holds (sampled tokens under async scheduling are written
    there on the device), each embedding row's word elsewhere; int64 ``[tokens]`` on the
    runner's device, or the runner's input ids buffer itself where no position is embedded."""
    num_tokens = int(num_scheduled.sum())
    is_token_ids = model_runner.is_token_ids
    if is_token_ids.np[:num_tokens].all():
        return model_runner.input_ids.gpu
    words = np.full(num_tokens, NOT_EMBEDDED, dtype=np.int64)
    table = prompt_words(model_runner)
    start = 0
    for request_id, scheduled, computed in zip(request_ids, num_scheduled.tolist(), num_computed.tolist()):
        found = table.words(model_runner, request_id) if scheduled else None
        if found is not None and computed < len(found):
            given = found[computed : computed + scheduled]
            words[start : start + len(given)] = given
        start += scheduled
    device = model_runner.input_ids.gpu.device
    ids = model_runner.input_ids.gpu[:num_tokens].to(torch.int64)
    return torch.where(is_token_ids.gpu[:num_tokens], ids, torch.from_numpy(words).to(device))


def known_words(model_runner, request_id: str, tokens: torch.Tensor, context: int) -> torch.Tensor:
    """``tokens`` (the first ``context`` of a V1 input-batch row, -1 where not a token id) as
    int64, request ``request_id``'s embedding rows' words at its embedded positions."""
    tokens = tokens.to(torch.int64)
    found = prompt_words(model_runner).words(model_runner, request_id)
    if found is not None:
        given = torch.from_numpy(found[:context])
        head = tokens[: len(given)]
        tokens[: len(given)] = torch.where(given != NOT_EMBEDDED, given, head)
    return tokens
