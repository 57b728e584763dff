"""Writes what `vllm serve` with the plugin exports in ``/metrics``, taken from a real server
(`torch_kvcanary.testing.metrics_capture`): the input the Prometheus rules' unit tests are
written against.

    python tools/vllm_metrics_capture.py [--out deploy/prometheus/tests/vllm_metrics.txt]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from torch_kvcanary.testing.metrics_capture import capture
from torch_kvcanary.testing.random_models import make_llama
from torch_kvcanary.testing.serve import install_flip_plugin


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "deploy/prometheus/tests/vllm_metrics.txt")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model = make_llama(Path(scratch) / "tiny-llama")
        site = Path(scratch) / "site"
        site.mkdir()
        metrics = capture(model, install_flip_plugin(site))
    if "vllm:kv_canary_violations_total{" not in metrics:
        raise RuntimeError("the server exported no vllm:kv_canary_violations_total")
    args.out.write_text(metrics)
    print(f"wrote {args.out} ({len(metrics.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
