"""The op library as the Python side and the documentation describe it: the schemas in
docs/api.md are the registered ones, and what the paged step's ops name once in C++ and once
in Python (paged_step's phases, mailbox words and ring-row origin fields)
agrees."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import REPO

from torch_kvcanary.paged_step import MailboxWord, StepPhase
from torch_kvcanary.violations import ORIGIN_FIELDS

pytestmark = pytest.mark.contract  # every torch of .ci/run's TORCH_VERSIONS runs it

API_DOC = REPO / "docs" / "api.md"

PAGED_STEP_HEADER = REPO / "csrc" / "core" / "paged_step.h"


def cxx_enum(path, name: str) -> dict[str, int]:
    """The enumerators of the C++ enum ``name`` in ``path``, each with its explicit value."""
    body = re.search(rf"enum {name}\b[^{{]*\{{(.*?)\}};", path.read_text(), re.DOTALL)
    assert body, f"no enum {name} in {path}"
    return {key: int(value) for key, value in re.findall(r"^\s*(k\w+)\s*=\s*(\d+)\s*,", body.group(1), re.MULTILINE)}


def counted_enum(name: str, count: str) -> tuple[dict[str, int], int]:
    """The enumerators of paged_step.h's enum ``name`` but its last, ``count``, the number of
    the others, and that number."""
    cxx = cxx_enum(PAGED_STEP_HEADER, name)
    return cxx, cxx.pop(count)


def as_python_names(cxx: dict[str, int], prefix: str = "k") -> dict[str, int]:
    """kWholeStep as WHOLE_STEP: the enumerators' names as the Python enums spell
    them, ``prefix`` left out."""
    return {re.sub(r"(?<!^)(?=[A-Z])", "_", key.removeprefix(prefix)).upper(): value for key, value in cxx.items()}


def test_the_paged_step_phases_are_the_cxx_enum():
    # kWholeStep is WHOLE_STEP; kNumPhases the number of them.
    cxx, count = counted_enum("PagedStepPhase", "kNumPhases")
    assert as_python_names(cxx) == {phase.name: phase.value for phase in StepPhase}
    assert count == len(StepPhase)


def test_the_mailbox_words_are_the_cxx_enum():
    # The kernels write the mailbox by the C++ enum; PagedStep reads it by the Python one:
    # kMailRingStart is RING_START, kMailboxWords the mailbox's length.
    cxx, count = counted_enum("MailboxWord", "kMailboxWords")
    assert as_python_names(cxx, prefix="kMail") == {word.name: word.value for word in MailboxWord}
    assert count == len(MailboxWord)


def test_the_origin_columns_are_the_cxx_enum():
    # KvCanary allocates the origins [ring rows, ORIGIN_FIELDS]; the kernels write
    # kOriginFields columns, in the C++ enum's order (Violation's step, group and row).
    cxx, count = counted_enum("OriginField", "kOriginFields")
    assert cxx == {"kOriginStep": 0, "kOriginGroup": 1, "kOriginRow": 2}
    assert count == ORIGIN_FIELDS == len(cxx)


def documented_schemas() -> dict[str, str]:
    """The schemas of the fenced block of docs/api.md's section on the ops, by op name, each
    on one line: a line that starts with a space continues the schema above it."""
    section = API_DOC.read_text().split("## The ops: `torch.ops.kvcanary`", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert block, "no schema block in docs/api.md's section on the ops"
    schemas: list[str] = []
    for line in block.group(1).splitlines():
        if line.startswith(" "):
            schemas[-1] += " " + line.strip()
        else:
            schemas.append(line.strip())
    return {schema.split("(", 1)[0]: schema for schema in schemas}


def registered_schemas() -> dict[str, str]:
    """Every kvcanary op's schema as torch holds it, without the namespace."""
    names = [name.removeprefix("kvcanary::") for name in torch._C._dispatch_get_all_op_names() if name.startswith("kvcanary::")]
    overloads = [(name, *name.partition(".")[::2]) for name in names]  # "record.bound": (record, bound)
    return {
        name: str(getattr(getattr(torch.ops.kvcanary, op), overload or "default")._schema).removeprefix("kvcanary::")
        for name, op, overload in overloads
    }


def test_the_documented_schemas_are_the_registered_ones():
    documented, registered = documented_schemas(), registered_schemas()
    assert sorted(documented) == sorted(registered)
    for name, schema in registered.items():
        assert documented[name] == schema, name
