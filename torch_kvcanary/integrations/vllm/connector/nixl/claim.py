"""What P claims of the records its blocks carry, and D's judgement of the claim (`Claims`).

P's records mean something to D only where both sides make them alike: the same records
format, the same fold mode (the fold of a slot reads its first bytes or all of them), the
same block size (the region's rows follow the blocks) and the same KV heads, head size and
dtypes (the fold and the digests read the same bytes). P claims, in the params of a request
it handed over with its records written (`RECORDS_KEY`), each of these facts of its own and
its tensor-parallel size (`facts`); D compares the claim with its own facts.

A transfer whose params carry no claim (a router rebuilt the params without the key, or P's
canary is off) is compared all the same, by what depends neither on the fold mode nor on P's
tensor-parallel size: each slot's token, position and chain, and its head digests. The
client cannot switch that off: D loads only from a P that registers the records' region
(vLLM's NixlConnector refuses, in its handshake, a peer whose regions differ in number or
names: ``_validate_remote_agent_handshake``), so a P it loads from runs KvCanaryConnector, and
the rows ride NIXL's read of the blocks whatever the params say. Rows P never wrote (zeros:
its canary off) are load errors like any other rows that differ. Such a load is counted in
``transfers_unclaimed`` and said once per prefill engine.

A claim that differs from D's facts (another records format, fold mode or KV layout) is
*unverified*: D takes the KV as it landed, records it, and watches it from then on, without
comparing it with P's rows (a claim of another fold mode is the one a router cannot forge
into a missed fault: stripped, the load is compared). It is counted by reason
(`stats.UNVERIFIED_REASONS`) and said once per prefill engine and reason with the fix.
Under the `STRICT` setting such a transfer fails as a load error, as a transfer whose rows
differ does.

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


def nixl_tp_size(params: dict) -> int:
    """The prefill side's tensor-parallel size as a load's ``params`` give it to NixlConnector
    (its ``tp_size``, 1 where absent, as vLLM's ``ReqMeta`` reads it); 1 where it is no size
    (NIXL's handshake, made with it, would then fail). It need not be what NIXL reads by: NIXL
    reads a prefill engine by the size the params of the request that made the handshake
    gave. D compares a load without a claim by token, position, chain and head digests, which
    do not depend on it; it is the load's `LoadOrder.remote_tp_size`, and nothing is judged by it."""
    tp_size = params.get("tp_size", 1)
    return tp_size if isinstance(tp_size, int) and not isinstance(tp_size, bool) and tp_size > 0 else 1


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
        self._unclaimed_said = FirstSeen("prefill engines of loads without a claim")
        self._unknown = FirstSeen(f"unknown {PREFIX}* key names")  # unknown key names said

    def stop(self) -> None:
        """A worker's canary on this side has turned itself off: that worker writes no rows, so
        this side claims nothing from now on. It goes on judging the claims it receives: its
        workers still watching compare what lands, and the one whose canary is off takes its
        share unverified (`worker.NixlWorker.land_unwatched`)."""
        if self.claiming:
            logger.warning(
                "kv-canary: this side's canary has turned itself off: the requests it hands over from now on carry no claim of "
                "records and no rows of them, which a decode side finds bad (load errors: recomputed under repair, failed under "
                "quarantine)"
            )
        self.claiming = False

    def claim(self) -> dict | None:
        """P: the claim for a request whose records it wrote (a copy of its facts)."""
        return dict(self.own) if self.claiming else None

    def judge(self, params: dict) -> tuple[int | None, str | None]:
        """D: the prefill side's tensor-parallel size to compare a load with, or None and the
        reason the load is unverified (`stats.UNVERIFIED_REASONS`), said once per prefill engine
        and reason; (None, None) where this side's canary is off and verifies nothing. A load
        without a claim (`unclaimed`) is compared all the same, said once per prefill engine:
        its size is the one its params give NIXL (`nixl_tp_size`)."""
        if self.own is None:
            return None, None
        claim = params.get(RECORDS_KEY)
        if not isinstance(claim, dict):
            self._say_unclaimed(shown(params.get("remote_engine_id", "?")))
            return nixl_tp_size(params), None
        reason, fix = self._mismatch(claim)
        if reason is None:
            return claim["tp_size"], None
        self._say(shown(params.get("remote_engine_id", "?")), reason, fix)
        return None, reason

    def unclaimed(self, params: dict) -> bool:
        """D: whether a load's ``params`` carry no claim of P's records while this side verifies:
        it is compared by token, position, chain and head digests, which depend neither on the
        fold mode nor on P's tensor-parallel size."""
        return self.own is not None and not isinstance(params.get(RECORDS_KEY), dict)

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

    def _mismatch(self, claim: dict) -> tuple[str | None, str]:
        """The reason ``claim`` cannot be compared with and the fix; (None, "") where it can."""
        own = self.own
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

    def _say_unclaimed(self, engine: str) -> None:
        if self._unclaimed_said.first(engine):
            logger.warning(
                "kv-canary: the KV this decode side reads from prefill engine %s comes with kv_transfer_params that carry no %s: "
                "it is compared all the same, by each slot's token, position and chain and its head digests (counted in "
                "vllm:kv_canary_transfers_unclaimed_total), and rows the prefill side did not write fail as load errors: serve "
                "the prefill side with %s and %s set, its canary on, and have the router hand kv_transfer_params on unchanged "
                "(said once per prefill engine)",
                engine, RECORDS_KEY, CONNECTOR, POLICY_ENV,
            )  # fmt: skip

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
