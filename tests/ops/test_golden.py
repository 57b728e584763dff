"""The golden vectors (tests/data/fold_vectors.json) against the spec transcription: the
regeneration of tools/make_golden.py gives back the pinned file byte for byte. The package's
fold reproduces them on every device (test_ops.py) and every CPU path (test_cpu_paths.py)."""

import base64
import importlib.util
import json

import pytest
from golden import GOLDEN_PATH, expected_fingerprints, regenerate

pytestmark = pytest.mark.contract  # every torch of .ci/run's TORCH_VERSIONS runs it


def _load_script():
    """tools/make_golden.py, loaded from its path (tools/ is not a package)."""
    path = GOLDEN_PATH.parents[2] / "tools" / "make_golden.py"
    spec = importlib.util.spec_from_file_location("make_golden", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_golden = _load_script()


def test_regeneration_gives_the_pinned_file():
    pinned = GOLDEN_PATH.read_text()
    assert regenerate(pinned) == pinned
    assert make_golden.main(["--check"]) == 0


def test_expected_values_follow_the_inputs(tmp_path):
    """One byte changed in a slot's stored bytes changes that slot's regenerated fingerprint,
    and the check of the script then fails: the expected values are computed, not copied."""
    document = json.loads(GOLDEN_PATH.read_text())
    case = next(c for c in document["cases"] if c["name"] == "row_rb128" and c["mode"] == "ALL")
    (source,) = case["sources"]
    raw = bytearray(base64.b64decode(source["storage_b64"]))
    slot = case["slots"][0]
    raw[slot * source["stride"][0] + 5] ^= 0x10  # byte 5 of the slot's row (page_size 1, uint8)
    source["storage_b64"] = base64.b64encode(bytes(raw)).decode()
    changed = expected_fingerprints(case)
    assert changed[0] != case["expected"][0] and changed[1:] == case["expected"][1:]
    edited = tmp_path / "fold_vectors.json"
    edited.write_text(json.dumps(document, indent=1) + "\n")
    assert make_golden.main(["--check", str(edited)]) == 1
