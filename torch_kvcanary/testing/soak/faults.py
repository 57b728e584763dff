"""The chaos soaks' fault injector (`chaos`, `chaos_pd`): a vLLM general plugin of the soaks'
own, installed into a temporary site directory by `harness.install_chaos_plugin` and
reached through vLLM's /collective_rpc (a server with VLLM_SERVER_DEV_MODE=1).

`chaos_arm(kind)` queues a fault; the worker injects it at the first engine step that has a
target of its kind, after the model runner's `_update_states` (the step's requests and block
tables are current) and before its `_model_forward` (where the canary verifies what the
step reads), and records what it hit; `chaos_report()` answers the records as JSON. The kinds:

- ``single``: one bit of a slot in a full block that one request of the step reads and no
  other live request holds;
- ``shared``: one bit of a slot in a full block that two or more requests of the step read
  (a prefix block shared through the prefix cache);
- ``preempted``: one bit of a slot in a block a preempted request held when it was preempted
  and reads again at the step that resumes it (its own block, kept by the prefix cache);
- ``table``: a block-table entry of a request of the step pointing at another live request's
  block (every byte intact; the canary's token and chain checks see it, and under repair and
  quarantine the connector reports a block of that request's own: it alone is recomputed or
  failed);
- ``handover`` (a prefill server of a P/D pair): one bit of the slot of a prompt's
  next-to-last position, in the step that completes the prompt, after the connector wrote
  the records that travel with its blocks to the decode server: what the decode server
  loads differs from them. (The position's block is the prompt's last, or its last full
  one: rarely a prefix the decode server holds already.)

A bit flip is the top byte's bit 4 of the first element of the slot's bytes in the canary's
first source (the first layer's K), which every fold covers: for float32 an exponent bit.

This file is the plugin's source: it imports nothing of this package and is copied as is.
"""

import json
import logging
import random

logger = logging.getLogger("vllm.kvcanary_chaos")

ARMED: list = []  # kinds waiting for a target, oldest first
INJECTED: list = []  # a dict per injected fault
_PREEMPTED: dict = {}  # request id -> the block ids it held when preempted (runner.requests keeps them stale)
_STEP = [0]
_RNG = random.Random(0)
KINDS = ("single", "shared", "preempted", "table", "handover")


def register():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(GPUModelRunner, "_kvcanary_chaos_hooked", False):
        return
    update_states = GPUModelRunner._update_states

    def update_states_with_chaos(self, scheduler_output):
        for rid in scheduler_output.preempted_req_ids or ():
            state = self.requests.get(rid)
            if state is not None:
                _PREEMPTED[rid] = list(state.block_ids[0])
        result = update_states(self, scheduler_output)
        _STEP[0] += 1
        for rid in scheduler_output.finished_req_ids:
            _PREEMPTED.pop(rid, None)
        if ARMED:
            try:
                _inject(self, scheduler_output)
            except Exception:  # the injector's own bug: logged, never the engine's
                logger.exception("kvcanary-chaos: the injector failed")
        for rid in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            _PREEMPTED.pop(rid, None)
        return result

    def chaos_arm(self, kind):
        if kind not in KINDS:
            raise ValueError(f"kvcanary-chaos: no fault kind {kind!r}, the kinds are {KINDS}")
        ARMED.append(kind)
        return len(ARMED)

    def chaos_report(self):
        return json.dumps({"injected": INJECTED, "armed": ARMED, "steps": _STEP[0]})

    GPUModelRunner._update_states = update_states_with_chaos
    GPUModelRunner._kvcanary_chaos_hooked = True
    _hook_handover()
    WorkerBase.chaos_arm = chaos_arm
    WorkerBase.chaos_report = chaos_report


def _hook_handover():
    """The ``handover`` kind: after KvCanaryConnector's ``wait_for_save``, where a prefill
    server wrote the records of the prompts the step completed."""
    from torch_kvcanary.integrations.vllm.connector.facade import KvCanaryConnector

    wait_for_save = KvCanaryConnector.wait_for_save

    def wait_for_save_with_chaos(self):
        wait_for_save(self)
        handovers = getattr(self._orders, "handovers", None)
        if "handover" in ARMED and handovers:
            try:
                _inject_handover(handovers)
            except Exception:
                logger.exception("kvcanary-chaos: the injector failed")

    KvCanaryConnector.wait_for_save = wait_for_save_with_chaos


