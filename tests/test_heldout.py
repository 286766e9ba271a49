"""The held-out chat set: a deterministic split in discover, never regenerated, never duplicated into training."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from flows.discover import discover
from flows.regenerate import regenerate
from storage.lineage import LineageStore
from tasks.config import DiscoverConfig, RegenerateConfig
from tasks.evaluate.heldout import HELDOUT_DOMAIN, chat_opening, choose_heldout, heldout_set, split_key

ROOT = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(5000)]


def long_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(150)) for _ in range(n)]


def edited(text: str, at: int) -> str:
    words = text.split()
    words[at] = "changed"
    return " ".join(words)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts))
    return path


def discover_config(ws: Path, sources: dict[str, Path], fraction: float, cap: int) -> DiscoverConfig:
    return DiscoverConfig.model_validate({
        "workspace": str(ws), "sources": [{"name": n, "kind": "file", "path": str(p)} for n, p in sources.items()],
        "decontaminate": {"enabled": False}, "heldout": {"fraction": fraction, "cap": cap}})


def rows(ws: Path, sql: str) -> list[tuple]:
    return LineageStore(ws / "lineage.duckdb").reports.query_readonly(sql)[1]


def outcome_rows(ws: Path) -> dict[tuple[str, str], tuple[str, str, str | None]]:
    """(source, record key) -> (outcome, prompt id, duplicate_of) of every record with a prompt."""
    out = {}
    for src, key, outcome, pid, dup in rows(ws, "SELECT source, record_key, outcome, prompt_id, duplicate_of "
                                                "FROM record_outcomes WHERE prompt_id IS NOT NULL"):
        out[(src, key)] = (outcome, pid, dup)
    return out


def test_split_key_is_a_pure_function_of_the_prompt_id_across_processes():
    ids = [f"{i:064x}" for i in range(50)]
    here = [split_key(p) for p in ids]
    code = "import sys, json; from tasks.evaluate.heldout import split_key; print(json.dumps([split_key(p) for p in sys.argv[1:]]))"
    other = subprocess.run([sys.executable, "-c", code, *ids], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert json.loads(other.stdout) == here
    assert all(0 <= k < 1 for k in here) and len(set(here)) == len(here)


def test_choose_heldout_respects_fraction_cap_and_ignores_order():
    ids = [f"prompt-{i}" for i in range(4000)]
    chosen = choose_heldout(ids, 0.1, room=10_000)
    assert all(split_key(p) < 0.1 for p in chosen)
    assert set(chosen) == {p for p in ids if split_key(p) < 0.1}
    assert 300 < len(chosen) < 500  # a 10% hash split of 4000 ids (binomial sd ~19)
    capped = choose_heldout(ids, 0.1, room=7)
    assert len(capped) == 7 and capped == sorted(chosen, key=split_key)[:7]  # the smallest keys fill the cap
    shuffled = ids[:]
    random.Random(3).shuffle(shuffled)
    assert choose_heldout(shuffled, 0.1, room=7) == capped
    assert choose_heldout(ids, 0.0, room=7) == [] and choose_heldout(ids, 0.1, room=0) == []


def test_heldout_set_is_each_chat_up_to_its_first_user_turn():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "written by a person"}, {"role": "user", "content": "More?"}]
    assert chat_opening(msgs) == msgs[:2]
    assert heldout_set([("p1", msgs)]) == (HELDOUT_DOMAIN, [msgs[:2]])
    assert heldout_set([]) is None


def test_discover_holds_out_by_hash_counts_reconcile_and_duplicates_of_heldout_are_never_kept(
        prefect_api, tmp_path, workspace):
    originals = long_prompts(30, seed=1)
    # run 1: 30 prompts, then a near copy of each (one word changed) in the same batch
    first = write_jsonl(tmp_path / "a.jsonl", originals + [edited(t, 75) for t in originals])
    s1 = discover(discover_config(workspace, {"a": first}, fraction=0.3, cap=100))
    assert s1.reconciles and s1.records_in == 60
    decided = outcome_rows(workspace)
    roots = {decided[("a", f"L{i + 1}")][1]: i for i in range(30)}
    expected = {p for p in roots if split_key(p) < 0.3}
    held = {pid for o, pid, _ in decided.values() if o == "heldout"}
    assert held == expected and held, "the held-out set is exactly the prompts whose key is below the fraction"
    assert s1.outcomes["heldout"] == len(held) and s1.outcomes["kept"] == 30 - len(held)
    assert s1.outcomes["near_duplicate"] == 30
    for i in range(30):  # every near copy names its original, held out or not: never kept
        outcome, _, dup = decided[("a", f"L{31 + i}")]
        assert outcome == "near_duplicate" and roots[dup] == i
    assert {r[0] for r in rows(workspace, "SELECT prompt_id FROM heldout_prompts")} == held

    # run 2: other near copies and exact copies (case and spacing changed) of the held-out prompts, and new prompts
    held_texts = [originals[roots[p]] for p in sorted(held)]
    fresh = long_prompts(20, seed=2)
    second = write_jsonl(tmp_path / "b.jsonl", [edited(t, 20) for t in held_texts]
                         + ["  " + t.upper() for t in held_texts] + fresh)
    s2 = discover(discover_config(workspace, {"a": first, "b": second}, fraction=0.3, cap=100))
    assert s2.reconciles and s2.records_in == 2 * len(held_texts) + 20
    decided = outcome_rows(workspace)
    n = len(held_texts)
    for i, text in enumerate(held_texts):
        near, exact = decided[("b", f"L{i + 1}")], decided[("b", f"L{n + i + 1}")]
        assert near[0] == "near_duplicate" and near[2] in held
        assert exact[0] == "exact_duplicate" and exact[2] in held
    # no prompt kept for training is a copy of a held-out one; totals reconcile over both runs
    kept_texts = {r[0] for r in rows(workspace, "SELECT p.messages[1].content FROM prompts p JOIN records r "
                                                "USING (prompt_id) WHERE r.outcome = 'kept'")}
    assert not kept_texts & set(held_texts)
    total = dict(rows(workspace, "SELECT outcome, count(*) FROM record_outcomes GROUP BY 1"))
    assert sum(total.values()) == 60 + s2.records_in
    assert total["heldout"] + total["kept"] == rows(workspace, "SELECT count(*) FROM prompts")[0][0]


def test_the_cap_holds_across_runs(prefect_api, tmp_path, workspace):
    first = write_jsonl(tmp_path / "a.jsonl", long_prompts(30, seed=4))
    discover(discover_config(workspace, {"a": first}, fraction=0.5, cap=2))
    held = [r[0] for r in rows(workspace, "SELECT prompt_id FROM record_outcomes WHERE outcome = 'heldout'")]
    kept = [r[0] for r in rows(workspace, "SELECT prompt_id FROM record_outcomes WHERE outcome = 'kept'")]
    below = sorted((p for p in held + kept if split_key(p) < 0.5), key=split_key)
    assert len(below) > 2 and sorted(held) == sorted(below[:2])  # the two smallest keys of the batch
    second = write_jsonl(tmp_path / "b.jsonl", long_prompts(30, seed=5))
    s2 = discover(discover_config(workspace, {"a": first, "b": second}, fraction=0.5, cap=2))
    new_ids = [r[0] for r in rows(workspace, "SELECT prompt_id FROM record_outcomes WHERE source = 'b'")]
    assert any(split_key(p) < 0.5 for p in new_ids)  # candidates existed, but the cap is full
    assert s2.outcomes["heldout"] == 0 and s2.outcomes["kept"] == 30 and s2.reconciles


def test_regenerate_never_writes_a_generation_for_a_heldout_prompt(prefect_api, scripted, tmp_path, workspace):
    texts = long_prompts(24, seed=6)
    discover(discover_config(workspace, {"a": write_jsonl(tmp_path / "a.jsonl", texts)}, fraction=0.3, cap=100))
    held = {r[0] for r in rows(workspace, "SELECT prompt_id FROM heldout_prompts")}
    kept = {r[0] for r in rows(workspace, "SELECT prompt_id FROM record_outcomes WHERE outcome = 'kept'")}
    assert held and kept
    # an import that is an exact copy of a held-out prompt, with an answer, must not become training data either
    held_text = rows(workspace, "SELECT messages[1].content FROM heldout_prompts ORDER BY prompt_id LIMIT 1")[0][0]
    assert held_text in texts
    seed = tmp_path / "seed.jsonl"
    seed.write_text(json.dumps({"messages": [{"role": "user", "content": held_text},
                                             {"role": "assistant", "content": "an answer"}]}) + "\n")
    cfg = RegenerateConfig.model_validate({
        "workspace": str(workspace), "target_model": "scripted", "target_revision": "r1",
        "endpoints": [{"url": scripted(), "max_concurrency": 4}], "sampling": {"max_tokens": 16},
        "imports": [{"name": "seed", "path": str(seed), "decontaminate": {"enabled": False}}]})
    summary = regenerate(cfg)
    assert summary.imported == 0 and summary.generated == len(kept)
    assert rows(workspace, "SELECT outcome FROM record_outcomes WHERE source = 'import:seed'") == [("exact_duplicate",)]
    generated = {r[0] for r in rows(workspace, "SELECT prompt_id FROM generations")}
    assert generated == kept and not generated & held
    progress = {r[0]: r for r in rows(workspace, "SELECT stage, done, pending FROM progress")}
    assert progress["regenerate"][1:] == (len(kept), 0)  # held-out prompts are not pending work
    assert regenerate(cfg).generated == 0  # a rerun finds nothing to do: still none for them
