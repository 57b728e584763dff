"""The P/D chaos soak (tools/vllm_chaos_pd.py, `torch_kvcanary.testing.soak.chaos_pd`) through a prefill and a decode `vllm serve`
with NIXL between them; its single-server twin is test_vllm_chaos.py."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.nixl


# The P/D chaos soak in its short form: 100 requests, three faults
# (a handover on P, a block one request reads on D, a block several read on D); under repair
# P is killed and restarted once mid-run. Its checks are shown to bite on made-up evidence in
# tests/vllm_plugin/serve/test_vllm_chaos.py. `make chaos-vllm-pd` runs 1,000 requests.
@pytest.mark.parametrize("policy, restart", [("repair", True), ("quarantine", False)])
def test_a_pd_chaos_soak_is_repaired_or_quarantined_and_named(policy, restart, tiny_llama, tmp_path):
    from torch_kvcanary.testing.random_models import VOCAB_SIZE
    from torch_kvcanary.testing.soak.chaos_pd import chaos_pd
    from torch_kvcanary.testing.soak.harness import install_chaos_plugin, report

    result = chaos_pd(tiny_llama, VOCAB_SIZE, policy, 100, 3, restart, install_chaos_plugin(tmp_path))
    report([result])
    assert result.problems == []
    assert sorted(f["kind"] for f in result.injected if f["named"]) == ["handover", "shared", "single"]
    assert result.restarts == int(restart) and not result.differing
    if policy == "quarantine":
        assert result.failed
    else:
        assert result.repaired_blocks >= 3 and not result.failed - result.restart_casualties
