"""The connector's counters: `CanaryStats` in vLLM's connector stats (its stats log line),
`CanaryPromMetrics` in its ``/metrics`` (``vllm:kv_canary_*``), with the gauge of whether
the canary is on (``vllm:kv_canary_enabled``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ....canary import FailReason, Violation
from ..config import settings

REASONS = tuple(label for reason in FailReason for label in reason.labels)
"""The violation reasons the counters are kept by (SGLang's labels)."""
FAILED = "transfer_slots_failed"
COUNTS = (
    "slots_verified",
    "slots_recorded",
    "blocks_repaired",
    "requests_failed",
    "drills_injected",
    "drills_caught",
    "drill_steps_to_catch",
    "transfer_slots_verified",
    FAILED,
    "transfer_slots_handed_over",
)
"""The counters beside the violations by reason (``drill_steps_to_catch``: the engine steps
from each caught drill's flip to its detection, summed; ``transfer_slots_verified`` and
``_failed``: slots an inner connector loaded, verified against the records stored with
them, and those that failed, by kind (`FAILED_KINDS`); ``transfer_slots_handed_over``: a
prefill side's, see `CanaryPromMetrics`)."""
FAILED_KINDS = ("bytes", "shifted", "other_request", "no_records", "unknown")
"""What a failed transfer's slots are counted as (``data[FAILED]`` by kind), read from the
prefill side's records that landed at the load's first differing slot (`nixl.worker`):
``bytes``, they say what the request expects there (token, position, chain), so the bytes
changed; ``shifted``, they hold the request's own token of another position (its blocks
landed paired with P's off by some blocks); ``other_request``, they hold KV that is not the
request's (another request's, or an earlier transfer's into that block); ``no_records``,
the load carried no records of P's to compare with (failed under the strict setting);
``unknown``, not classified (rows P never wrote; the ExampleConnector transport)."""
UNVERIFIED = "transfers_unverified"
UNVERIFIED_REASONS = ("no_claim", "format_version", "mode_mismatch", "layout_mismatch")
"""Why a decode side took a transfer's KV unverified (``data[UNVERIFIED]`` by reason): the
params carry no claim of the prefill side's records, or a claim of another records format,
fold mode or KV layout than the decode side's (`nixl.claim`)."""
LABELLED = {FAILED: ("kind", FAILED_KINDS), UNVERIFIED: ("reason", UNVERIFIED_REASONS)}
"""The counts kept by a label's value (``data[name]`` a dict of them), with the label's name
and values: `FAILED` by kind, `UNVERIFIED` by reason."""
OFF = "canary_off"
"""A state beside the counts: 1 where a worker's canary has turned itself off (a fault of
its own; it stays off), reported by that worker at every step from then on; workers and
steps combine by maximum, so that it reads 1 where any worker's canary is off."""


@dataclass
class CanaryStats(KVConnectorStats):
    """The canary's counters since they were last taken, in vLLM's connector stats:
    ``data["violations"]`` by reason (`REASONS`) and ``data[name]`` for each of `COUNTS` (a
    dict by label value for those of `LABELLED`).
    Added up over the workers (`aggregate`) and over a logging interval."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {
            "violations": dict.fromkeys(REASONS, 0),
            **dict.fromkeys(COUNTS, 0),
            **{name: dict.fromkeys(values, 0) for name, (_, values) in LABELLED.items()},
            OFF: 0,
        }

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for reason, count in other.data["violations"].items():
            self.data["violations"][reason] = self.data["violations"].get(reason, 0) + count
        self.add_counts({name: other.data[name] for name in COUNTS if name not in LABELLED})
        self.add_counts({name: other.data.get(name, {}) for name in LABELLED})
        self.data[OFF] = max(self.data.get(OFF, 0), other.data.get(OFF, 0))
        return self

    def add_counts(self, counts: dict) -> None:
        """Adds ``counts`` (a verifier's `take_counts`): a count by its name in `COUNTS`, or
        by label value under a name of `LABELLED`."""
        for name, count in counts.items():
            if name in LABELLED:
                for value, n in count.items():
                    self.data[name][value] = self.data[name].get(value, 0) + n
            else:
                self.data[name] += count

    def reduce(self) -> dict[str, int | float]:
        """The line vLLM's stats log prints: the nonzero violation counts, then every counter
        (those of `LABELLED` in all), then the nonzero counts by label value, then
        ``kv_canary_off=1`` where a worker's canary is off."""
        violations = {f"kv_canary_violations_{reason}": n for reason, n in self.data["violations"].items() if n}
        counts = {f"kv_canary_{name}": self._total(name) for name in COUNTS}
        labelled = {f"kv_canary_{name}_{value}": n for name in LABELLED for value, n in self.data[name].items() if n}
        off = {"kv_canary_off": 1} if self.data.get(OFF) else {}
        return {**violations, **counts, **labelled, **off}

    def _total(self, name: str) -> int:
        """The count ``name`` of `COUNTS`, summed over its label values where it is `LABELLED`."""
        count = self.data[name]
        return sum(count.values()) if name in LABELLED else count

    def is_empty(self) -> bool:
        return (
            not any(self.data["violations"].values())
            and not any(self._total(name) for name in COUNTS)
            and not any(self._total(name) for name in LABELLED)
            and not self.data.get(OFF)
        )

    def add_violations(self, violations: list[Violation]) -> None:
        for violation in violations:
            for label in violation.reasons.labels:
                self.data["violations"][label] += 1


class CanaryPromMetrics(KVConnectorPromMetrics):
    """``vllm:kv_canary_*`` counters in vLLM's ``/metrics``, per engine: violations by
    ``reason``, and one counter for each of `COUNTS` (`FAILED` by ``kind``); and the gauge ``vllm:kv_canary_enabled``:
    1 while the canary runs in every worker of the engine, 0 once one has turned itself off
    (`OFF`; it does not turn back on in a running engine). Its labels ``policy``
    (``KVCANARY_VLLM``) and ``kv_role`` (the ``kv_transfer_config``'s) say what the engine
    does with what the canary finds, and whether it reads KV at all (a ``kv_producer``
    only prefills, and verifies no read)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_class = metric_types[Counter]  # vLLM's class for prometheus_client's counters
        violations = counter_class(
            name="vllm:kv_canary_violations",
            documentation=(
                "KV cache slot reads the canary flagged, by reason: a slot counts once per request of the step that read it, "
                "and under each check it failed."
            ),
            labelnames=[*labelnames, "reason"],
        )
        self._violations = {
            engine: {reason: violations.labels(*values, reason) for reason in REASONS} for engine, values in per_engine_labelvalues.items()
        }
        documentation = {
            "slots_verified": "KV cache slots the canary verified before a forward read them.",
            "slots_recorded": "KV cache slots the canary recorded after a forward wrote them.",
            "blocks_repaired": "KV cache blocks reported to vLLM for recompute (KVCANARY_VLLM=repair).",
            "requests_failed": "Requests vLLM ended with an error for blocks the canary reported (KVCANARY_VLLM=quarantine).",
            "drills_injected": "Fault drills: bytes of live cached blocks flipped (KVCANARY_VLLM_DRILL).",
            "drills_caught": "Fault drills the canary caught.",
            "drill_steps_to_catch": "Engine steps from each caught drill's flip to its detection, summed.",
            "transfer_slots_verified": "KV cache slots loaded by the inner connector and verified against the records stored with them.",
            "transfer_slots_failed": (
                "Loaded KV cache slots whose bytes or records did not match what was stored (reported as load errors), by kind: "
                f"{', '.join(FAILED_KINDS[:-1])} or {FAILED_KINDS[-1]} (the prefill side's records at a load's first differing slot)."
            ),
            "transfer_slots_handed_over": "Prompt slots whose records a prefill side wrote for the decode side to read with the KV (NixlConnector).",
        }
        documentation[UNVERIFIED] = (
            "Transfers a decode side took unverified, by reason: no claim of the prefill side's records in the request's "
            "kv_transfer_params, or a claim of another records format, fold mode or KV layout (KvCanaryConnector's "
            "kv_canary_strict_transfers fails them instead)."
        )
        self._counts = {}
        for name in COUNTS:
            if name in LABELLED:
                continue
            counter = counter_class(name=f"vllm:kv_canary_{name}", documentation=documentation[name], labelnames=labelnames)
            self._counts[name] = {engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()}
        self._labelled = {}
        for name, (label, label_values) in LABELLED.items():
            counter = counter_class(name=f"vllm:kv_canary_{name}", documentation=documentation[name], labelnames=[*labelnames, label])
            self._labelled[name] = {
                engine: {value: counter.labels(*values, value) for value in label_values}
                for engine, values in per_engine_labelvalues.items()
            }
        self._enabled = _enabled_gauges(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for reason, count in transfer_stats_data["violations"].items():
            if count:
                self._violations[engine_idx][reason].inc(count)
        for name in COUNTS:
            if name not in LABELLED and transfer_stats_data[name]:
                self._counts[name][engine_idx].inc(transfer_stats_data[name])
        for name, counters in self._labelled.items():
            for value, count in transfer_stats_data.get(name, {}).items():
                if count:
                    counters[engine_idx][value].inc(count)
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
