"""The demo: every injected bug is reported, nothing else is, and a blind canary fails it."""

import subprocess
import sys

import pytest
import torch
from helpers import DEVICES

from torch_kvcanary import KvCanary
from torch_kvcanary.demos.paged_cache import Demo


@pytest.mark.parametrize("device", DEVICES)
def test_demo_reports_every_bug(device, capsys):
    assert Demo(device, steps=10).run() == 0
    out = capsys.readouterr().out
    bugs = ("page freed while still read", "block table pointing at another request's page", "single flipped bit",
            "write one page off", "offload/restore with K and V swapped")  # fmt: skip
    for bug in bugs:
        assert f"{bug} (injected before step" in out and "NOT CAUGHT" not in out
    # The block-table bug leaves every byte intact: only the records' other fields catch it.
    block_table = out.split("block table pointing at another request's page")[1].split("\n")
    assert block_table[1] == "    caught by: verify_chain_hash + verify_token + verify_owner"
    assert "false alarms: 0" in out
    assert "PARTIAL (first 16 bytes) missed 1 of them" in out


def test_demo_fails_when_a_bug_goes_unreported(monkeypatch, capsys):
    monkeypatch.setattr(KvCanary, "verify", lambda self, slots, tag=None, **inputs: torch.zeros_like(slots, dtype=torch.bool))
    assert Demo("cpu", steps=10).run() == 1
    assert "FAILED: unreported bugs" in capsys.readouterr().out


def test_demo_command_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "torch_kvcanary", "demo"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every injected bug was reported" in proc.stdout
