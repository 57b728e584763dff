"""The chain vectors, tests/data/chain_vectors.json (format: docs/spec.md, "Golden vectors"):
identities, their roots and words, and the records and verify rows of rooted and mixed
chains, every expected value recomputed by the spec transcription (spec_oracle). Nothing
here imports the package."""

from __future__ import annotations

import base64
import json

import spec_oracle as oracle
import torch
from golden import GOLDEN_PATH, render

CHAIN_PATH = GOLDEN_PATH.parent / "chain_vectors.json"


def load_chains() -> dict:
    return json.loads(CHAIN_PATH.read_text())


def pinned_tensor(spec: dict) -> torch.Tensor:
    """A pinned tensor: its bytes (base64) viewed as its dtype, in its shape (contiguous)."""
    raw = bytearray(base64.b64decode(spec["data_b64"]))
    return torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, spec["dtype"])).reshape(spec["shape"])


def weights_tensors(entry: dict) -> dict[str, torch.Tensor]:
    return {t["name"]: pinned_tensor(t) for t in entry["tensors"]}


class Identities:
    """The document's identities by the spec transcription: roots by name, item and
    embedding words, and the entry inputs of a call with its token specs resolved."""

    def __init__(self, document: dict):
        weights = {w["name"]: oracle.weights_word(weights_tensors(w)) for w in document["weights"]}
        self.roots = {r["name"]: self.root(r, weights) for r in document["roots"]}
        self.items = [oracle.text_word(i["mm_hash"]) for i in document["items"]]
        self.embeddings = [oracle.embedding_word(pinned_tensor(e)) for e in document["embeddings"]]

    @staticmethod
    def root(entry: dict, weights: dict[str, int]) -> int:
        lora = entry["lora"]
        lora = None if lora is None else (lora["name"], weights[lora["weights"]])
        return oracle.root(lora=lora, cache_salt=entry["cache_salt"])

    def token(self, spec) -> int:
        """A token spec: a token id, {"item": i, "offset": k} or {"embedding": i}."""
        if isinstance(spec, int):
            return spec
        if "item" in spec:
            return oracle.item_word(self.items[spec["item"]], spec["offset"])
        return self.embeddings[spec["embedding"]]

    def entries(self, call: dict) -> dict:
        """A call's inputs as record and verify take them (None where not given)."""
        out = {key: call.get(key) for key in ("slots", "positions", "prev_slots")}
        out["tokens"] = None if call.get("tokens") is None else [self.token(t) for t in call["tokens"]]
        out["roots"] = None if call.get("roots") is None else [self.roots[name] for name in call["roots"]]
        return out


def recorded(identities: Identities, case: dict) -> oracle.Records:
    """The tables after the case's record calls (folds 0: the vectors pin no bytes of KV)."""
    records = oracle.Records(case["capacity"])
    for call in case["calls"]:
        inputs = identities.entries(call)
        records.record(folds=[0] * len(inputs["slots"]), **inputs)
    return records


def chain_records(identities: Identities, case: dict) -> list[list[int]]:
    """[slot, token, position, chain] of each slot the case's calls wrote, by slot."""
    records = recorded(identities, case)
    slots = sorted({s for call in case["calls"] for s in call["slots"] if s >= 0})
    return [[s, *records.records[s][:3]] for s in slots]


def verify_result(identities: Identities, case: dict) -> tuple[list[bool], list[list[int]]]:
    """The flags and violation rows of the case's check after its record calls."""
    inputs = identities.entries(case["check"])
    return recorded(identities, case).verify(folds=[0] * len(inputs["slots"]), **inputs)


def regenerate(text: str) -> str:
    """The chain file ``text`` with every expected value recomputed from its inputs."""
    document = json.loads(text)
    identities = Identities(document)
    document["texts"] = [{**t, "word": oracle.text_word(t["text"])} for t in document["texts"]]
    document["weights"] = [{**w, "word": oracle.weights_word(weights_tensors(w))} for w in document["weights"]]
    document["roots"] = [{**r, "root": identities.roots[r["name"]]} for r in document["roots"]]
    document["items"] = [
        {**entry, "item": item, "words": [oracle.item_word(item, k) for k in range(len(entry["words"]))]}
        for entry, item in zip(document["items"], identities.items)
    ]
    document["embeddings"] = [{**e, "word": word} for e, word in zip(document["embeddings"], identities.embeddings)]
    document["chains"] = [{**c, "records": chain_records(identities, c)} for c in document["chains"]]
    checks = []
    for case in document["verify"]:
        flags, rows = verify_result(identities, case)
        checks.append({**case, "flags": flags, "rows": rows})
    document["verify"] = checks
    return render(document)
