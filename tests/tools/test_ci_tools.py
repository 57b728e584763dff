"""CI's own checks: `make test-vllm` accepts a skipped vLLM test only for an instruction set
the host lacks (build_tools/check_vllm_skips.py), reason by reason."""

import pytest
from helpers import ISA_SKIP_REASONS

from build_tools import check_vllm_skips

pytestmark = pytest.mark.dev_tool

CASE = '<testcase classname="tests.test_vllm_x" name="{name}"><skipped type="pytest.skip" message="{reason}">x</skipped></testcase>'


def _report(tmp_path, reasons: list[str]) -> str:
    cases = "".join(CASE.format(name=f"test_{i}", reason=reason) for i, reason in enumerate(reasons))
    path = tmp_path / "report.xml"
    path.write_text(
        f'<testsuites><testsuite name="pytest" skipped="{len(reasons)}"><testcase classname="t" name="ran"/>{cases}</testsuite></testsuites>'
    )
    return str(path)


def test_instruction_set_skips_are_accepted(tmp_path, capsys):
    assert check_vllm_skips.main(_report(tmp_path, [])) == 0
    assert check_vllm_skips.main(_report(tmp_path, list(ISA_SKIP_REASONS.values()))) == 0
    assert capsys.readouterr().out.count("skipped on this host's instruction set") == len(ISA_SKIP_REASONS)


@pytest.mark.parametrize(
    "reason",
    ["vLLM is not installed here", "host lacks AMX", ISA_SKIP_REASONS["fp8 KV cache"] + " (and more)", ""],
)
def test_any_other_skip_fails(tmp_path, capsys, reason):
    assert check_vllm_skips.main(_report(tmp_path, [ISA_SKIP_REASONS["fp8 KV cache"], reason])) == 1
    assert "kv-canary: a vLLM test skipped in the vLLM venv" in capsys.readouterr().err
