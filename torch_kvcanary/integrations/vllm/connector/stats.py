"""The connector's counters: `CanaryStats` in vLLM's connector stats (its stats log line),
`CanaryPromMetrics` in its ``/metrics`` (``vllm:kv_canary_*``), with the gauge of whether
the canary is on (``vllm:kv_canary_enabled``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ....violations import FailReason, Violation
from ..config import settings

REASONS = tuple(label for reason in FailReason for label in reason.labels)
"""The violation reasons the counters are kept by (SGLang's labels)."""
VIOLATIONS = "violations"
FAILED = "transfer_slots_failed"
FAILED_KINDS = ("bytes", "shifted", "other_request", "identity", "no_records", "unknown")
"""What a failed transfer's slots are counted as (``data[FAILED]`` by kind), read from the
prefill side's records that landed at the load's first differing slot (`nixl.worker`):
``bytes``, they say what the request expects there (token, position, chain), so the bytes
changed; ``shifted``, they hold the request's own token of another position (its blocks
landed paired with P's off by some blocks); ``other_request``, they hold KV that is not the
request's (another request's, or an earlier transfer's into that block); ``identity``, they
hold the request's token and position, and the stored ones its bytes, under another chain:
KV computed for the same tokens under another identity (LoRA adapter, cache salt) than the
one the loading side derives for its request (`nixl.worker`, `disk`); ``no_records``, the
load carried no records of P's to compare with (failed under the strict setting);
``unknown``, not classified (rows P never wrote; the ExampleConnector transport's other
failures)."""
UNVERIFIED = "transfers_unverified"
UNVERIFIED_REASONS = ("format_version", "mode_mismatch", "layout_mismatch", "canary_off")
"""Why a decode side took a transfer's KV unverified (``data[UNVERIFIED]`` by reason): the
params carry a claim of another records format, fold mode or KV layout than the decode
side's (`nixl.claim`; a load without a claim is compared all the same, counted in
``transfers_unclaimed``); or, ``canary_off``, the KV
heads of a tensor-parallel rank whose canary has turned itself off, counted by that rank for
each load while its other ranks compare theirs (`nixl.worker`)."""
FAULTS = "canary_faults"
FAULT_PARTS = ("verifier", "mapping", "repair", "drill", "counters")
"""What an exception of the canary's own code in a KV connector call is counted by
(``data[FAULTS]`` by part, `guard.Guard`): the transfer verifier, the mapping rule
(`port.CanaryPort.misread_blocks`), the repair rule, the drills, the counters."""
OFF = "canary_off"
"""A state beside the counts: 1 where a worker's canary has turned itself off (a fault of
its own; it stays off), reported by that worker at every step from then on; workers and
steps combine by maximum, so that it reads 1 where any worker's canary is off."""


@dataclass(frozen=True)
class CounterSpec:
    """One of the connector's counters: ``vllm:kv_canary_<name>`` in ``/metrics`` and
    ``kv_canary_<name>`` in vLLM's stats log line, with its help text; for a counter kept by
    a label's value, the label's name and values (``data[name]`` a dict of them, and the
    log line names its nonzero values). ``logs_total``: the log line shows its total."""

    name: str
    help: str
    label: str | None = None
    values: tuple[str, ...] = ()
    logs_total: bool = True


COUNTERS = (
    CounterSpec(
        VIOLATIONS,
        "KV cache slot reads the canary flagged, by reason: a slot counts once per request of the step that read it, "
        "and under each check it failed.",
        label="reason",
        values=REASONS,
        logs_total=False,
    ),
    CounterSpec("slots_verified", "KV cache slots the canary verified before a forward read them."),
    CounterSpec("slots_recorded", "KV cache slots the canary recorded after a forward wrote them."),
    CounterSpec("blocks_repaired", "KV cache blocks reported to vLLM for recompute (KVCANARY_VLLM=repair)."),
    CounterSpec(
        "repairs_given_up",
        "Requests the canary stopped repairing at a block (KVCANARY_VLLM=repair): flagged there again after "
        "KVCANARY_VLLM_MAX_REPAIRS recomputes, each goes on with the KV as read there.",
    ),
    CounterSpec("requests_failed", "Requests vLLM ended with an error for blocks the canary reported (KVCANARY_VLLM=quarantine)."),
    CounterSpec("drills_injected", "Fault drills: bytes of live cached blocks flipped (KVCANARY_VLLM_DRILL)."),
    CounterSpec("drills_caught", "Fault drills the canary caught."),
    CounterSpec("drill_steps_to_catch", "Engine steps from each caught drill's flip to its detection, summed."),
    CounterSpec(
        "drills_expired",
        "Fault drills whose flipped slot the canary had not flagged 1024 engine steps later (no request read it again), no longer pending.",
    ),
    CounterSpec(
        "transfer_slots_verified", "KV cache slots loaded by the inner connector and verified against the records stored with them."
    ),
    CounterSpec(
        FAILED,
        "Loaded KV cache slots whose bytes or records did not match what was stored (reported as load errors), by kind: "
        f"{', '.join(FAILED_KINDS[:-1])} or {FAILED_KINDS[-1]} (the prefill side's records at a load's first differing slot).",
        label="kind",
        values=FAILED_KINDS,
    ),
    CounterSpec(
        "transfer_slots_handed_over",
        "Prompt slots whose records a prefill side wrote for the decode side to read with the KV (NixlConnector).",
    ),
    CounterSpec(
        FAULTS,
        "Exceptions of the canary's own code in a KV connector call, by part: caught, the engine and the canary going on "
        "without that part's work in that step (the first of each part logged with its traceback).",
        label="part",
        values=FAULT_PARTS,
    ),
    CounterSpec(
        "transfers_loaded",
        "Transfers a decode side loaded through the inner connector (NixlConnector), verified or not: what "
        "transfers_unverified is a share of.",
    ),
    CounterSpec(
        "transfers_unclaimed",
        "Transfers a decode side loaded whose kv_transfer_params carried no claim of the prefill side's records, compared all "
        "the same by each slot's token, position and chain and its head digests (rows the prefill side did not write fail).",
    ),
    CounterSpec(
        "transfer_params_unknown_keys",
        "kv_canary_* keys of the loaded requests' kv_transfer_params the decode side does not know (a router's typo, a newer "
        "prefill side's key): ignored, each load judged by its kv_canary_records alone.",
    ),
    CounterSpec(
        UNVERIFIED,
        "Transfers a decode side took unverified, by reason: a claim of the prefill side's records of another records "
        "format, fold mode or KV layout in the request's kv_transfer_params (KvCanaryConnector's kv_canary_strict_transfers "
        "fails them instead); canary_off: a rank's share of a load, that rank's canary being off.",
        label="reason",
        values=UNVERIFIED_REASONS,
        logs_total=False,
    ),
)
"""The connector's counters, each declared once: `CanaryStats` keeps them, `CanaryPromMetrics`
exports them. The canary's violations come first, by reason; the others count what the
connector did (``drill_steps_to_catch``: summed over the caught drills), what an inner
connector loaded and the canary verified (``transfer_slots_*``), and what a prefill side
handed over."""
BY_NAME = {counter.name: counter for counter in COUNTERS}
UNLABELLED = tuple(counter for counter in COUNTERS if counter.label is None)
LABELLED = tuple(counter for counter in COUNTERS if counter.label is not None)


@dataclass
class CanaryStats(KVConnectorStats):
    """The canary's counters since they were last taken, in vLLM's connector stats:
    ``data[name]`` for each of `COUNTERS` (a dict by label value for a labelled one), and
    `OFF`. Added up over the workers (`aggregate`) and over a logging interval; `add` is the
    only writer of a count."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {counter.name: dict.fromkeys(counter.values, 0) if counter.label else 0 for counter in COUNTERS}
        self.data[OFF] = 0

    def add(self, name: str, n) -> None:
        """Adds ``n`` to the counter ``name`` of `COUNTERS`: an int, or for a labelled counter
        a dict of counts by label value."""
        counter = BY_NAME.get(name)
        if counter is None:
            raise ValueError(f"kv-canary: no connector counter {name!r}: declare it in connector.stats.COUNTERS")
        if counter.label is None:
            self.data[name] += n
            return
        counts = self.data[name]
        for value, count in n.items():
            counts[value] = counts.get(value, 0) + count

    def add_counts(self, counts: dict) -> None:
        """Adds ``counts`` (a verifier's `take_counts`), by counter name (`add`)."""
        for name, n in counts.items():
            self.add(name, n)

    def add_violations(self, violations: list[Violation]) -> None:
        for violation in violations:
            for label in violation.reasons.labels:
                self.add(VIOLATIONS, {label: 1})

    def mark_off(self) -> None:
        """The worker's canary is off (`OFF`)."""
        self.data[OFF] = 1

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for counter in COUNTERS:
            self.add(counter.name, other.data.get(counter.name, {} if counter.label else 0))
        self.data[OFF] = max(self.data.get(OFF, 0), other.data.get(OFF, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The line vLLM's stats log prints: the nonzero violation counts, then the total of
        every counter that `logs_total`, then the other labelled counters' nonzero counts by
        label value, then ``kv_canary_off=1`` where a worker's canary is off."""
        violations = self._nonzero(BY_NAME[VIOLATIONS])
        totals = {f"kv_canary_{counter.name}": self._total(counter) for counter in COUNTERS if counter.logs_total}
        labelled = {key: n for counter in LABELLED if counter.name != VIOLATIONS for key, n in self._nonzero(counter).items()}
        off = {"kv_canary_off": 1} if self.data.get(OFF) else {}
        return {**violations, **totals, **labelled, **off}

    def _nonzero(self, counter: CounterSpec) -> dict[str, int]:
        return {f"kv_canary_{counter.name}_{value}": n for value, n in self.data[counter.name].items() if n}

    def _total(self, counter: CounterSpec) -> int:
        """The count of ``counter``, summed over its label values where it has a label."""
        count = self.data[counter.name]
        return sum(count.values()) if counter.label else count

    def is_empty(self) -> bool:
        return not any(self._total(counter) for counter in COUNTERS) and not self.data.get(OFF)


class CanaryPromMetrics(KVConnectorPromMetrics):
    """``vllm:kv_canary_*`` counters in vLLM's ``/metrics``, per engine, one for each of
    `COUNTERS` (a labelled one with its label: violations by ``reason``, `FAILED` by
    ``kind``, `UNVERIFIED` by ``reason``); and the gauge ``vllm:kv_canary_enabled``:
    1 while the canary runs in every worker of the engine, 0 once one has turned itself off
    (`OFF`; it does not turn back on in a running engine). Its labels ``policy``
    (``KVCANARY_VLLM``) and ``kv_role`` (the ``kv_transfer_config``'s) say what the engine
    does with what the canary finds, and whether it reads KV at all (a ``kv_producer``
    only prefills, and verifies no read)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_class = metric_types[Counter]  # vLLM's class for prometheus_client's counters
        engines = per_engine_labelvalues.items()
        self._counts = {}
        # Registered in this order (the violations, the unlabelled counters, the other labelled ones), as /metrics lists them.
        for counter in (BY_NAME[VIOLATIONS], *UNLABELLED, *(c for c in LABELLED if c.name != VIOLATIONS)):
            extra = [counter.label] if counter.label else []
            metric = counter_class(name=f"vllm:kv_canary_{counter.name}", documentation=counter.help, labelnames=[*labelnames, *extra])
            if counter.label:
                self._counts[counter.name] = {
                    engine: {value: metric.labels(*values, value) for value in counter.values} for engine, values in engines
                }
            else:
                self._counts[counter.name] = {engine: metric.labels(*values) for engine, values in engines}
        self._enabled = _enabled_gauges(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for counter in COUNTERS:
            counts = self._counts[counter.name][engine_idx]
            if counter.label is None:
                if transfer_stats_data.get(counter.name):
                    counts.inc(transfer_stats_data[counter.name])
                continue
            for value, count in transfer_stats_data.get(counter.name, {}).items():
                if count:
                    counts[value].inc(count)
        if transfer_stats_data.get(OFF):
            self._enabled[engine_idx].set(0)


def _enabled_gauges(vllm_config, metric_types, labelnames, per_engine_labelvalues) -> dict:
    """``vllm:kv_canary_enabled`` of each engine, 1 from the start: a worker whose canary
    cannot start refuses to start, so an engine that serves starts with it on."""
    chosen = settings()
    gauge = metric_types[Gauge](
        name="vllm:kv_canary_enabled",
        documentation=(
            "1 while the canary runs in every worker of the engine, 0 once one has turned itself off after a fault of its own "
            "(KV corruption then goes undetected); policy is KVCANARY_VLLM, kv_role the kv_transfer_config's."
        ),
        multiprocess_mode="mostrecent",
        labelnames=[*labelnames, "policy", "kv_role"],
    )
    policy, kv_role = chosen.policy if chosen is not None else "", vllm_config.kv_transfer_config.kv_role
    enabled = {engine: gauge.labels(*values, policy, kv_role) for engine, values in per_engine_labelvalues.items()}
    for engine_gauge in enabled.values():
        engine_gauge.set(1)
    return enabled
