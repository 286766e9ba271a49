"""Which pending prompts the next regenerate batch sends: uniform, or where the draft accepts least.

Owns the selection policy. Promises: `select_prompts` is a pure function of the queue (pending
prompts in queue order with their clusters), the pool's cluster sizes and the latest probe; it
returns each chosen prompt once, in queue order, with the reason lineage stores for it. Under
`uniform` the batch is the head of the queue. Under `acceptance` each cluster's share of the batch
is its share of the pool times (mean acceptance / its acceptance) ** strength, normalised: a
cluster where the draft accepts less than average gets more than its share, one where it accepts
more gets less, and none gets nothing while it has pending prompts (every weight is positive). A
cluster the probe did not measure keeps its pool share. Within a cluster, queue order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

UNTAGGED = "untagged"


@dataclass(frozen=True)
class ProbeRow:
    """The latest probe's measurement of one cluster."""

    cluster: str
    acceptance: float | None
    prompts: int
    probe_id: str


@dataclass(frozen=True)
class Selection:
    prompt_id: str
    cluster: str
    reason: str
    pool_share: float | None = None
    batch_share: float | None = None
    acceptance: float | None = None
    probe_id: str | None = None

    def row(self, policy: str) -> dict:
        return {"prompt_id": self.prompt_id, "policy": policy, "cluster": self.cluster, "probe_id": self.probe_id,
                "pool_share": self.pool_share, "batch_share": self.batch_share, "acceptance": self.acceptance,
                "reason": self.reason}


def cluster_weights(pool: dict[str, int], probe: dict[str, float], strength: float) -> dict[str, float]:
    """Each cluster's share of the next batch (summing to 1) from its pool size and probe acceptance."""
    total = sum(pool.values())
    if total == 0:
        return {}
    share = {c: n / total for c, n in pool.items() if n > 0}
    measured = {c: a for c, a in probe.items() if c in share and a is not None and a > 0}
    if not measured:
        return share
    # The reference is the pool-weighted mean over measured clusters: what a uniform draw meets.
    mean = sum(share[c] * a for c, a in measured.items()) / sum(share[c] for c in measured)
    raw = {c: s * ((mean / measured[c]) ** strength if c in measured else 1.0) for c, s in share.items()}
    norm = sum(raw.values())
    return {c: w / norm for c, w in raw.items()}


def quotas(weights: dict[str, float], available: dict[str, int], n: int) -> dict[str, int]:
    """Prompts to take from each cluster: `n` split by weight (largest remainders, ties by name), none
    above what a cluster has pending; what a full cluster cannot take goes to the others by weight."""
    take = {c: 0 for c in available}
    n = min(n, sum(available.values()))
    open_ = sorted(c for c in available if available[c] > 0)
    while open_ and sum(take.values()) < n:
        left = n - sum(take.values())
        w = {c: max(weights.get(c, 0.0), 1e-12) for c in open_}
        exact = {c: left * w[c] / sum(w.values()) for c in open_}
        add = {c: min(math.floor(exact[c]), available[c] - take[c]) for c in open_}
        rest = left - sum(add.values())
        for c in sorted(open_, key=lambda c: (math.floor(exact[c]) - exact[c], c)):
            if rest == 0:
                break
            if take[c] + add[c] < available[c]:
                add[c] += 1
                rest -= 1
        for c in open_:
            take[c] += add[c]
        # each pass places everything or fills a cluster, which then leaves: it ends
        open_ = [c for c in open_ if take[c] < available[c]]
    return take


def select_prompts(queue: list[tuple[str, str | None]], n: int | None, policy: Literal["uniform", "acceptance"],
                   pool: dict[str, int] | None = None, probe: list[ProbeRow] | None = None,
                   strength: float = 2.0) -> list[Selection]:
    """The next batch: `n` prompts of `queue` ((prompt id, cluster) in queue order; None: all).

    `pool`: prompts per cluster among all that can be regenerated (done or pending), the shares
    the weights start from. `probe`: the latest probe's rows (acceptance: needs one).
    """
    queue = [(p, c or UNTAGGED) for p, c in queue]
    n = len(queue) if n is None else min(n, len(queue))
    if policy == "uniform":
        return [Selection(p, c, "uniform: next in queue order") for p, c in queue[:n]]
    if policy != "acceptance":
        raise ValueError(f"unknown selection policy {policy!r} (uniform | acceptance)")
    if not probe:
        return [Selection(p, c, "acceptance selection before any probe: uniform, next in queue order")
                for p, c in queue[:n]]
    available: dict[str, int] = {}
    for _, c in queue:
        available[c] = available.get(c, 0) + 1
    pool_counts = dict(pool or {})
    for c, k in available.items():  # a cluster with pending prompts is in the pool
        pool_counts[c] = max(pool_counts.get(c, 0), k)
    by_cluster = {r.cluster: r for r in probe}
    acceptance = {c: r.acceptance for c, r in by_cluster.items() if r.acceptance is not None}
    weights = cluster_weights(pool_counts, acceptance, strength)
    take = quotas(weights, available, n)
    total_pool = sum(pool_counts.values())
    measured = [c for c in acceptance if c in pool_counts]
    mean = (sum(pool_counts[c] * acceptance[c] for c in measured) / sum(pool_counts[c] for c in measured)
            if measured else None)
    probe_id = probe[0].probe_id
    out: list[Selection] = []
    taken = {c: 0 for c in available}
    for p, c in queue:
        if taken[c] >= take.get(c, 0):
            continue
        taken[c] += 1
        row = by_cluster.get(c)
        pool_share, batch_share = pool_counts[c] / total_pool, take[c] / n if n else 0.0
        if row is None or row.acceptance is None:
            why = f"cluster {c}: not measured by probe {probe_id}, so its pool share"
        else:
            side = "below" if row.acceptance < mean else "at or above"
            why = (f"cluster {c}: the draft accepts {row.acceptance:.2f} on {row.prompts} probe prompt(s), {side} "
                   f"the pool's {mean:.2f}")
        out.append(Selection(p, c, f"{why}; {pool_share:.1%} of the pool -> {batch_share:.1%} of this batch "
                                   f"(strength {strength:g}, probe {probe_id})",
                             pool_share, batch_share, None if row is None else row.acceptance, probe_id))
        if len(out) == n:
            break
    return out


def choose_batch(store, params_key: str, retry_failed: bool, limit: int | None,
                 policy: Literal["uniform", "acceptance"], strength: float) -> list[Selection]:
    """The next regenerate batch from the store: its pending queue, pool and (acceptance) latest probe."""
    from tasks.discover.domains import TAGGER

    queue = store.generations.pending_queue(params_key, retry_failed, TAGGER)
    if policy == "uniform":
        return select_prompts(queue, limit, policy)
    probe = [ProbeRow(r["cluster"], r["acceptance"], r["prompts"], r["probe_id"]) for r in store.selection.latest_probe(TAGGER)]
    return select_prompts(queue, limit, policy, store.selection.cluster_pool(TAGGER), probe, strength)


def selection_table(chosen: list[Selection]) -> list[dict]:
    """Per cluster: prompts chosen, pool and batch shares, probe acceptance (the regenerate artifact)."""
    rows: dict[str, dict] = {}
    for s in chosen:
        r = rows.setdefault(s.cluster, {"cluster": s.cluster, "prompts": 0, "pool_share": s.pool_share,
                                        "batch_share": s.batch_share, "probe_acceptance": s.acceptance,
                                        "reason": s.reason})
        r["prompts"] += 1
    return sorted(rows.values(), key=lambda r: -r["prompts"])
