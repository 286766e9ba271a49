"""The per-cluster probe: a draft's acceptance on a few held-out prompts of each cluster.

Owns which held-out prompts the probe measures and the rows it reports. Promises: the probe never
measures the benchmark's held-out prompts (the first `skip_first` in held-out order), so selection
steered by it never steers by the evaluation set; its prompts per cluster are the first
`per_cluster` of that cluster after them, so two probes of one workspace measure the same prompts
and differ only by the draft; acceptance is measured as the benchmark measures it (tasks.evaluate.offline,
greedy chain of depth k, lossless-checked), per cluster.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from tasks.discover.domains import CLUSTERS, TAGGER, domain_of
from tasks.evaluate.heldout import chat_opening


def probe_sets(heldout: Sequence[tuple[str, list[dict], str]], skip_first: int,
               per_cluster: int) -> list[tuple[str, list[tuple[str, list[dict]]]]]:
    """(cluster, [(prompt id, request messages)]) for each cluster with held-out prompts past the
    benchmark's, in `CLUSTERS` order (then any other cluster by name)."""
    by_cluster: dict[str, list[tuple[str, list[dict]]]] = {}
    for prompt_id, messages, cluster in list(heldout)[skip_first:]:
        mine = by_cluster.setdefault(cluster, [])
        if len(mine) < per_cluster:
            mine.append((prompt_id, chat_opening(messages)))
    order = [c for c in CLUSTERS if c in by_cluster] + sorted(c for c in by_cluster if c not in CLUSTERS)
    return [(c, by_cluster[c]) for c in order]


def measure_probe(model, tokenizer, chat_template: str | None, draft, sets: list[tuple[str, list[tuple[str, list[dict]]]]],
                  k: int, max_new_tokens: int, export_dir: str, checkpoint: str | None,
                  run_id: str | None = None) -> list[dict]:
    """One probe: the draft's acceptance in each cluster, as `probe_results` rows (one probe id)."""
    from tasks.evaluate.offline import offline_acceptance

    report = offline_acceptance(model, tokenizer, draft, chat_template=chat_template,
                                sets=[(c, [m for _, m in items]) for c, items in sets], limit=None, k=k,
                                max_new_tokens=max_new_tokens, baselines=False)
    drafter = report.drafters[0]
    probe_id = uuid.uuid4().hex[:16]
    rows = []
    for cluster, items in sets:
        a = report.get(drafter, cluster)
        rows.append({"probe_id": probe_id, "checkpoint": checkpoint, "export_dir": export_dir, "tagger": TAGGER,
                     "cluster": cluster, "domain": domain_of(cluster),
                     "prompts": a.requests, "verify_rounds": a.verify_rounds,
                     "completion_tokens": a.completion_tokens, "acceptance": a.acceptance_length_token_weighted,
                     "k": k, "max_new_tokens": max_new_tokens, "prompt_ids": [p for p, _ in items],
                     "run_id": run_id})
    return rows
