"""What P claims of the records its blocks carry, and D's judgement of the claim (`Claims`).

P's records mean something to D only where both sides make them alike: the same records
format, the same fold mode (the fold of a slot reads its first bytes or all of them), the
same block size (the region's rows follow the blocks) and the same KV heads, head size and
dtypes (the fold and the digests read the same bytes). P claims, in the params of a request
it handed over with its records written (`RECORDS_KEY`), each of these facts of its own and
its tensor-parallel size (`facts`); D compares the claim with its own facts.

A transfer whose params carry no claim (P runs no canary, or its canary is off, or a router
rebuilt the params without the key) or a claim that differs from D's facts is *unverified*:
D takes its KV as it landed, records it, and watches it from then on, without comparing it
with P's rows; it is counted by reason (`stats.UNVERIFIED_REASONS`) and said once per prefill
engine and reason with the fix. Under the `STRICT` setting such a transfer fails as a load
error, as a transfer whose rows differ does.

The claim travels per request rather than in NIXL's handshake: a router may drop it from
one request's params and not another's, and P's canary may switch itself off between two
requests, neither of which a handshake made once per pair of engines sees.

What a client writes reaches D bounded: a ``kv_canary_*`` key of the params other than
`RECORDS_KEY` (a router's typo, or a key of a newer P) is counted and said once per name, and
the load is judged by its claim alone, so that an added key switches no verification off; the
prefill engines, key names and tensor-parallel sizes D says something of are remembered up to
`SAID_LIMIT` each (`FirstSeen`), however many a client cycles through.
"""

from __future__ import annotations

import logging

from ... import adapter
from ...config import CONNECTOR, MODE_ENV, POLICY_ENV
from .config import RECORDS_KEY, STRICT

logger = logging.getLogger(adapter.LOGGER)

PREFIX = "kv_canary_"
"""The prefix of the canary's keys in ``kv_transfer_params``; `RECORDS_KEY` is the one D reads."""
SAID_LIMIT = 64
"""How many prefill engines (with a reason), unknown key names or prefill tensor-parallel sizes
a side remembers having said something of: far more than a fleet has, so that each real one
is said, and few enough that a client cycling ids sends at most this many lines to the log
and keeps this many in memory."""
SHOWN_CHARACTERS = 80
"""The most characters of a client's string (an engine id, a key name) a side keeps or says."""


FORMAT = 1
"""The version of the records P writes (`region.FIELDS` and what each field holds): a change
to either is a new version, which a D of the former one takes unverified."""
LAYOUT = ("block_size", "num_kv_heads", "head_size", "cache_dtype", "dtype")
"""The facts of the KV layout both sides must share for P's rows to compare with D's records."""
_AGREED = (
    (
        "format",
        "format_version",
        "its records are of format {there!r} and this side reads format {here}",
        "serve both sides with the same torch_kvcanary version",
    ),
    (
        "mode",
        "mode_mismatch",
        f"it folds with {MODE_ENV}={{there}} and this side with {MODE_ENV}={{here}}",
        f"set {MODE_ENV} to the same value on both sides",
    ),
)
"""The settings both sides must share, each with the reason a D takes a transfer unverified
when they differ, what differs (``there``: P's claim, ``here``: D's own) and the fix."""


def facts(vllm_config, block_size: int, mode: str) -> dict:
    """This server's facts as P claims them and D compares them: the records' `FORMAT`, the
    fold ``mode`` (``KVCANARY_VLLM_MODE``'s value), the `LAYOUT` facts and its tensor-parallel size."""
    model = vllm_config.model_config
    return {
        "format": FORMAT,
        "mode": mode,
        "block_size": block_size,
        "num_kv_heads": adapter.total_kv_heads(vllm_config),
        "head_size": int(model.get_head_size()),
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "dtype": str(model.dtype),
        "tp_size": vllm_config.parallel_config.tensor_parallel_size,
    }


class FirstSeen:
    """Which keys a side has said something of: `first` is true once per key, for the first
    `SAID_LIMIT` keys; past them a new key is neither remembered nor said, and ``full`` is
    said once, at the first such key, to say that no more are named."""

    def __init__(self, full: str, limit: int = SAID_LIMIT):
        self.full = full
        self.limit = limit
        self._keys: set = set()
        self._dropped = False

    def __len__(self) -> int:
        return len(self._keys)

    def first(self, key) -> bool:
        if key in self._keys:
            return False
        if len(self._keys) < self.limit:
            self._keys.add(key)
            return True
        if not self._dropped:
            self._dropped = True
            logger.warning("kv-canary: %s (%d said): no more are named, the counters go on", self.full, self.limit)
        return False


