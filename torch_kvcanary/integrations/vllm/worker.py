"""The canary of one vLLM model runner (`WorkerCanary`): what it watches, and each engine
step's verify, record and poll around the model forward (its buffers: `step_buffers`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ... import digest, layouts
from ...canary import KvCanary
from ...paged_step import PagedStep, StepPhase
from ...violations import KvCorruptionError, Violation, ViolationKind
from . import adapter
from .config import CONNECTOR_POLICIES, POLICY_ENV, EngineFacts, Settings, connector_needs, connector_refusal, refusal
from .reports import LAUNCH_TAG, Reports, byte_only, report, slot_lines, start_line, violation_line
from .request_roots import RequestRoots
from .step_buffers import StepRows, TokenCopy
from .worker_port import WorkerPort

logger = logging.getLogger(adapter.LOGGER)


@dataclass
class _StepRun:
    """One engine step as the canary runs it: its number, the forward's `adapter.Step` and
    where the context's tokens are checked against (None: they are not)."""

    number: int
    forward: adapter.Step
    history: adapter.TokenHistory | None
    num_tokens: int


# The steps whose request ids a violation read late can still be named by.
_NAMED_STEPS = 8


class WorkerCanary:
    """The canary of one vLLM model runner: `canary` (one `KvCanary` over the distinct
    bytes of every attention layer: K and V, or MLA's latent), `kv_caches` (the distinct
    layer tensors it watches, in group and layer order), `groups` (the watched KV cache
    groups, `adapter.KvCacheGroup`), `model_runner` (vLLM's) and `runner_view` (the adapter's
    view of it, `adapter.RunnerView`), `block_table` (vLLM's, of the first watched group),
    `policy` (one of `POLICIES`, read by each step), `connector` (this
    worker's `CONNECTOR`, or None), `drill` (the fault drills' probability per step),
    `reports` (what the log has said about violations), `faults` (exceptions of the plugin's
    own code in a step), `on` (False once such a fault turned it off) and `request_roots`
    (each request's identity, `request_roots.RequestRoots`, handed to each step's call).

    The KV cache groups of a model share one pool of blocks (vLLM's hybrid allocator
    overlays their layers on the same tensors, and gives each block to one group at a
    time), so one canary covers them all, slot = block * block_size + offset, and each
    group verifies and records through its own block table and slot mapping.

    The KV connector (`connector.KvCanaryConnector`) works through `port`, a
    `connector.CanaryPort` (`worker_port.WorkerPort`).

    ``runner_view`` reads the runner in place of the adapter's view of a vLLM runner (the
    tests' and benchmarks' fake runner: `tests/vllm_plugin/fake_runner.py`)."""

    def __init__(self, model_runner, chosen: Settings, *, runner_view: adapter.RunnerView | None = None):
        self.model_runner = model_runner
        self.policy = chosen.policy
        self.drill = chosen.drill
        self.reports = Reports(chosen.summary_seconds)
        self.every = chosen.every
        self.max_repairs = chosen.max_repairs
        self._steps = 0
        self.faults = 0
        self.on = True
        self.runner_view = adapter.runner_view(model_runner) if runner_view is None else runner_view
        self._check_release()
        self.connector = self._connector()
        unwatched = self.runner_view.unwatched_group_kinds()
        if unwatched:
            raise ValueError(
                f"kv-canary: the vLLM plugin watches KV cache groups of {', '.join(adapter.WATCHED_SPECS)} and skips "
                f"{', '.join(adapter.SKIPPED_SPECS)}; this model has {', '.join(unwatched)}: unset {POLICY_ENV} to serve it without the canary"
            )
        # A drafter's layers are watched where its writes are seen before the step is recorded,
        # and no KV connector of ours needs the step's verdict right after the forward.
        self.watches_drafter = (
            self.runner_view.drafter_writes_seen and self.connector is None and bool(self.runner_view.drafter_layer_names())
        )
        self.groups = self.runner_view.kv_cache_groups(drafter=self.watches_drafter)
        if not self.groups:
            raise ValueError(
                f"kv-canary: the vLLM plugin watches attention KV cache groups; this model has "
                f"{self.runner_view.kv_cache_group_kinds()}: unset {POLICY_ENV} to serve it without the canary"
            )
        block_sizes = sorted({group.block_size for group in self.groups})
        if len(block_sizes) != 1:
            raise ValueError(
                f"kv-canary: the vLLM plugin watches KV cache groups of one block size, this model's are "
                f"{self.runner_view.kv_cache_group_kinds()} in blocks of {block_sizes}: unset {POLICY_ENV} to serve it without the canary"
            )
        self.layer_names = [layer.name for group in self.groups for layer in group.layers]
        layout = self.runner_view.kv_cache_layout
        self.block_table = self.groups[0].block_table
        self.block_size = block_sizes[0]
        self.kv_caches: list[torch.Tensor] = []
        head_views: list[list[tuple[int, torch.Tensor]]] = []  # per cache: (digest kind, [blocks, block_size, heads, ...])
        sources, backends = [], set()
        for layer in (layer for group in self.groups for layer in group.layers):
            kv_cache = layer.kv_cache
            if any(_same_view(kv_cache, seen) for seen in self.kv_caches):
                continue  # a layer that shares another layer's cache, or another group's layer over the same pool
            self.kv_caches.append(kv_cache)
            backends.add(layer.backend)
            sources += self._sources(layer, layout)
            head_views.append(digest.vllm_head_views(layer.kv_cache, layer.backend, layout))
        self.canary = KvCanary(sources, mode=chosen.mode, on_violation=self._report, name=LAUNCH_TAG, padding_slot=adapter.NULL_SLOT)
        self._check_tokens = self.runner_view.token_history_current
        self._token_copy = TokenCopy(*self.runner_view.token_rows, self.canary.device) if self.runner_view.keeps_token_copy else None
        self.blocks_packed = any(b in layouts.VLLM_BLOCK_PACKED_BACKENDS for b in backends)
        # Every group's step in one call (two around the forward on a block-packed backend).
        self._paged = PagedStep(
            self.canary, [g.device_block_table for g in self.groups], [g.slot_mapping for g in self.groups], block_size=self.block_size,
            sliding_windows=[g.sliding_window for g in self.groups], chunk_sizes=[g.attention_chunk_size for g in self.groups],
        )  # fmt: skip
        self._last_phase = StepPhase.AFTER_FORWARD if self.blocks_packed else StepPhase.WHOLE_STEP
        self.request_roots = RequestRoots(self.runner_view)
        self._rows = StepRows(self.canary.device, self.request_roots)
        self._names: dict[int, list[str]] = {}  # the request ids of recent steps, by step
        self._violations_seen = 0
        self._ring_overflow = 0
        self._no_slots = torch.zeros(0, dtype=torch.int64, device=self.canary.device)
        self._flagged = self._no_slots  # the slots verify flagged in the last step read
        self._overflowed = False  # whether the current step's violations overflowed the ring (`step_overflowed`)
        self._first_detections: set[int] = set()  # the current step's (`step_first_detections`)
        self._misreads: list[Violation] = []  # the current step's reads through a wrong mapping (`step_misreads`)
        self._step = -1  # the current step's number
        self.step_forward: adapter.Step | None = None  # the current step's forward, once read
        mla = any(b in layouts.VLLM_MLA_BACKENDS for b in backends)
        self.port = WorkerPort(self, head_views=head_views, mla=mla)
        if self.connector is not None:
            self.connector.attach(self.port)
        # Each step waits for its verdict where the connector acts on it in that step.
        self.waits_for_verdicts = self.connector is not None and self.connector.needs_step_verdicts()
        copy_bytes = 0 if self._token_copy is None else self._token_copy.nbytes
        logger.info("%s", start_line(self, layout, token_copy_bytes=copy_bytes, scratch_bytes=self._paged.scratch.nbytes))

    def _check_release(self) -> None:
        """Refuses a policy that can stop the step (all but log: raise on any violation,
        repair and quarantine on one that names no request of the step) under tensor parallelism on a vLLM release
        whose engine hangs rather than ends when one rank raises (`adapter.Release`)."""
        if self.policy == "log" or self.runner_view.tensor_parallel_size == 1:
            return
        version = adapter.vllm_version()
        if not adapter.release(version).ends_engine_when_a_rank_raises:
            raise refusal(
                f"{POLICY_ENV}={self.policy} stops the engine step with an exception, and on vLLM {version} the other "
                f"tensor-parallel ranks then wait for the raising one: the engine would hang instead of stopping. Serve "
                f"with {POLICY_ENV}=log, one tensor-parallel rank, or vLLM 0.32 or later"
            )

    def _connector(self):
        """This worker's `CONNECTOR`, or None; refuses another KV connector that loads KV
        (`connector.check_unwrapped`), and a policy or a drill the engine cannot serve
        (`config.connector_needs`)."""
        connector = self.runner_view.kv_connector()
        ours = connector if connector is not None and _is_canary_connector(connector) else None
        if connector is not None and ours is None:
            from .connector import check_unwrapped  # imports vLLM's connector classes, which a configured connector has loaded

            check_unwrapped(self.runner_view.kv_transfer_config)
        # The facts only the connector policies need are read for them alone (a runner whose
        # engine has no connector need not answer them).
        runner, reports = self.runner_view, self.policy in CONNECTOR_POLICIES
        engine = EngineFacts(
            canary_connector=ours is not None,
            model_runner_v2=runner.is_v2,
            kv_load_failure_policy=runner.kv_load_failure_policy if ours is not None else None,
            async_scheduling=reports and runner.async_scheduling,
            kv_cache_group_kinds=tuple(runner.kv_cache_group_kinds()) if reports else (),
        )
        needs = connector_needs(self.policy, self.drill, engine)
        if needs:
            raise connector_refusal(self.policy, self.drill, needs)
        return ours

    def _sources(self, layer: adapter.AttentionLayer, layout: str) -> tuple:
        """The fold sources of one layer's cache: MLA's latent rows, or K and V."""
        kv_cache = layer.kv_cache
        if layer.backend in layouts.VLLM_MLA_BACKENDS:
            if kv_cache.dim() != 3 or kv_cache.shape[1] != self.block_size:
                raise ValueError(
                    f"kv-canary: vLLM MLA layer {layer.name} is {tuple(kv_cache.shape)}, not the token-major "
                    f"[num_blocks, {self.block_size}, latent] layer the plugin can watch"
                )
            return layouts.vllm_mla(kv_cache)
        if kv_cache.dim() != 4 or kv_cache.shape[2] != self.block_size:
            raise ValueError(
                f"kv-canary: vLLM layer {layer.name} ({layer.backend}) is {tuple(kv_cache.shape)}, not a packed "
                f"[num_blocks, num_kv_heads, {self.block_size}, 2 * head_size] layer the plugin can watch"
            )
        return layouts.vllm(kv_cache, layout=layout, backend=layer.backend)

    # The step -----------------------------------------------------------------------

    def begin_step(self, read_step) -> _StepRun | None:
        """Before the forward: read the step's rows and, under a block-packed backend,
        verify what the forward rewrites. ``read_step`` returns the forward's `adapter.Step`.
        None when the canary is off (or has just turned off)."""
        self._flagged, self._misreads, self._overflowed, self._first_detections = self._no_slots, [], False, set()
        if not self.on:
            return None
        try:
            return self._begin_step(read_step())
        except Exception as error:
            self._fault(error)
        return None

    def end_step(self, run: _StepRun | None) -> None:
        """After the forward: the step's call (record, verify), then its verdicts once the
        device has them."""
        if run is None or not self.on:
            return
        try:
            self._end_step(run)
        except Exception as error:
            self._fault(error)

    def stats(self) -> dict[str, int]:
        """The canary's counters (`KvCanary.stats`)."""
        return self.canary.stats()

    def step_misreads(self) -> list[Violation]:
        """The current step's violations that are not byte-only (a read through a wrong
        mapping, `reports.byte_only`), each of a request of the step (`Violation.row`), once
        the connector's policy took them on (`_report`); empty otherwise."""
        return self._misreads

    def step_overflowed(self) -> bool:
        """Whether violations of the current step were lost to a full ring, once the
        connector's policy took them on (`_report`): which requests read them is unknown."""
        return self._overflowed

    def step_first_detections(self) -> set[int]:
        """The slots the current step flagged for the first time since a forward last wrote
        them (a slot still bad from an earlier step is not among them), under a policy that logs."""
        return self._first_detections

    def step_flagged_slots(self) -> torch.Tensor:
        """The distinct slots verify flagged in the current step (int64, on the canary's
        device; empty before its forward has ended). A worker with `CONNECTOR` reads each
        step's verdicts at its end, so these are the step's own."""
        return self._flagged

    # The step's own code ---------------------------------------------------------

    def _fault(self, error: Exception) -> None:
        """An exception out of a step's own code, while it is handled: under "raise" anything
        stops the step (and a `KvCorruptionError` is how a violation does); under "log" an
        exception of its own turns the canary off, so that it never takes the engine down."""
        if self.policy == "raise" or isinstance(error, KvCorruptionError):
            raise error
        self.faults += 1
        self.on = False
        adapter.watch(self.model_runner, None)
        logger.exception(
            "kv-canary: the canary's own code failed in an engine step; it is off in this worker from here on, "
            "and vLLM keeps serving without it (report this traceback)"
        )

    def _begin_step(self, forward: adapter.Step) -> _StepRun:
        """The step's rows for its call (O(requests) NumPy on the host), the records of the
        blocks vLLM copied, and under a block-packed backend the call before the forward."""
        run = _StepRun(self._steps, forward, self._token_history(forward), self._rows.fill(forward))
        self.step_forward, self._step = forward, run.number
        self._names[run.number] = forward.request_ids
        self._names.pop(run.number - _NAMED_STEPS, None)
        if len(forward.block_copies):
            self._follow_block_copies(forward.block_copies)
        if self.blocks_packed:
            self._call(run, StepPhase.BEFORE_FORWARD)
        return run

    def _call(self, run: _StepRun, phase: StepPhase) -> None:
        """The step's `PagedStep` call in ``phase``: every group recorded, verified, or both."""
        forward, history = run.forward, run.history
        self._paged(
            self._rows.query_start_loc, self._rows.seq_lens, forward.positions, forward.input_ids,
            num_reqs=len(forward.request_ids), num_tokens=run.num_tokens, step=run.number, phase=phase, every=self.every,
            history=None if history is None else history.tokens, history_known=None if history is None else history.known,
            history_rows=None if history is None else forward.history_rows, roots=self._rows.roots,
        )  # fmt: skip

    def _token_history(self, forward: adapter.Step) -> adapter.TokenHistory | None:
        """Where the context's tokens are checked against: the runner's token history where
        it lives on the canary's device and holds every context token, or the canary's
        `TokenCopy` of one the runner keeps on the host; None: tokens are not checked."""
        if self._token_copy is not None:
            return self._token_copy.follow(forward.request_ids, self.runner_view.known_tokens)
        return self.runner_view.token_history(self.canary.device) if self._check_tokens else None

    def _follow_block_copies(self, copies: np.ndarray) -> None:
        """vLLM copied these whole blocks, every layer, before the forward (copy-on-write of a
        partial prefix hit): their slots' records go with their bytes."""
        offsets = np.arange(self.block_size, dtype=np.int64)
        source, destination = ((copies[:, [i]] * self.block_size + offsets).reshape(-1) for i in (0, 1))
        self.canary.copy_records(*(torch.from_numpy(slots).to(self.canary.device) for slots in (source, destination)))
        if self.reports.logged:
            self.reports.rewritten(destination.tolist())

    def _end_step(self, run: _StepRun) -> None:
        self._call(run, self._last_phase)
        if self._token_copy is not None and run.forward.input_ids is not None:
            self._token_copy.record(run.forward, run.num_tokens)
        if self.reports.logged:  # only once a violation was logged: the slots the forward rewrote
            self.reports.rewritten([s for g in self.groups for s in g.slot_mapping[: run.num_tokens].tolist()])
        self._steps += 1
        self._read_verdicts(wait=self.waits_for_verdicts)
        summary = self.reports.summary(time.monotonic())
        if summary is not None:
            logger.warning("%s", summary)

    def _read_verdicts(self, *, wait: bool) -> None:
        """Reads the canary's violations when the mailbox shows new ones (`PagedStep`: on the
        CPU at once; on a device once it has finished the step, so a step's verdict may come
        a step later), and with ``wait`` (the connector acts on each step's verdict in that
        step: `KvCanaryConnector.needs_step_verdicts`) every step, waiting for the device. A violation-free step reads one host word."""
        if not wait and self._paged.violations == self._violations_seen:
            return
        self._violations_seen = self._paged.violations
        violations = self.canary.poll()
        flagged = sorted({v.slot for v in violations if v.kind == ViolationKind.VERIFY})
        self._flagged = torch.tensor(flagged, dtype=torch.int64, device=self.canary.device) if flagged else self._no_slots

    # Reports ------------------------------------------------------------------------

    def requests_of(self, violation: Violation) -> list[str]:
        """The vLLM request id behind ``violation``: the request of its step's row
        (`Violation.row`), while that step is among the last few; none for a violation of a
        call outside the step (a KV connector's)."""
        names = self._names.get(violation.step)
        if names is None or not 0 <= violation.row < len(names):
            return []
        return [names[violation.row]]

    def line(self, violation: Violation) -> str:
        """The log line of docs/spec.md for ``violation``, then the ids of the vLLM requests behind it."""
        return violation_line(violation, self.requests_of(violation))

    def _report(self, violations: list[Violation]) -> None:
        """The canary's violations of a poll, one line per slot, under this worker's policy
        (`reports.report`), counted by the connector first. Each tensor-parallel rank
        reports its own."""
        lines = slot_lines(violations, self.requests_of)
        overflow = self.canary.stats()["ring_overflow"]
        dropped, self._ring_overflow = overflow - self._ring_overflow, overflow
        if self.connector is not None:
            self.connector.count_violations(violations)
        # Under the connector's policies a full ring in an engine step is taken on as a
        # violation of every request of the step (`connector.CanaryPort.overflow_blocks`).
        self._overflowed = bool(dropped) and self.policy in CONNECTOR_POLICIES and self.step_forward is not None
        taken = self._take_misreads(violations)
        self._first_detections = report(
            self.policy, violations, lines, dropped, self.reports, misreads_taken=taken, overflow_taken=self._overflowed
        )

    def _take_misreads(self, violations: list[Violation]) -> bool:
        """Under the connector's policies, whether the connector takes on the poll's
        violations that are not byte-only (`step_misreads`): each a verify of a request of
        the current step."""
        if self.policy not in CONNECTOR_POLICIES:
            return False
        misreads = [v for v in violations if not byte_only(v)]
        rows = len(self.step_forward.request_ids) if self.step_forward is not None else 0
        if not all(v.kind == ViolationKind.VERIFY and v.step == self._step and 0 <= v.row < rows for v in misreads):
            return False
        self._misreads = misreads
        return True


def _is_canary_connector(connector) -> bool:
    """Whether ``connector`` is a `connector.KvCanaryConnector` (an instance of that class,
    not of one named like it). The import loads vLLM's connector classes, which a configured
    connector has loaded already."""
    from .connector import KvCanaryConnector

    return isinstance(connector, KvCanaryConnector)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two layer tensors are the same view of the same bytes."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
