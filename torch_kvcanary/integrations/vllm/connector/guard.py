"""`Guard`: the connector's calls into the canary's own code, each guarded so that an
exception there never ends the engine nor turns the canary off.

vLLM calls a KV connector's worker methods inside its engine step, and an exception out of
one ends the engine (every request of it fails, the server stops). The canary's part of
each call (its verifier, its drills, its repair rule, its counters) is guarded; the inner
connector's part is not (its exceptions are vLLM's to handle, as without the canary). What
a caught exception costs, by the part it came out of:

| Part                                   | What the step does instead                                     |
|----------------------------------------|----------------------------------------------------------------|
| the verifier before a forward or load  | the step's loads land unverified                               |
| the verifier after a load or a save    | those loads unverified; a save's records not handed over (the  |
|                                        | decode side then fails or recomputes those rows, as rows the   |
|                                        | prefill side never wrote)                                      |
| the mapping rule (`misread_blocks`)    | the step's flagged slots are reported as byte faults: their    |
|                                        | blocks' holders are recomputed or failed                       |
| the repair rule, drills, counters      | skipped for this step                                          |

Each caught exception counts in ``vllm:kv_canary_canary_faults_total`` (`stats.FAULTS`), by
the part it came out of; the first of each part is logged with its traceback, the later ones
are counted only, so a fault of every step cannot flood the log. The canary stays on: the
worker's own step has its own guard (`worker.WorkerCanary.begin_step`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from ....violations import KvCorruptionError
from .. import adapter
from .stats import FAULT_PARTS

logger = logging.getLogger(adapter.LOGGER)


class Guard:
    """Catches the exceptions of the canary's own code in the connector's calls (`guarding`),
    logs the first of each part with its traceback and counts each (`take`)."""

    def __init__(self):
        self._logged: set[str] = set()
        self._caught = dict.fromkeys(FAULT_PARTS, 0)

    @contextlib.contextmanager
    def guarding(self, part: str) -> Iterator[None]:
        """Runs the block; an exception out of it (but a `KvCorruptionError`: how the raise
        policy reports a violation) is caught, counted under ``part`` and logged once."""
        if part not in self._caught:
            raise ValueError(f"kv-canary: {part!r} is not a part of the connector's calls ({', '.join(FAULT_PARTS)})")
        try:
            yield
        except KvCorruptionError:
            raise
        except Exception:
            self._caught[part] += 1
            if part not in self._logged:
                self._logged.add(part)
                logger.exception(
                    "kv-canary: the canary's own code failed in a KV connector call (%s); the engine and the canary go on, "
                    "this step's %s work is skipped, and later faults of this part are counted in "
                    "vllm:kv_canary_canary_faults_total only (report this traceback)",
                    part,
                    part,
                )

    def take(self) -> dict[str, int]:
        """The faults caught since the last call, by part."""
        caught, self._caught = self._caught, dict.fromkeys(FAULT_PARTS, 0)
        return caught
