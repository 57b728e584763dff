"""What vLLM holds of a request's identity, as the plugin reads it on a worker: its LoRA
adapter (the request's ``LoRARequest``, and the weights the worker's LoRA manager loaded for
it: `watch_lora_loads`) and its ``cache_salt``.

vLLM's scheduler keeps ``cache_salt`` on its ``Request`` and sends a worker a
``NewRequestData`` without it. `carry_cache_salt` makes ``NewRequestData.from_request``
carry it as an attribute of its own (`CACHE_SALT`); the scheduler output reaches the worker
as the same object in-process and pickled through the multiprocess executor's queue, which
keeps an instance's attributes. The runners' ``execute_model`` hooks hand each step's
scheduler output to `IdentityNotes.note`, which keeps the salts of new requests until the
plugin takes them, and the requests finished since, whose identities the plugin drops."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

CACHE_SALT = "_kvcanary_cache_salt"
"""The attribute of a ``NewRequestData`` that carries its request's ``cache_salt`` (None: none)."""
_CARRIED = "_kvcanary_carries_cache_salt"
NOTES = "_kvcanary_identity_notes"
_LORA_HOOKED = "_kvcanary_lora_hooked"
_UNSEEN = object()


class RequestIdentity(NamedTuple):
    """What covers a whole request: its LoRA adapter's int id and name (None: no adapter)
    and its cache salt (None: none). The root holds the adapter's name and weights; the int
    id, vLLM's number of the adapter on this server, finds the weights the worker holds."""

    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


def carry_cache_salt() -> None:
    """Makes vLLM's scheduler carry each new request's ``cache_salt`` to the workers on its
    ``NewRequestData`` (`CACHE_SALT`). Run in every process the plugin is loaded in, the
    scheduler's among them; nothing when done already."""
    from vllm.v1.core.sched.output import NewRequestData

    if getattr(NewRequestData, _CARRIED, False):
        return
    made = NewRequestData.from_request.__func__

    def from_request(cls, request, *args, **kwargs):
        data = made(cls, request, *args, **kwargs)
        setattr(data, CACHE_SALT, getattr(request, "cache_salt", None))
        return data

    NewRequestData.from_request = classmethod(from_request)
    setattr(NewRequestData, _CARRIED, True)


def carries_cache_salt() -> bool:
    """Whether `carry_cache_salt` has run in this process (which imports nothing of vLLM)."""
    output = sys.modules.get("vllm.v1.core.sched.output")
    return output is not None and getattr(output.NewRequestData, _CARRIED, False)


class IdentityNotes:
    """What a runner's steps said of its requests' identities since the plugin last read
    them: the cache salt of each new request (`salts`, taken once by `take_salt`), the
    requests finished (`take_finished`), and how many new requests came without the salt
    carried (`uncarried`: a scheduler in a process where `carry_cache_salt` did not run)."""

    def __init__(self):
        self.salts: dict[str, str] = {}
        self.finished: set[str] = set()
        self.uncarried = 0

    def note(self, scheduler_output) -> None:
        """One step's scheduler output: its finished requests first (vLLM frees a finished
        id before a new request may take it again), then its new requests."""
        finished = scheduler_output.finished_req_ids
        if finished:
            self.finished.update(finished)
            for request_id in finished:
                self.salts.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            salt = getattr(new, CACHE_SALT, _UNSEEN)
            if salt is _UNSEEN:
                self.uncarried += 1
            elif salt:
                self.salts[new.req_id] = salt_text(salt)

    def take_salt(self, request_id: str) -> str | None:
        return self.salts.pop(request_id, None)

    def take_finished(self) -> set[str]:
        finished, self.finished = self.finished, set()
        return finished


def runner_state(model_runner, attribute: str, make):
    """What the plugin keeps on vLLM's runner under ``attribute`` (an attribute of the
    instance's own), made by ``make()`` at first use."""
    found = model_runner.__dict__.get(attribute)
    if found is None:
        found = make()
        setattr(model_runner, attribute, found)
    return found


def notes(model_runner) -> IdentityNotes:
    """The runner's `IdentityNotes`, made at first use."""
    return runner_state(model_runner, NOTES, IdentityNotes)


def watch_lora_loads(model_runner, loaded: Callable[[int, dict[str, torch.Tensor]], None]) -> bool:
    """Calls ``loaded(lora_int_id, weights)`` with the weights of each adapter the runner's
    LoRA manager loads from here on (its ``_load_adapter``, which every load, in-place reload
    and reload after an eviction goes through), as it loaded them, before vLLM merges or
    moves them; and at once for each adapter it holds already. False, and nothing done,
    where the runner serves no LoRA adapter."""
    manager = getattr(model_runner, "lora_manager", None)
    if manager is None:
        return False
    if not manager.__dict__.get(_LORA_HOOKED, False):
        load = manager._load_adapter

        def load_with_canary(lora_request, *args, **kwargs):
            lora = load(lora_request, *args, **kwargs)
            loaded(lora.id, adapter_weights(lora))
            return lora

        manager._load_adapter = load_with_canary
        setattr(manager, _LORA_HOOKED, True)
    for lora_id, lora in manager._adapter_manager.list_adapters().items():
        loaded(lora_id, adapter_weights(lora))
    return True


def held_adapter_weights(model_runner, lora_id: int) -> dict[str, torch.Tensor] | None:
    """The weights of adapter ``lora_id`` as the runner's LoRA manager holds it now; None
    where it holds none of that id."""
    manager = getattr(model_runner, "lora_manager", None)
    lora = None if manager is None else manager._adapter_manager.get_adapter(lora_id)
    return None if lora is None else adapter_weights(lora)


def adapter_weights(lora) -> dict[str, torch.Tensor]:
    """A vLLM ``LoRAModel``'s weights by name: each module's A, B (a packed module's parts
    numbered) and scaling, and the full modules it saves (weight and bias)."""
    weights: dict[str, torch.Tensor] = {}
    for module, layer in lora.loras.items():
        for part in ("lora_a", "lora_b"):
            value = getattr(layer, part)
            for index, tensor in enumerate(value if isinstance(value, (list, tuple)) else [value]):
                if tensor is not None:
                    weights[f"{module}.{part}.{index}"] = tensor
        scaling = layer.scaling if isinstance(layer.scaling, (list, tuple)) else [layer.scaling]
        weights[f"{module}.scaling"] = torch.tensor([float(s) for s in scaling if s is not None], dtype=torch.float64)
    for module, full in lora.modules_to_save.items():
        weights[f"{module}.weight"] = full.weight
        if full.bias is not None:
            weights[f"{module}.bias"] = full.bias
    return weights


def lora_identity(lora_request) -> RequestIdentity:
    """The LoRA part of a request's identity from its ``LoRARequest`` (None: no adapter)."""
    if lora_request is None:
        return RequestIdentity()
    return RequestIdentity(lora_request.lora_int_id, lora_request.lora_name)


def salt_text(salt: object) -> str:
    """The text a request's ``cache_salt`` is rooted in. `vllm serve` takes a str, and
    vLLM's Python API passes any object on (its block hashes encode the object as it is): a
    str is its own text; another object is its type's name and its ``repr``, so that salts
    vLLM hashes apart (``123``, ``"123"``, ``b"123"``) are rooted apart, and deriving the
    root never raises for what a client sent."""
    return salt if isinstance(salt, str) else f"{type(salt).__qualname__}:{salt!r}"