def _inject_handover(handovers):
    from torch_kvcanary.integrations.vllm import plugin

    canary = plugin.active()
    orders = [order for order in handovers if order.tokens >= 2]
    if canary is None or not orders:
        return
    order = _RNG.choice(orders)
    position = order.tokens - 2
    block = order.block_ids[position // canary.block_size]
    offset = position % canary.block_size
    _flip(canary, block, offset)
    ARMED.remove("handover")
    record = dict(
        kind="handover", request=order.request_id, block=block, index=position // canary.block_size, offset=offset,
        position=position, slot=block * canary.block_size + offset, step=_STEP[0], holders=[order.request_id],
        readers=[order.request_id],
    )  # fmt: skip
    INJECTED.append(record)
    logger.info("kvcanary-chaos: injected %s", json.dumps(record, sort_keys=True))


def _flip(canary, block, offset):
    """Flips the top byte's bit 4 of the first element of the slot's bytes in the canary's first source."""
    import torch

    view = canary.canary.sources[0].as_view()
    first = view[block, offset]
    first = first[(0,) * first.dim()]
    size = first.element_size()
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    first.view(integer).bitwise_xor_(1 << (8 * (size - 1) + 4))


def _inject(runner, scheduler_output):
    from torch_kvcanary.integrations.vllm import plugin

    canary = plugin.active()
    if canary is None:
        return
    block_size = canary.block_size
    scheduled = scheduler_output.num_scheduled_tokens
    resumed = set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
    # Live requests: those holding blocks now (a preempted one holds none until it resumes).
    live = {rid: state for rid, state in runner.requests.items() if rid not in _PREEMPTED or rid in resumed}
    holders: dict[int, list[str]] = {}  # block -> live requests with it in their computed context (vLLM's rule)
    full: dict[str, list[int]] = {}  # request of the step -> its full computed blocks, read by this step
    for rid, state in live.items():
        blocks = list(state.block_ids[0])
        computed = state.num_computed_tokens
        for block in blocks[: -(-computed // block_size)]:
            holders.setdefault(block, []).append(rid)
        if rid in scheduled:
            full[rid] = blocks[: computed // block_size]
    hit = {fault["block"] for fault in INJECTED}
    for kind in list(ARMED):
        record = _target(kind, runner, canary, live, holders, full, resumed, hit)
        if record is None:
            continue
        ARMED.remove(kind)
        record.update(kind=kind, step=_STEP[0], holders=sorted(holders.get(record["block"], [])))
        record["readers"] = sorted(r for r in record["holders"] if r in scheduled)
        INJECTED.append(record)
        hit.add(record["block"])
        logger.info("kvcanary-chaos: injected %s", json.dumps(record, sort_keys=True))


def _target(kind, runner, canary, live, holders, full, resumed, hit):
    block_size = canary.block_size
    choices = []  # (request, block index in it, block)
    for rid, blocks in full.items():
        for index, block in enumerate(blocks):
            if block in hit:
                continue
            readers = [r for r in holders[block] if r in full]
            if kind == "single" and holders[block] == [rid]:
                choices.append((rid, index, block))
            elif kind == "shared" and len(readers) >= 2 and rid == readers[0]:
                choices.append((rid, index, block))
            elif kind == "preempted" and rid in resumed and block in _PREEMPTED.get(rid, ()):
                choices.append((rid, index, block))
            elif kind == "table":
                choices.append((rid, index, block))
    if not choices:
        return None
    rid, index, block = _RNG.choice(choices)
    state = live[rid]
    offset = _RNG.randrange(block_size)
    position = index * block_size + offset
    tokens = list(state.prompt_token_ids or []) + list(state.output_token_ids)
    record = dict(request=rid, block=block, index=index, offset=offset, position=position, token=tokens[position])
    if kind == "table":
        others = [b for b, owners in holders.items() if rid not in owners and b not in hit]
        if not others:
            return None
        other = _RNG.choice(others)
        row = runner.input_batch.req_id_to_index[rid]
        runner.input_batch.block_table.block_tables[0].block_table.np[row, index] = other
        record.update(points_at=other, owners_of_points_at=sorted(holders[other]), slot=block * block_size + offset)
        return record
    _flip(canary, block, offset)
    record.update(slot=block * block_size + offset)
    return record
