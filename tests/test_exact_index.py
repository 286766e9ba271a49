"""Exact dedupe's in-memory lookups (storage/exact_index.py) answer as the store's own SQL does."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from storage.exact_index import ExactIndexStore, _arrow_id_keys, id_keys
from storage.lineage import LineageStore
from tasks.config import NearDedupeConfig
from tasks.discover.outcomes import decide_and_write, decide_outcomes
from tests.test_dedupe import FORMATS, _planted_records, _records, _reported_case


def _sql_answer(store: LineageStore, ids: list[str]):
    stored = store.exact_index.existing_prompt_ids(ids)
    return stored, store.exact_index.duplicate_chain_targets([p for p in ids if p not in stored])


def test_id_keys_are_the_ids_own_bits_and_tell_any_two_ids_apart():
    ids = [hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in range(500)]
    keys = id_keys(ids)
    assert keys.dtype == np.dtype("S16") and len(set(keys.tolist())) == 500
    assert all(k.ljust(16, b"\0") == bytes.fromhex(p) for k, p in zip(keys.tolist(), ids))
    odd = ["a", "é" * 32, "G" * 32, ids[0].upper(), ids[0] + "0"]  # not ids prompt_id_of makes
    assert len(set(id_keys(odd + ids[:1]).tolist())) == 6
    # Read from Arrow buffers (a slice, with an offset) or from Python strings: the same keys.
    assert (_arrow_id_keys(pa.array(ids).slice(7, 100)) == keys[7:107]).all()
    assert (_arrow_id_keys(pa.array(odd + ids[:1])) == id_keys(odd + ids[:1])).all()


def test_exact_matches_answer_as_the_store_does_batch_after_batch_and_load_once(tmp_path, monkeypatch):
    loads = []
    real = ExactIndexStore._load_exact
    monkeypatch.setattr(ExactIndexStore, "_load_exact", lambda self, *a: (loads.append(1), real(self, *a))[1])
    store = LineageStore(tmp_path / "l.duckdb")
    records = _records(_planted_records())
    seen: list[str] = []
    checked = []

    def compare(batch) -> None:
        seen.extend(r["prompt_id"] for r in batch.records if r["prompt_id"])
        ids = sorted(set(seen)) + ["0" * 32, "not an id"]
        assert store.exact_index.matches(ids) == _sql_answer(store, ids)
        checked.append(len(batch.records))

    chunks = [records[k : k + 37] for k in range(0, len(records), 37)]
    decide_and_write(chunks, "run", FORMATS, store, NearDedupeConfig(), None, on_written=compare)
    assert sum(checked) == len(records)
    stored, earlier = store.exact_index.matches(sorted(set(seen)))
    assert len(earlier) >= 10  # the fixture has texts only seen as near duplicates, and their twins
    assert loads == []  # begun on an empty store, the only writer: each batch added, never loaded
    again = LineageStore(tmp_path / "l.duckdb")  # a new process: loads it from the store, once
    ids = sorted(set(seen))
    assert again.exact_index.matches(ids) == (stored, earlier) == _sql_answer(again, ids) and len(loads) == 1


def test_prompts_and_chains_another_writer_stored_are_found(tmp_path):
    case = _reported_case()
    path = tmp_path / "l.duckdb"
    ours, other = LineageStore(path), LineageStore(path)  # another process, as far as each knows
    first = decide_outcomes(_records(["an unrelated first prompt " * 5]), FORMATS, ours, NearDedupeConfig(), None)
    ours.discover.write_batch("run1", first.records, first.prompts, first.minhash)
    assert ours.exact_index.matches([first.records[0]["prompt_id"]])[0] == {first.records[0]["prompt_id"]}  # loaded

    theirs = decide_outcomes(_records([case["edit"], case["base"]], start=1), FORMATS, other, NearDedupeConfig(), None)
    other.discover.write_batch("run2", theirs.records, theirs.prompts, theirs.minhash)
    edit_id, base_id = theirs.records[0]["prompt_id"], theirs.records[1]["prompt_id"]
    assert [r["outcome"] for r in theirs.records] == ["kept", "near_duplicate"]
    stored, earlier = ours.exact_index.matches([edit_id, base_id])
    assert stored == {edit_id} and earlier == {base_id: (edit_id, theirs.records[1]["similarity"])}
    # So a record of the base text after them is an exact duplicate naming their kept prompt.
    again = decide_outcomes(_records([case["upper"]], start=3), FORMATS, ours, NearDedupeConfig(), None)
    assert again.records[0]["outcome"] == "exact_duplicate" and again.records[0]["duplicate_of"] == edit_id


def test_a_row_naming_a_prompt_that_is_not_stored_leaves_the_chain_to_the_store(tmp_path):
    case = _reported_case()
    store = LineageStore(tmp_path / "l.duckdb")
    warm = decide_outcomes(_records(["an unrelated first prompt " * 5]), FORMATS, store, NearDedupeConfig(), None)
    store.discover.write_batch("run1", warm.records, warm.prompts, warm.minhash)
    store.exact_index.matches(["0" * 32])  # the index is loaded, and told of each batch from now on
    batch = decide_outcomes(_records([case["edit"], case["base"]], start=1), FORMATS, store, NearDedupeConfig(), None)
    edit_id, base_id = batch.records[0]["prompt_id"], batch.records[1]["prompt_id"]
    # As old code wrote it: an exact duplicate naming the base, itself a near duplicate of the edit.
    legacy = {**batch.records[1], "record_key": "L9", "prompt_id": "f" * 32, "outcome": "exact_duplicate",
              "duplicate_of": base_id, "similarity": None}
    store.discover.write_batch("old", batch.records + [legacy], batch.prompts, batch.minhash)
    ids = [edit_id, base_id, "f" * 32]
    assert store.exact_index.matches(ids) == _sql_answer(store, ids)
    assert store.exact_index.matches(ids)[1]["f" * 32][0] == edit_id  # followed through the base


def test_runs_stay_under_their_cap_and_a_key_keeps_the_values_it_came_with_first(monkeypatch):
    import storage.exact_index as exact_index

    monkeypatch.setattr(exact_index, "_MAX_RUN", 64)
    ids = [hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in range(1000)]
    index = exact_index.ExactIndex(0, 0)
    for k in range(0, 1000, 37):
        index.stored.add(id_keys(ids[k : k + 37]))
        # Chains of the same texts added again later with other values (as a later batch's rows would).
        index.add_chains({p: (ids[0], 0.5) for p in ids[k : k + 37]} | {p: (ids[1], 0.25) for p in ids[:k]})
    assert max(len(r[0]) for r in index.stored.runs) <= 64 and len(index.stored) == 1000
    assert index.stored.contains(id_keys(ids)).all() and not index.stored.contains(id_keys(["0" * 32])).any()
    index.add_chains({"f" * 32: ("not a hex id", None)})
    _, earlier = index.matches(ids[500:] + ["f" * 32])
    assert earlier == {"f" * 32: ("not a hex id", None)}  # the others are stored
    fresh = exact_index.ExactIndex(0, 0)
    fresh.add_chains({p: (ids[0], 0.5) for p in ids[:100]})
    fresh.add_chains({p: (ids[1], 0.25) for p in ids[:200]})
    _, earlier = fresh.matches(ids[:200])
    assert all(earlier[p] == (ids[0], 0.5) for p in ids[:100]) and all(earlier[p] == (ids[1], 0.25) for p in ids[100:200])
