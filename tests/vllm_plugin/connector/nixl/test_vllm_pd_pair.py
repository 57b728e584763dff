"""Prefill/decode disaggregation through vLLM's NixlConnector, verified by KvCanaryConnector:
a prefill and a decode `vllm serve` and the proxy between them on 127.0.0.1
(`torch_kvcanary.testing.pd`), serving a tiny random float32 model greedily.

Clean requests sharing prefixes come out as a clean NIXL pair without the canary answers
them, with the KV pulled over NIXL and nothing flagged. Then faults, each injected by a vLLM
plugin of the test's own: a byte flipped in a block on the prefill side after the prefill
and before the transfer; a byte flipped on the decode side after the transfer; the decode
side told to read another request's blocks; the decode side's read cut short (a block not
read); blocks read after P's lease on them expired and P reused them. Under ``repair`` each
is named as a load error and recomputed, the answer equals the clean one, the decode server
keeps serving and both servers' /metrics count it; without the canary the same fault changes
the answer with HTTP 200. A load whose params a router stripped of P's claim of records is
compared all the same (token, position, chain, head digests): a flipped byte or another
request's blocks named and repaired. A load D cannot compare (a claim of another fold mode)
is taken unverified: the clean answer, no load error, counted and said once; a pair whose
sides fold in two modes, under quarantine behind a router that drops the claim from some
requests' params, fails none and answers as P alone. `make test-vllm-pd` runs these.
"""

import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM step runs these tests in its own venv")
pytestmark = pytest.mark.nixl

from prometheus_driver import Prometheus  # noqa: E402

from torch_kvcanary.testing.pd import claim_dropper, pd_pair  # noqa: E402
from torch_kvcanary.testing.random_models import VOCAB_SIZE  # noqa: E402
from torch_kvcanary.testing.serve import collective_rpc, complete, install_vllm_plugin, mixed_prompts, path_with  # noqa: E402

# Clean requests: mixed lengths sharing prefixes, a few tokens each.
CLEAN_REQUESTS = 200
MAX_TOKENS = 8
# How long P holds a prompt's blocks for D, with the canary: short, so that a test outlives it.
LEASE_S = 5
# The prompts the faults hit: of one length (so that one's blocks can stand for another's), two blocks and more.
FAULTED = [list(range(100 + 7 * k, 100 + 7 * k + 80)) for k in range(7)]
# The faults injected between P and D, each on a prompt of its own (FAULTED[index]; "other
# request's blocks" reads FAULTED[index + 1]'s blocks as its own).
FAULT_PROMPTS = {"flip on prefill": 0, "flip on decode": 1, "other request's blocks": 2, "transfer cut short": 6}

