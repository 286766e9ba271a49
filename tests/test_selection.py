"""Acceptance-aware selection: prompt tags in discover, the selection policy, why each prompt was sent,
and the per-cluster probe on a real (tiny) target and exported draft."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from flows.discover import discover
from flows.regenerate import regenerate
from storage.lineage import LineageStore
from tasks.config import DiscoverConfig, ProbeConfig, RegenerateConfig
from tasks.discover.domains import CLUSTERS, TAGGER, tag_prompt, tag_untagged
from tasks.evaluate.probe import probe_sets
from tasks.regenerate.selection import ProbeRow, cluster_weights, quotas, select_prompts

CODE = ["Why does my python function `def f(x): return x+1` raise a TypeError when I call f('a')?",
        "Write a SQL query: SELECT name FROM users WHERE age > 30; how do I add an index?",
        "```js\nconst a = [1,2];\nconsole.log(a.map(x => x * 2));\n```\nWhat does this print?"]
MATH = ["Solve the equation 3x + 7 = 22 and explain each step.",
        "What is the probability of rolling two sixes with two dice? Calculate 1/6 * 1/6."]
MULTI = ["请帮我写一封感谢信给我的老师，感谢她一年来的帮助。", "Какая столица Австралии и почему не Сидней?"]
WRITING = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Compose a poem about autumn leaves falling in the park."]
GENERAL = ["What are good ways to stay focused while working from home?",
           "Tell me about the history of the Roman empire in a few sentences."]


@pytest.mark.parametrize("cluster,texts", [("code", CODE), ("math", MATH), ("multilingual", MULTI),
                                           ("writing", WRITING), ("general", GENERAL)])
def test_each_prompt_gets_the_cluster_its_text_shows(cluster, texts):
    for t in texts:
        tag = tag_prompt(t)
        assert (tag.cluster, tag.domain) == (cluster, "code" if cluster == "code" else "chat"), t
        assert tag.signals and tag_prompt(t) == tag


def test_weights_favour_clusters_the_draft_accepts_least_relative_to_their_share():
    pool = {"code": 100, "general": 800, "math": 100}
    w = cluster_weights(pool, {"code": 1.2, "general": 1.6, "math": 1.6}, strength=2.0)
    assert sum(w.values()) == pytest.approx(1.0)
    assert w["code"] > 0.1 and w["general"] < 0.8 and w["math"] < 0.1  # code gains, the others give way
    assert w["general"] / w["math"] == pytest.approx(8.0)  # equal acceptance: pool ratio kept
    assert cluster_weights(pool, {"code": 1.2, "general": 1.6}, 0.0) == pytest.approx({c: n / 1000 for c, n in pool.items()})
    # a cluster the probe did not measure keeps its pool share's weight relative to the mean
    w2 = cluster_weights({"a": 50, "b": 50}, {"a": 1.5}, 2.0)
    assert w2 == pytest.approx({"a": 0.5, "b": 0.5})


def test_quotas_sum_to_the_batch_and_never_exceed_what_a_cluster_has():
    take = quotas({"a": 0.7, "b": 0.2, "c": 0.1}, {"a": 3, "b": 50, "c": 50}, 20)
    assert sum(take.values()) == 20 and take["a"] == 3 and take["b"] > take["c"] > 0
    assert quotas({"a": 1.0}, {"a": 2, "b": 5}, 100) == {"a": 2, "b": 5}  # asked for more than pending: all
    assert sum(quotas({"a": 0.34, "b": 0.33, "c": 0.33}, {"a": 9, "b": 9, "c": 9}, 10).values()) == 10


def test_selection_policies_choose_in_queue_order_and_say_why():
    queue = [(f"p{i:03d}", "code" if i % 10 == 0 else "general") for i in range(200)]
    uniform = select_prompts(queue, 20, "uniform")
    assert [s.prompt_id for s in uniform] == [p for p, _ in queue[:20]] and "uniform" in uniform[0].reason
    before = select_prompts(queue, 20, "acceptance", {"code": 20, "general": 180}, [])
    assert [s.prompt_id for s in before] == [p for p, _ in queue[:20]] and "before any probe" in before[0].reason
    probe = [ProbeRow("code", 1.1, 4, "pr"), ProbeRow("general", 1.7, 4, "pr")]
    chosen = select_prompts(queue, 20, "acceptance", {"code": 20, "general": 180}, probe)
    by = Counter(s.cluster for s in chosen)
    assert len(chosen) == 20 and by["code"] > 2  # uniform would take 2 of 20
    ids = [s.prompt_id for s in chosen]
    assert ids == sorted(ids) and len(set(ids)) == 20  # queue order, each once
    code = next(s for s in chosen if s.cluster == "code")
    assert "cluster code" in code.reason and "1.10" in code.reason and "below" in code.reason
    assert code.probe_id == "pr" and code.batch_share > code.pool_share
    with pytest.raises(ValueError, match="unknown selection policy"):
        select_prompts(queue, 5, "random")


def test_probe_sets_skip_the_benchmarks_prompts_and_take_the_first_of_each_cluster():
    held = [(f"h{i}", [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}],
             "code" if i % 3 == 0 else "general") for i in range(12)]
    sets = dict(probe_sets(held, skip_first=4, per_cluster=2))
    assert [p for p, _ in sets["code"]] == ["h6", "h9"] and [p for p, _ in sets["general"]] == ["h4", "h5"]
    assert sets["code"][0][1] == [{"role": "user", "content": "q6"}]  # the request: up to the first user turn
    assert list(dict(probe_sets(held, 0, 1))) == [c for c in CLUSTERS if c in ("code", "general")]


def _catalog(tmp_path: Path, n_each: int = 6) -> Path:
    rows = []
    for cluster, texts in (("code", CODE), ("math", MATH), ("writing", WRITING), ("general", GENERAL)):
        for i in range(n_each):
            rows.append({"id": f"{cluster}{i}", "conversations": [
                {"from": "human", "value": f"{texts[i % len(texts)]} (case {i} of {cluster})"},
                {"from": "gpt", "value": "an answer"}]})
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(rows))
    return path


def _discover(ws: Path, path: Path, **heldout) -> None:
    discover(DiscoverConfig.model_validate({
        "workspace": str(ws), "sources": [{"name": "c", "kind": "file", "path": str(path)}],
        "decontaminate": {"enabled": False}, "near_dedupe": {"enabled": False}, **heldout}))


def test_discover_tags_every_stored_prompt_and_a_rerun_tags_what_is_missing(prefect_api, tmp_path, workspace):
    _discover(workspace, _catalog(tmp_path))
    store = LineageStore(workspace / "lineage.duckdb")
    q = lambda sql: store.reports.query_readonly(sql)[1]  # noqa: E731
    assert q("SELECT count(*) FROM prompts") == q("SELECT count(*) FROM prompt_tags") == [(24,)]
    clusters = dict(q("SELECT cluster, count(*) FROM prompt_clusters GROUP BY 1"))
    assert clusters == {"code": 6, "math": 6, "writing": 6, "general": 6}
    assert store.selection.cluster_pool(TAGGER) == clusters
    # tags lost (or a tagger change): the next discover, or tag_untagged, tags them again, once
    with store.db.write() as con:
        con.execute("DELETE FROM prompt_tags WHERE cluster = 'math'")
    assert tag_untagged(store) == 6 and tag_untagged(store) == 0
    assert dict(q("SELECT cluster, count(*) FROM prompt_clusters GROUP BY 1")) == clusters


def test_acceptance_selection_sends_more_where_the_probe_is_low_and_lineage_says_why(prefect_api, scripted, tmp_path,
                                                                                    workspace):
    _discover(workspace, _catalog(tmp_path, n_each=10))
    store = LineageStore(workspace / "lineage.duckdb")
    store.selection.write_probe([{"probe_id": "p1", "checkpoint": "ck", "export_dir": "/x", "tagger": TAGGER, "cluster": c,
                        "domain": "code" if c == "code" else "chat", "prompts": 4, "verify_rounds": 10,
                        "completion_tokens": int(a * 10), "acceptance": a, "k": 3, "max_new_tokens": 48,
                        "prompt_ids": ["h"], "run_id": None}
                       for c, a in (("code", 1.1), ("math", 1.8), ("writing", 1.8), ("general", 1.8))])
    url = scripted()
    cfg = RegenerateConfig.model_validate({
        "workspace": str(workspace), "target_model": "scripted", "endpoints": [{"url": url, "max_concurrency": 4}],
        "sampling": {"max_tokens": 16}, "limit": 12, "selection": "acceptance", "selection_strength": 2.0})
    summary = regenerate(cfg)
    assert summary.generated == 12
    q = lambda sql: store.reports.query_readonly(sql)[1]  # noqa: E731
    sent = dict(q("SELECT s.cluster, count(*) FROM prompt_selections s JOIN generations g USING (prompt_id) "
                  "GROUP BY 1"))
    assert sum(sent.values()) == 12 and sent["code"] >= 5  # a quarter of the pool, at least 5 of 12 of the batch
    # every generation has a selection row naming its cluster, the probe and the acceptance it read
    rows = q("SELECT g.prompt_id, s.policy, s.probe_id, s.reason FROM generations g "
             "LEFT JOIN prompt_selections s USING (prompt_id)")
    assert len(rows) == 12 and all(p == "acceptance" and pr == "p1" and "probe p1" in why for _, p, pr, why in rows)
    # the next uniform batch takes the queue's head, and says so
    summary = regenerate(cfg.model_copy(update={"selection": "uniform", "limit": 4}))
    assert summary.generated == 4
    assert q("SELECT DISTINCT reason FROM prompt_selections WHERE policy = 'uniform'") == [("uniform: next in queue order",)]


def test_the_probe_measures_each_cluster_past_the_benchmarks_prompts_once_per_export(prefect_api, tmp_path, workspace,
                                                                                     tiny_target):
    from flows.probe import probe
    from helpers import random_smollm2_export

    _discover(workspace, _catalog(tmp_path), heldout={"fraction": 0.5, "cap": 100})
    store = LineageStore(workspace / "lineage.duckdb")
    held = store.selection.heldout_tagged(TAGGER)
    assert len(held) >= 6 and len({c for _, _, c in held}) >= 2
    export = random_smollm2_export(tiny_target, tmp_path / "draft", aux=(1, 3, 5))
    run_id = store.runs.begin("train", {}, "t", None, None)
    store.checkpoints.register(run_id, {"checkpoint": "ck1", "run_name": "t", "step": 1, "format": "sglang",
                                       "path": str(export), "sha256": "-", "rounds": 1, "target": "tiny",
                                       "target_revision": "-", "aux_layer_ids": [1, 3, 5], "vocab_id": "-",
                                       "extract_key": "-"})
    cfg = ProbeConfig(workspace=str(workspace), target={"model_path": str(tiny_target), "dtype": "float32",
                                                        "device": "cpu"},
                      per_cluster=2, draft_tokens=2, max_new_tokens=6, skip_first=2)
    summary = probe(cfg)
    expected = dict(probe_sets(held, 2, 2))
    assert [r["cluster"] for r in summary.rows] == list(expected)
    for r in summary.rows:
        assert r["prompt_ids"] == [p for p, _ in expected[r["cluster"]]]
        assert not set(r["prompt_ids"]) & {p for p, _, _ in held[:2]}  # never the benchmark's
        assert r["prompts"] == len(r["prompt_ids"]) and r["completion_tokens"] > 0 and r["acceptance"] >= 1.0
    assert [r["cluster"] for r in store.selection.latest_probe(TAGGER)] == sorted(expected)
    again = probe(cfg)
    assert again.skipped and "already probed" in again.skipped and again.probe_id == summary.probe_id
