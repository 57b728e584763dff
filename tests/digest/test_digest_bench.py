"""`bench --digest`: the digest timed beside the fold over the same slots and bytes."""

import json

import pytest
from helpers import DEVICES

from benchmarks import bench

pytestmark = pytest.mark.dev_tool


@pytest.mark.parametrize("device", DEVICES)
def test_digest_beside_fold(device):
    case = bench.DigestCase("small", 3, 2, 64, "bfloat16", 100)
    row = bench.digest_beside_fold(case, device, min_run_time=0.01)
    assert row["bytes"] == 100 * 3 * 2 * 128 and row["digest_s"] > 0 and row["fold_s"] > 0
    assert ("copy_s" in row) == (device == "cuda")
    assert "small" in bench.format_digest_table([row])


def test_cli_digest_table_and_json(tmp_path, capsys):
    path = tmp_path / "digest.json"
    assert bench.main(["--digest", "--device", "cpu", "--quick", "--min-run-time", "0.002", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert [r["case"]["name"] for r in payload["digest"]] == [c.name for c in bench.digest_cases(quick=True)]
    assert "digest/fold" in out and all(c.name in out for c in bench.digest_cases(quick=True))
