"""The golden vectors, tests/data/fold_vectors.json (format: docs/spec.md, "Golden vectors"):
their cases, their tensors, and their expected fingerprints recomputed by the spec
transcription (spec_oracle). Nothing here imports the package."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import spec_oracle as oracle
import torch

GOLDEN_PATH = Path(__file__).resolve().parent / "data" / "fold_vectors.json"


def load_golden() -> list[dict]:
    return json.loads(GOLDEN_PATH.read_text())["cases"]


def golden_tensor(spec: dict, device: str = "cpu") -> torch.Tensor:
    """A source's tensor: its storage bytes viewed as its dtype, then its shape, strides and
    offset (in elements)."""
    dtype = getattr(torch, spec["dtype"])
    raw = bytearray(base64.b64decode(spec["storage_b64"]))
    storage = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).to(device)
    return torch.as_strided(storage, spec["shape"], spec["stride"], spec["offset"])


def oracle_source(spec: dict) -> oracle.Source:
    tensor = golden_tensor(spec)
    if spec["form"] == "rows":
        return oracle.row_form(tensor, spec["page_size"], spec["num_bytes_per_token"], spec["read_bytes"])
    return oracle.view_form(tensor, spec["read_bytes"])


def expected_fingerprints(case: dict) -> list[int]:
    """The fold of each of the case's slots over its sources, by the spec transcription."""
    sources = [oracle_source(spec) for spec in case["sources"]]
    return [oracle.fold(sources, slot, case["mode"]) for slot in case["slots"]]


def render(document: dict) -> str:
    """The file's canonical text: JSON with a one-space indent and a final newline."""
    return json.dumps(document, indent=1) + "\n"


def regenerate(text: str) -> str:
    """The golden file ``text`` with every case's ``expected`` recomputed from its inputs."""
    document = json.loads(text)
    cases = [{**case, "expected": expected_fingerprints(case)} for case in document["cases"]]
    return render({**document, "cases": cases})
