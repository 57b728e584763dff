"""The op library as the Python side and the documentation describe it: the schemas in
docs/api.md are the registered ones, and the paged step's sets, named once in C++ and once
in Python, agree."""

from __future__ import annotations

import re

import torch
from helpers import REPO

from torch_kvcanary.paged_step import STEP_SETS, StepSet

API_DOC = REPO / "docs" / "api.md"

STEP_PLAN_HEADER = REPO / "csrc" / "cpu" / "kernels" / "step_plan_cpu.h"


def cxx_enum(path, name: str) -> dict[str, int]:
    """The enumerators of the C++ enum ``name`` in ``path``, each with its explicit value."""
    body = re.search(rf"enum {name}\b[^{{]*\{{(.*?)\}};", path.read_text(), re.DOTALL)
    assert body, f"no enum {name} in {path}"
    return {key: int(value) for key, value in re.findall(r"^\s*(k\w+)\s*=\s*(\d+)\s*,", body.group(1), re.MULTILINE)}


def test_the_step_sets_are_the_cxx_enum():
    # The kernel packs the sets in the C++ enum's order; the Python enum names them for the
    # plan's readers: kBlocksWritten is BLOCKS_WRITTEN, kStepSets the number of them.
    cxx = cxx_enum(STEP_PLAN_HEADER, "StepSet")
    count = cxx.pop("kStepSets")
    as_python = {re.sub(r"(?<!^)(?=[A-Z])", "_", key[1:]).upper(): value for key, value in cxx.items()}
    assert as_python == {step_set.name: step_set.value for step_set in StepSet}
    assert count == STEP_SETS == len(StepSet)


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