# A vLLM general plugin of the test's own, installed for the servers' processes through
# PYTHONPATH (a distribution's metadata beside its module). It flips a byte of a block of
# the KV cache NIXL registered (at its address, as NIXL reads and writes it): on the prefill
# side when the test calls /collective_rpc (VLLM_SERVER_DEV_MODE=1), on the decode side in
# the step NIXL reports a request's blocks landed, once the file ARM names "decode-flip". It
# cuts the decode side's next read short (its last block not read) once ARM names "decode-cut".
FAULT_PLUGIN = """
import ctypes
import dataclasses
import os

ARM = os.environ.get("KVCANARY_TEST_PD_ARM", "")


def _nixl_worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    return getattr(connector, "inner", None) or connector


# Whether ``fault`` is armed, disarming it: true in one process only where several (the
# tensor-parallel ranks of a server) ask at once, the one whose removal of the file succeeds.
def armed(fault):
    try:
        if open(ARM).read() != fault:
            return False
        os.remove(ARM)
    except FileNotFoundError:
        return False
    return True


def flip(worker, block_id):
    base = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank][0]
    byte = ctypes.c_uint8.from_address(base + int(block_id) * worker.block_stride_per_layer[0] + 3)
    byte.value ^= 0x40  # the top byte of the block's first float32: its exponent
    return int(block_id)


def zero(worker, block_id):
    bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
    for base, stride, length in zip(bases, worker.block_stride_per_layer, worker.block_len_per_layer):
        ctypes.memset(base + int(block_id) * stride, 0, length)


# The decode side's read of a request's blocks without its last block, once ARM names
# "decode-cut": NIXL reads the others and reports the transfer done. The block not read
# keeps what D's pool held there, zeroed first so that the fault does not depend on that.
def cut_short(read_blocks):

    def _read_blocks(self, read_spec, *args, **kwargs):
        if all(len(group) > 1 for group in read_spec.local_block_ids) and armed("decode-cut"):
            for group in read_spec.local_block_ids:
                zero(self, group[-1])
            read_spec = dataclasses.replace(
                read_spec,
                local_block_ids=[list(group[:-1]) for group in read_spec.local_block_ids],
                remote_block_ids=[list(group[:-1]) for group in read_spec.remote_block_ids],
            )
        return read_blocks(self, read_spec, *args, **kwargs)

    return _read_blocks


def register():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.v1.worker.worker_base import WorkerBase

    NixlPullConnectorWorker._read_blocks = cut_short(NixlPullConnectorWorker._read_blocks)

    def kvcanary_test_flip_block(self, block_id):
        return flip(_nixl_worker().connector_worker, block_id)

    WorkerBase.kvcanary_test_flip_block = kvcanary_test_flip_block
    landing = NixlConnector.get_transfer_results

    def get_transfer_results(self, finished_req_ids):
        recving = dict(self.connector_worker._recving_metadata)
        results = landing(self, finished_req_ids)
        if results.finished_recving and armed("decode-flip"):
            for request_id in results.finished_recving:
                flip(self.connector_worker, recving[request_id].local_block_ids[0][0])
        return results

    NixlConnector.get_transfer_results = get_transfer_results
"""


def _fault_plugin(directory):
    return install_vllm_plugin(directory, "kvcanary_test_pd_faults", FAULT_PLUGIN)


class Faults:
    """The faults the plugin injects into a pair's servers, and the disaggregated requests
    the test drives itself (P, then D with P's params) to inject between the two."""

    def __init__(self, model, prefill, decode, arm):
        self.model, self.prefill, self.decode, self.arm = model, prefill, decode, arm

    def forget(self):
        """Empties both servers' prefix caches: each fault's prompt is then pulled whole over NIXL."""
        for server in (self.prefill, self.decode):
            urllib.request.urlopen(urllib.request.Request(server.url + "/reset_prefix_cache", method="POST"), timeout=60).close()

    def prefilled(self, prompt):
        """P's answer's kv_transfer_params for ``prompt``."""
        answer = complete(self.prefill.url, self.model, prompt, 1, kv_transfer_params={"do_remote_decode": True})
        return answer["kv_transfer_params"]

    def decoded(self, prompt, params):
        return complete(self.decode.url, self.model, prompt, MAX_TOKENS, kv_transfer_params=params)

    def flip_on_prefill(self, prompt):
        """A byte of the prompt's first block flipped on P after its prefill, before D reads it."""
        params = self.prefilled(prompt)
        collective_rpc(self.prefill, "kvcanary_test_flip_block", str(params["remote_block_ids"][0][0]))
        return self.decoded(prompt, params)

    def flip_on_decode(self, prompt):
        """A byte of the first block NIXL landed on D flipped after the transfer."""
        self.arm.write_text("decode-flip")
        answer = self.decoded(prompt, self.prefilled(prompt))
        assert not self.arm.exists(), "the plugin did not flip the landed block"
        return answer

    def inject(self, fault):
        """The answer to `fault`'s prompt with the fault injected."""
        index = FAULT_PROMPTS[fault]
        if fault == "other request's blocks":
            return self.other_blocks(FAULTED[index], FAULTED[index + 1])
        inject = {"flip on prefill": self.flip_on_prefill, "flip on decode": self.flip_on_decode, "transfer cut short": self.cut_short}
        return inject[fault](FAULTED[index])

    def cut_short(self, prompt):
        """The transfer of the prompt's blocks cut short: its last block not read, the read reported done."""
        params = self.prefilled(prompt)
        self.arm.write_text("decode-cut")
        answer = self.decoded(prompt, params)
        assert not self.arm.exists(), "the plugin did not cut the transfer short"
        return answer

    def other_blocks(self, prompt, other):
        """D told to read the blocks P prefilled for ``other`` (of the same length) as ``prompt``'s."""
        theirs, params = self.prefilled(other), self.prefilled(prompt)
        self.decoded(other, theirs)  # releases other's blocks on P, which stay cached
        return self.decoded(prompt, {**params, "remote_block_ids": theirs["remote_block_ids"]})


