"""Each request's root (`RequestRoots`): the identity a worker's canary records and verifies
a request's first position under (docs/spec.md), derived by the plugin from the request
itself, independently of vLLM's block hashes."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ... import identity
from . import adapter

logger = logging.getLogger(adapter.LOGGER)


class RequestRoots:
    """The roots of a runner's requests (``runner_view``, an `adapter.RunnerView`): each
    derived once, at the request's first step (`identity.request_root` of its LoRA adapter
    and its cache salt), kept by request id, and dropped once vLLM has finished the request.
    An adapter's weights are digested once per load (`identity.lora_weights_word`), as the
    worker's LoRA manager loaded them: an adapter reloaded in place with other weights gives
    its later requests another root. vLLM's int id of an adapter only finds the weights this
    worker holds under it now: each server numbers its adapters in its own order, so the id
    is no part of a root. A request without adapter or salt has `identity.ANCHOR`, the root
    of every record without identity.

    ``derived`` counts the requests whose root was derived, ``rooted`` those of them with an
    identity, ``seconds`` the host time that took (adapter digests apart: ``adapter_seconds``)."""

    def __init__(self, runner_view: adapter.RunnerView):
        self._view = runner_view
        self._roots: dict[str, int] = {}
        self._adapters: dict[int, int] = {}  # the weights word of the adapter each LoRA int id holds now
        self.derived = 0
        self.rooted = 0
        self.seconds = 0.0
        self.adapter_seconds = 0.0
        self._uncarried_said = False
        self.watches_lora = runner_view.watch_lora_loads(self._adapter_loaded)

    def fill(self, request_ids: list[str], out: np.ndarray) -> None:
        """Writes the root of each of the step's requests, row by row, to ``out`` (int64)."""
        for request_id in self._view.take_finished():
            self._roots.pop(request_id, None)
        roots = self._roots
        out[: len(request_ids)] = [roots[r] if r in roots else self._derive(r) for r in request_ids]

    def held(self) -> set[str]:
        """The requests whose roots are kept."""
        return set(self._roots)

    def root(self, request_id: str) -> int:
        """The root of request ``request_id``, derived if it has none yet."""
        found = self._roots.get(request_id)
        return self._derive(request_id) if found is None else found

    def _derive(self, request_id: str) -> int:
        start = time.perf_counter()
        found = self._view.request_identity(request_id)
        lora = None
        if found.lora_id is not None:
            lora = identity.LoraIdentity(found.lora_name, self._weights_word(found.lora_id))
        root = identity.request_root(lora=lora, cache_salt=found.cache_salt)
        self._roots[request_id] = root
        self.derived += 1
        self.rooted += root != identity.ANCHOR
        self.seconds += time.perf_counter() - start
        if not self._uncarried_said and self._view.uncarried_salts:
            self._uncarried_said = True
            logger.warning(
                "kv-canary: vLLM's scheduler does not carry requests' cache_salt to this worker (the plugin was not loaded "
                "in the scheduler's process): a request's cache salt is not part of its identity here"
            )
        return root

    def _weights_word(self, lora_id: int) -> int:
        """The weights word of the adapter ``lora_id`` as last loaded; where no load was seen
        (a manager that loads past the hooked method), of the weights the manager holds."""
        word = self._adapters.get(lora_id)
        if word is None:
            weights = self._view.held_adapter_weights(lora_id)
            if weights is None:
                raise RuntimeError(
                    f"kv-canary: a request of LoRA adapter {lora_id} reached the forward, and the worker's LoRA manager holds "
                    "no adapter of that id"
                )
            self._adapter_loaded(lora_id, weights)
            word = self._adapters[lora_id]
        return word

    def _adapter_loaded(self, lora_id: int, weights: dict[str, torch.Tensor]) -> None:
        start = time.perf_counter()
        self._adapters[lora_id] = identity.lora_weights_word(weights)
        self.adapter_seconds += time.perf_counter() - start

    def describe(self) -> str:
        """What the start line says of the identity the worker reads."""
        lora = "LoRA adapters (name and weights as loaded)" if self.watches_lora else "no LoRA adapter (LoRA off)"
        salt = "cache_salt carried from the scheduler" if adapter.carries_cache_salt() else "cache_salt not carried (unread)"
        read = "".join(f", {name} ({how})" for name, how in self._view.read_identity().items())
        unread = self._view.unread_identity()
        return f"request identity: {lora}, {salt}{read}" + (f"; not read: {', '.join(unread)}" if unread else "")
