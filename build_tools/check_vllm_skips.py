"""Fails `make test-vllm` on any skipped test but those whose host lacks an instruction set
vLLM's CPU build needs (tests/helpers.py's ISA_SKIP_REASONS, named one by one), and prints
those it accepts.

Usage: python build_tools/check_vllm_skips.py JUNIT_XML
"""

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import ISA_SKIP_REASONS  # noqa: E402


def skips(report: str) -> list[tuple[str, str]]:
    """(test id, reason) of each skipped test case of a junit report."""
    found = []
    for case in ElementTree.parse(report).iter("testcase"):
        for skipped in case.iter("skipped"):
            found.append((f"{case.get('classname')}::{case.get('name')}", skipped.get("message", "")))
    return found


def main(report: str) -> int:
    accepted = set(ISA_SKIP_REASONS.values())
    refused = False
    for test, reason in skips(report):
        if reason in accepted:
            print(f"skipped on this host's instruction set: {test}: {reason}")
        else:
            print(f"kv-canary: a vLLM test skipped in the vLLM venv: {test}: {reason}", file=sys.stderr)
            refused = True
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