def _prefill_metric(faults, name: str) -> float:
    """A counter of P's /metrics, once P has taken a step: P reports what its records
    server answered since its last step with its next one (a one-token prompt makes one)."""
    complete(faults.prefill.url, faults.model, [1], 1)
    return faults.prefill.metric(name)


def _tokens(answer) -> list[str]:
    assert "error" not in answer, answer
    return answer["choices"][0]["text"]


@pytest.fixture(scope="module")
def workload():
    return mixed_prompts(CLEAN_REQUESTS, VOCAB_SIZE)


def _env(site, arm):
    """The servers' environment: the fault plugin first on the path this process has."""
    return {"PYTHONPATH": path_with(site), "VLLM_SERVER_DEV_MODE": "1", "KVCANARY_TEST_PD_ARM": str(arm)}


@pytest.fixture(scope="module")
def clean(tiny_llama, workload, tmp_path_factory):
    """NIXL without the canary: the clean answers of the workload and of the faulted
    prompts, and what each fault makes of a faulted prompt's answer there."""
    site = _fault_plugin(tmp_path_factory.mktemp("site-off"))
    arm = site / "arm"
    with pd_pair(tiny_llama, policy="off", env=_env(site, arm)) as (prefill, decode, proxy):
        answers = [_tokens(complete(proxy.url, tiny_llama, prompt, n)) for prompt, n in workload]
        faulted = [_tokens(complete(proxy.url, tiny_llama, prompt, MAX_TOKENS)) for prompt in FAULTED]
        single = [_tokens(complete(prefill.url, tiny_llama, prompt, MAX_TOKENS)) for prompt in FAULTED]
        faults = Faults(tiny_llama, prefill, decode, arm)
        faults.forget()
        silent = {fault: faults.inject(fault) for fault in FAULT_PROMPTS}
        assert decode.alive()
        listening = [len(listening_sockets(server)) for server in (prefill, decode)]
    return answers, faulted, single, silent, listening


@pytest.fixture(scope="module")
def canary_pair(tiny_llama, tmp_path_factory):
    site = _fault_plugin(tmp_path_factory.mktemp("site-on"))
    arm = site / "arm"
    with pd_pair(tiny_llama, policy="repair", env=_env(site, arm), lease_s=LEASE_S) as (prefill, decode, proxy):
        yield prefill, decode, proxy, Faults(tiny_llama, prefill, decode, arm)


def test_without_the_canary_each_fault_changes_the_answer_silently(clean):
    _, faulted, single, silent, _ = clean
    assert faulted == single  # disaggregated or not, a clean answer is the same
    for fault, answer in silent.items():
        assert _tokens(answer) != faulted[FAULT_PROMPTS[fault]], f"{fault}: the fault did not change the answer"