def shown(value) -> str:
    """A client's value as a side keeps and says it: its repr, cut to `SHOWN_CHARACTERS`."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else f"{text[:SHOWN_CHARACTERS]}...({len(text)} characters)"


class Claims:
    """A side's claims and judgements: ``own`` its `facts` (None: its canary is off, so it
    claims nothing and judges nothing); ``strict`` the `STRICT` setting; ``claiming``
    whether it claims (no longer once a worker's canary turned itself off, `stop`)."""

    def __init__(self, own: dict | None, *, strict: bool = False):
        self.own = own
        self.strict = strict
        self.claiming = own is not None
        self._said = FirstSeen("prefill engines and reasons of unverified transfers")  # (prefill engine, reason) said
        self._unknown = FirstSeen(f"unknown {PREFIX}* key names")  # unknown key names said

    def stop(self) -> None:
        """A worker's canary on this side has turned itself off: that worker writes no rows, so
        this side claims nothing from now on. It goes on judging the claims it receives: its
        workers still watching compare what lands, and the one whose canary is off takes its
        share unverified (`worker.NixlWorker.land_unwatched`)."""
        if self.claiming:
            logger.warning(
                "kv-canary: this side's canary has turned itself off: the requests it hands over from now on carry no claim of "
                "records, and a decode side takes their KV unverified (no_claim)"
            )
        self.claiming = False

    def claim(self) -> dict | None:
        """P: the claim for a request whose records it wrote (a copy of its facts)."""
        return dict(self.own) if self.claiming else None

    def judge(self, params: dict) -> tuple[int | None, str | None]:
        """D: the prefill side's tensor-parallel size to compare a load with, or None and the
        reason the load is unverified (`stats.UNVERIFIED_REASONS`), said once per prefill engine
        and reason; (None, None) where this side's canary is off and verifies nothing."""
        if self.own is None:
            return None, None
        claim = params.get(RECORDS_KEY)
        reason, fix = self._mismatch(claim)
        if reason is None:
            return claim["tp_size"], None
        self._say(shown(params.get("remote_engine_id", "?")), reason, fix)
        return None, reason

    def unknown_keys(self, params: dict) -> int:
        """D: how many keys of ``params`` are ``kv_canary_*`` keys other than `RECORDS_KEY`, each
        name said once (`FirstSeen`); none where this side's canary is off."""
        if self.own is None:
            return 0
        unknown = [shown(key) for key in params if isinstance(key, str) and key.startswith(PREFIX) and key != RECORDS_KEY]
        for key in unknown:
            if self._unknown.first(key):
                logger.warning(
                    "kv-canary: a request's kv_transfer_params carry %r, a key this decode side does not know (a router's typo, "
                    "or a newer prefill side's): it is ignored and counted (vllm:kv_canary_transfer_params_unknown_keys_total), "
                    "the load judged by %s alone: serve both sides with the same torch_kvcanary version, and have the router "
                    "hand kv_transfer_params on unchanged (said once per key name)",
                    key, RECORDS_KEY,
                )  # fmt: skip
        return len(unknown)

    def _mismatch(self, claim) -> tuple[str | None, str]:
        """The reason ``claim`` cannot be compared with and the fix; (None, "") where it can."""
        own = self.own
        if not isinstance(claim, dict):
            return "no_claim", (
                f"its kv_transfer_params carry no {RECORDS_KEY}: serve the prefill side with {CONNECTOR} and {POLICY_ENV} set, "
                f"its canary on, and have the router hand kv_transfer_params on unchanged"
            )
        for key, reason, differs, fix in _AGREED:
            if claim.get(key) != own[key]:
                return reason, f"{differs.format(there=claim.get(key), here=own[key])}: {fix}"
        differ = [f"{key} {claim.get(key)!r} there, {own[key]!r} here" for key in LAYOUT if claim.get(key) != own[key]]
        tp_size = claim.get("tp_size")
        if not (isinstance(tp_size, int) and not isinstance(tp_size, bool) and tp_size > 0):
            differ.append(f"tp_size {tp_size!r}, not a tensor-parallel size")
        if differ:
            return (
                "layout_mismatch",
                f"its KV layout differs ({'; '.join(differ)}): serve both sides with the same model and cache settings",
            )
        return None, ""

    def _say(self, engine: str, reason: str, fix: str) -> None:
        if not self._said.first((engine, reason)):
            return
        outcome = (
            f"fails as a load error ({STRICT} is true)"
            if self.strict
            else "is taken unverified (counted in vllm:kv_canary_transfers_unverified_total)"
        )
        logger.warning(
            "kv-canary: the KV this decode side reads from prefill engine %s %s, %s: %s (said once per prefill engine and reason)",
            engine, outcome, reason, fix,
        )  # fmt: skip
