"""The op library as the Python side and the documentation describe it: the paged step's
sets, named once in C++ and once in Python, agree."""

from __future__ import annotations

import re

from helpers import REPO

from torch_kvcanary.paged_step import STEP_SETS, StepSet

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