def test_clean_requests_through_nixl_are_verified_and_unflagged(clean, canary_pair, tiny_llama, workload):
    answers = clean[0]
    prefill, decode, proxy, faults = canary_pair
    got = [_tokens(complete(proxy.url, tiny_llama, prompt, n)) for prompt, n in workload]
    assert got == answers
    # D computed no prompt but the token each request's first output needs: the rest of
    # each prompt is in D's prefix cache or was pulled over NIXL, every pulled slot verified.
    by_source = {
        source: decode.metric("vllm:prompt_tokens_by_source_total", source=source)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert sum(by_source.values()) == sum(len(prompt) for prompt, _ in workload)
    assert by_source["local_compute"] <= len(workload), by_source
    verified = decode.metric("vllm:kv_canary_transfer_slots_verified_total")
    assert verified == by_source["external_kv_transfer"] > 0, (verified, by_source)
    # P wrote the records of every prompt it handed over.
    assert _prefill_metric(faults, "vllm:kv_canary_transfer_slots_handed_over_total") >= verified
    assert decode.metric("vllm:kv_canary_transfer_slots_failed_total") == 0
    assert decode.metric("vllm:kv_canary_blocks_repaired_total") == 0
    assert decode.metric("vllm:kv_canary_violations_total") == 0
    assert not [line for line in decode.canary_lines() if line[2] == "WARNING"]


def listening_sockets(server) -> list[tuple[str, int]]:
    """The (address, port) of each TCP socket listening in the server's processes (its own
    and its descendants'), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = set(), [server._process.pid]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        todo.extend(children.get(pid, []))
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state, inode = line.split()[1], line.split()[3], line.split()[9]
            if state == "0A" and inode in inodes:  # LISTEN
                address, port = local.rsplit(":", 1)
                found.append((address, int(port, 16)))
    return sorted(found)


def test_the_canary_listens_on_no_socket_of_its_own(clean, canary_pair):
    """P and D with the canary listen on as many TCP sockets as without it (vLLM's HTTP
    server, NIXL's side channel, vLLM's and UCX's own): the records ride with NIXL's reads."""
    prefill, decode, _, _ = canary_pair
    with_canary = [listening_sockets(server) for server in (prefill, decode)]
    assert [len(sockets) for sockets in with_canary] == clean[4], with_canary
    for server, sockets in zip((prefill, decode), with_canary):
        assert ("0100007F", server.port) in sockets, sockets  # the sockets are the servers' own


def _repair_counts(decode) -> tuple[float, float]:
    return decode.metric("vllm:kv_canary_transfer_slots_failed_total"), decode.metric("vllm:kv_canary_blocks_repaired_total")


def _assert_repaired(faults, fault: str, clean_answer: str) -> None:
    """``fault``, injected into the pair of ``faults`` with both prefix caches emptied, is
    named as a load error and repaired: the answer is ``clean_answer``, D stays up and counts it."""
    decode = faults.decode
    before = _repair_counts(decode)
    faults.forget()
    assert _tokens(faults.inject(fault)) == clean_answer
    assert decode.alive()
    after = _repair_counts(decode)
    assert after[0] > before[0] and after[1] > before[1], (fault, before, after)
    assert any("differ from the prefill side's records" in line[3] for line in decode.canary_lines())


@pytest.mark.parametrize("fault", list(FAULT_PROMPTS))
def test_each_fault_is_a_load_error_repaired_to_the_clean_answer(fault, clean, canary_pair):
    faulted = clean[1]
    _assert_repaired(canary_pair[3], fault, faulted[FAULT_PROMPTS[fault]])


def _stripped(params: dict) -> dict:
    """``params`` as a router hands them on that rebuilt them without P's claim of records."""
    return {key: value for key, value in params.items() if key != "kv_canary_records"}


def _assert_named_and_repaired(faults, prompt, answer, clean_answer, before) -> None:
    """The load of ``prompt``, its params stripped of P's claim, was a load error repaired to
    ``clean_answer`` (D's counts before it: ``before``), compared all the same and counted unclaimed."""
    decode = faults.decode
    assert _tokens(answer) == clean_answer and decode.alive()
    after = _repair_counts(decode), decode.metric("vllm:kv_canary_transfers_unclaimed_total")
    assert after[0][0] > before[0][0] and after[0][1] > before[0][1] and after[1] == before[1] + 1, (before, after)
    assert any("differ from the prefill side's records" in line[3] for line in decode.canary_lines())


def test_a_router_stripping_the_claim_leaves_a_flipped_byte_named_and_repaired(canary_pair, tiny_llama):
    """A byte of P's KV flipped for a request whose params a router stripped of P's claim:
    D, which loads only from a P registering the records' region, compares the load all the
    same, names it as a load error and repairs it to the clean answer (P's own)."""
    prefill, decode, _, faults = canary_pair
    prompt = FAULTED[FAULT_PROMPTS["flip on prefill"]]
    clean_answer = _tokens(complete(prefill.url, tiny_llama, prompt, MAX_TOKENS))
    before = _repair_counts(decode), decode.metric("vllm:kv_canary_transfers_unclaimed_total")
    faults.forget()
    params = _stripped(faults.prefilled(prompt))
    collective_rpc(prefill, "kvcanary_test_flip_block", str(params["remote_block_ids"][0][0]))
    _assert_named_and_repaired(faults, prompt, faults.decoded(prompt, params), clean_answer, before)


def test_a_stripped_claim_with_another_requests_blocks_is_named_and_repaired(canary_pair, tiny_llama):
    """D told to read the blocks of another request P prefilled (a forged remote_block_ids),
    the params stripped of P's claim: named as a load error and repaired to the clean answer."""
    prefill, decode, _, faults = canary_pair
    index = FAULT_PROMPTS["other request's blocks"]
    prompt, other = FAULTED[index], FAULTED[index + 1]
    clean_answer = _tokens(complete(prefill.url, tiny_llama, prompt, MAX_TOKENS))
    faults.forget()
    theirs, params = faults.prefilled(other), faults.prefilled(prompt)
    faults.decoded(other, theirs)  # releases other's blocks on P, which stay cached
    before = _repair_counts(decode), decode.metric("vllm:kv_canary_transfers_unclaimed_total")
    answer = faults.decoded(prompt, _stripped({**params, "remote_block_ids": theirs["remote_block_ids"]}))
    _assert_named_and_repaired(faults, prompt, answer, clean_answer, before)


def test_a_load_d_cannot_compare_is_taken_unverified_and_said_once(canary_pair, tiny_llama):
    """D handed P's params without P's claim of records (a router that rebuilt them), and
    with a claim of another fold mode (P serving another KVCANARY_VLLM_MODE), each twice:
    no load is an error (the answer is the clean one, nothing failed or repaired). The loads
    without a claim are compared all the same, each slot verified, counted unclaimed and said
    once; those of another mode are counted unverified under mode_mismatch and said once for
    the prefill engine, with the fix. The clean answer is P's own, served whole
    (disaggregated or not, a clean answer is the same)."""
    prefill, decode, _, faults = canary_pair
    clean_answer = _tokens(complete(prefill.url, tiny_llama, FAULTED[4], MAX_TOKENS))
    unverified, unclaimed = "vllm:kv_canary_transfers_unverified_total", "vllm:kv_canary_transfers_unclaimed_total"

    def counts():
        verified = decode.metric("vllm:kv_canary_transfer_slots_verified_total")
        return _repair_counts(decode), decode.metric(unclaimed), decode.metric(unverified, reason="mode_mismatch"), verified

    before = counts()

    def dropped(params):
        del params["kv_canary_records"]
        return params

    def other_mode(params):
        params["kv_canary_records"]["mode"] = "partial"
        return params

    for change in (dropped, dropped):
        faults.forget()  # D pulls the whole prompt each time
        answer = faults.decoded(FAULTED[4], change(faults.prefilled(FAULTED[4])))
        assert _tokens(answer) == clean_answer and decode.alive()
    compared = counts()
    assert compared[:3] == (before[0], before[1] + 2, before[2]) and compared[3] > before[3], (before, compared)
    for change in (other_mode, other_mode):
        faults.forget()
        answer = faults.decoded(FAULTED[4], change(faults.prefilled(FAULTED[4])))
        assert _tokens(answer) == clean_answer and decode.alive()
    assert counts() == (before[0], before[1] + 2, before[2] + 2, compared[3]), (before, compared, counts())
    said = [line for line in decode.canary_lines() if "is taken unverified" in line[3]]
    assert [line[2] for line in said] == ["WARNING"] and "mode_mismatch" in said[0][3], said
    assert "set KVCANARY_VLLM_MODE to the same value on both sides" in said[0][3]
    said = [line for line in decode.canary_lines() if "compared all the same" in line[3]]
    assert [line[2] for line in said] == ["WARNING"], said


def test_loads_taken_unverified_page_in_a_real_prometheus_and_stripped_claims_do_not(canary_pair, tmp_path):
    """A real Prometheus scraping D with the shipped rules (their alerts' for: 1 s,
    `prometheus_driver`): three loads whose claim was stripped are compared, and
    KvCanaryTransfersUnverifiedRatio stays inactive; three whose claim names another fold
    mode are taken unverified, and it fires."""
    prefill, decode, _, faults = canary_pair
    ratio = "KvCanaryTransfersUnverifiedRatio"

    def loads(change) -> None:
        for prompt in FAULTED[:3]:
            faults.forget()
            faults.decoded(prompt, change(faults.prefilled(prompt)))

    def scraped(name: str) -> bool:  # Prometheus holds the value D exports now
        exported = decode.metric(name)
        return sum(prometheus.query(name).values()) == exported

    with Prometheus(tmp_path, f"127.0.0.1:{decode.port}") as prometheus:
        prometheus.wait_for(lambda: prometheus.query("vllm:kv_canary_transfers_loaded_total"), "D's counters scraped")
        loads(_stripped)
        prometheus.wait_for(lambda: scraped("vllm:kv_canary_transfers_unclaimed_total"), "the unclaimed loads scraped")
        time.sleep(3)  # a few evaluations of the rules
        assert prometheus.alert_states()[ratio] == "inactive"

        def other_mode(params):
            params["kv_canary_records"]["mode"] = "partial"
            return params

        loads(other_mode)
        states = prometheus.wait_for(lambda: _firing(prometheus, ratio), f"{ratio} firing")
    assert states[ratio] == "firing"


def _firing(prometheus, name: str) -> dict[str, str] | None:
    states = prometheus.alert_states()
    return states if states[name] == "firing" else None


# Of the FAULTED prompts, those whose params the router of the mixed pair rebuilds without P's claim.
CLAIM_DROPPED = (1, 3, 5)


def test_a_pair_in_two_fold_modes_behind_a_router_dropping_the_claim_fails_nothing(tiny_llama):
    """P folding 16 bytes of each slot (KVCANARY_VLLM_MODE=partial) and D the whole slot (all),
    under quarantine, behind a router that drops P's claim from some requests' params: no
    request fails, each answers as P alone serves it; D takes each load whose claim arrived
    unverified, counted under mode_mismatch, and compares each load whose claim was dropped
    by token, position, chain and head digests, which do not depend on the fold mode: each
    slot verified, counted unclaimed (each prompt is one load: no two share a block); each
    said once for the prefill engine."""
    dropped = {FAULTED[index][0] for index in CLAIM_DROPPED}
    modes = ({"KVCANARY_VLLM_MODE": "partial"}, {"KVCANARY_VLLM_MODE": "all"})
    route = claim_dropper(lambda body: body["prompt"][0] in dropped)
    with pd_pair(tiny_llama, policy="quarantine", side_env=modes, route=route) as (prefill, decode, proxy):
        answers = [complete(proxy.url, tiny_llama, prompt, MAX_TOKENS) for prompt in FAULTED]
        alone = [_tokens(complete(prefill.url, tiny_llama, prompt, MAX_TOKENS)) for prompt in FAULTED]
        assert [_tokens(answer) for answer in answers] == alone
        unverified = "vllm:kv_canary_transfers_unverified_total"
        counts = decode.metric(unverified), decode.metric(unverified, reason="mode_mismatch")
        assert counts == (len(FAULTED) - len(CLAIM_DROPPED),) * 2, counts
        assert decode.metric("vllm:kv_canary_transfers_unclaimed_total") == len(CLAIM_DROPPED)
        pulled = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        verified = decode.metric("vllm:kv_canary_transfer_slots_verified_total")
        assert 0 < verified < pulled, (verified, pulled)  # the dropped claims' loads, compared; the others not
        assert decode.metric("vllm:kv_canary_requests_failed_total") == decode.metric("vllm:kv_canary_transfer_slots_failed_total") == 0
        said = [(line[2], "is taken unverified" in line[3]) for line in decode.canary_lines() if "prefill engine" in line[3]]
        assert sorted(said) == [("WARNING", False), ("WARNING", True)], said


def _fill_kv_cache(server, model) -> None:
    """Prompts of P's own, each of distinct tokens, until P has written every block of its
    KV cache since the call: freed blocks are reused in the order they were freed."""
    info = server.metrics()
    blocks = int(re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', info).group(1))
    length = 480
    for k in range(blocks * 32 // length + 2):
        complete(server.url, model, [(1000 + 13 * k + i) % VOCAB_SIZE for i in range(length)], 1)


def test_a_request_read_after_its_lease_expired_and_its_blocks_were_reused_is_a_load_error(clean, canary_pair, tiny_llama):
    """D reads P's blocks after P's lease on them expired and P reused them for other
    prompts: the blocks hold other KV than the records that rode with them say, so they are
    a load error, repaired (vLLM counts no failed transfer for it: NIXL's read itself
    succeeds)."""
    faulted = clean[1]
    prefill, decode, _, faults = canary_pair
    before = decode.metric("vllm:kv_canary_transfer_slots_failed_total")
    faults.forget()
    params = faults.prefilled(FAULTED[5])
    time.sleep(LEASE_S + 1)
    faults.prefilled(FAULTED[0])  # a step on P after the lease: it frees the blocks
    faults.forget()
    _fill_kv_cache(prefill, tiny_llama)
    answer = faults.decoded(FAULTED[5], params)
    assert _tokens(answer) == faulted[5] and decode.alive()
    assert decode.metric("vllm:kv_canary_transfer_slots_failed_total") > before
    assert any("differ from the prefill side's records" in line[3] for line in decode.canary_lines())


def test_a_block_p_repairs_before_the_handover_is_handed_over_recomputed(clean, canary_pair):
    """A byte of a block cached on P flipped; the next request reading it through P's prefix
    cache has P's own canary flag it, and vLLM recomputes the request on P before handing it
    over: D compares with the recomputed KV's records and finds nothing wrong."""
    faulted = clean[1]
    prefill, decode, _, faults = canary_pair
    faults.forget()
    first = faults.prefilled(FAULTED[4])
    assert _tokens(faults.decoded(FAULTED[4], first)) == faulted[4]  # P's blocks stay in its prefix cache
    urllib.request.urlopen(urllib.request.Request(decode.url + "/reset_prefix_cache", method="POST"), timeout=60).close()
    collective_rpc(prefill, "kvcanary_test_flip_block", str(first["remote_block_ids"][0][0]))
    repaired_on_p = _prefill_metric(faults, "vllm:kv_canary_blocks_repaired_total")
    failed_on_d, repaired_on_d = _repair_counts(decode)
    verified_on_d = decode.metric("vllm:kv_canary_transfer_slots_verified_total")
    answer = faults.decoded(FAULTED[4], faults.prefilled(FAULTED[4]))
    assert _tokens(answer) == faulted[4] and decode.alive()
    assert _prefill_metric(faults, "vllm:kv_canary_blocks_repaired_total") > repaired_on_p  # P's canary caught it
    assert decode.metric("vllm:kv_canary_transfer_slots_verified_total") > verified_on_d  # D pulled the prompt from P
    assert _repair_counts(decode) == (failed_on_d, repaired_on_d)  # and found the handed-over KV clean


def test_under_quarantine_a_fault_fails_only_its_request(clean, tiny_llama, tmp_path_factory):
    faulted = clean[1]
    site = _fault_plugin(tmp_path_factory.mktemp("site-quarantine"))
    arm = site / "arm"
    with pd_pair(tiny_llama, policy="quarantine", env=_env(site, arm)) as (prefill, decode, proxy):
        faults = Faults(tiny_llama, prefill, decode, arm)
        answer = faults.flip_on_decode(FAULTED[1])
        assert "error" in answer, answer
        assert decode.alive()
        faults.forget()
        assert [_tokens(complete(proxy.url, tiny_llama, prompt, MAX_TOKENS)) for prompt in FAULTED] == faulted
        assert decode.metric("vllm:kv_canary_requests_failed_total") == 1
        assert decode.metric("vllm:kv_canary_transfer_slots_failed_total") > 0


# Heterogeneous tensor parallelism: NIXL reads a prefill rank's heads into several decode
# ranks, or several prefill ranks' heads into one decode rank (the tiny model has two KV
# heads). What each decode rank compares is then its heads' digests, not folds.
HETEROGENEOUS = [(1, 2), (2, 1)]
# Clean requests of the workload through a heterogeneous pair.
HETEROGENEOUS_REQUESTS = 40


@pytest.fixture(scope="module", params=HETEROGENEOUS, ids=lambda tps: f"prefill-tp{tps[0]}-decode-tp{tps[1]}")
def heterogeneous_pair(request, tiny_llama, tmp_path_factory):
    """A pair whose sides shard the heads differently, with the canary, and its clean
    answers of the faulted prompts."""
    site = _fault_plugin(tmp_path_factory.mktemp("site-heterogeneous"))
    arm = site / "arm"
    with pd_pair(tiny_llama, policy="repair", env=_env(site, arm), tensor_parallel=request.param) as (prefill, decode, proxy):
        answers = [_tokens(complete(proxy.url, tiny_llama, prompt, MAX_TOKENS)) for prompt in FAULTED]
        yield request.param, Faults(tiny_llama, prefill, decode, arm), proxy, answers


def test_heterogeneous_tp_clean_requests_compare_head_digests_and_pass(clean, heterogeneous_pair, tiny_llama, workload):
    (prefill_tp, decode_tp), faults, proxy, answers = heterogeneous_pair
    decode = faults.decode
    assert answers == clean[1]  # the answers of a pair of one rank per side, and of P alone
    some = workload[:HETEROGENEOUS_REQUESTS]
    assert [_tokens(complete(proxy.url, tiny_llama, prompt, n)) for prompt, n in some] == clean[0][: len(some)]
    # Each decode rank verified its heads of every pulled slot (vLLM sums the ranks' counters).
    verified = decode.metric("vllm:kv_canary_transfer_slots_verified_total")
    assert verified == decode_tp * decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    assert decode.metric("vllm:kv_canary_transfer_slots_failed_total") == 0
    assert decode.metric("vllm:kv_canary_violations_total") == 0
    assert not [line for line in decode.canary_lines() if line[2] == "WARNING"]
    said = [(process, message) for process, _, _, message in decode.canary_lines() if "compares each slot's token" in message]
    sources = "[0, 1]" if prefill_tp > decode_tp else "[0]"
    assert len(said) == decode_tp and all(f"with prefill ranks {sources} of a prefill side of {prefill_tp}" in m for _, m in said), said


@pytest.mark.parametrize("fault", ["flip on prefill", "flip on decode"])
def test_heterogeneous_tp_faults_are_load_errors_repaired(fault, heterogeneous_pair):
    _, faults, _, answers = heterogeneous_pair
    _assert_repaired(faults, fault, answers[FAULT_PROMPTS[fault]])
