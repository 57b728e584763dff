"""vLLM's streaming-input sessions with the plugin on (vllm_sessions.py beside it, run in a
process of its own: AsyncLLM starts its engine core process): sessions of three chunks
beside plain requests that share their prefix, with prefix caching on, raise no report;
a bit flipped while a session pauses between chunks (holding its blocks) is named with
that session's request when its next chunk reads it. Run on every vLLM release the plugin
supports."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs these tests in the vLLM venv")

import vllm_sessions  # noqa: E402
from engine_driver import VIOLATION  # noqa: E402

from torch_kvcanary.testing.serve import install_flip_plugin, path_with  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.every_release]

TOOL = Path(__file__).resolve().parent / "vllm_sessions.py"


def _run(model: Path, site: Path, *flags: str) -> tuple[dict, str]:
    """The tool's summary and everything its process and vLLM's engine core printed."""
    environ = {**os.environ, "KVCANARY_VLLM": "log", "PYTHONPATH": path_with(site)}
    done = subprocess.run([sys.executable, str(TOOL), str(model), *flags], env=environ, capture_output=True, text=True, timeout=600)
    printed = done.stdout + done.stderr
    summaries = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(summaries) == 1, printed[-6000:]
    return json.loads(summaries[0]), printed


def _canary_lines(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if re.search(r" (WARNING|ERROR) .*kv[-_]canary", line)]


def _assert_every_request_answered(summary: dict) -> None:
    chunks = len(vllm_sessions.CHUNK_PROMPTS)
    assert len(summary["sessions"]) == vllm_sessions.SESSIONS
    for session in summary["sessions"]:
        assert [len(tokens) for tokens in session] == [vllm_sessions.TOKENS_PER_CHUNK] * chunks, session
    assert [len(answer["tokens"]) for answer in summary["plain"]] == [vllm_sessions.TOKENS_PER_CHUNK] * vllm_sessions.PLAIN


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_flip_plugin(tmp_path_factory.mktemp("site"))


def test_sessions_beside_plain_requests_raise_no_false_alarm(tiny_llama, site):
    summary, printed = _run(tiny_llama, site)
    assert "kv-canary: watching" in printed
    _assert_every_request_answered(summary)
    # The plain requests came after the sessions' first chunks had computed the shared prefix.
    assert all(answer["cached"] >= vllm_sessions.PREFIX for answer in summary["plain"]), summary["plain"]
    assert _canary_lines(printed) == []


def test_a_bit_flipped_while_a_session_pauses_is_named_with_the_session(tiny_llama, site):
    summary, printed = _run(tiny_llama, site, "--flip")
    _assert_every_request_answered(summary)  # under log the engine serves on
    flipped_block = summary["flipped"]["slot"] // vllm_sessions.BLOCK_SIZE
    lines = _canary_lines(printed)
    found = [VIOLATION.search(line) for line in lines]
    assert found and all(found), lines
    for match in found:
        assert match[1] == "verify_real_kv_hash" and int(match[2]) // vllm_sessions.BLOCK_SIZE == flipped_block, lines
        assert match[3].startswith("session-0"), lines  # vLLM's internal id: the session's, and a suffix
