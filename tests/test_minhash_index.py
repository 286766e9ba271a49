"""The near-dedupe index as segment files: crash between segment write and registration, a second
process's segments, upgrade from the in-database index, and what it costs the lineage file."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import storage.connection
from storage.lineage import LineageStore
from storage.minhash_index import MinhashIndex, NearIndexStore, params_folder
from storage.migrations import MIGRATIONS
from tasks.config import NearDedupeConfig
from tasks.discover.dedupe import band_keys, lsh_params, signatures
from tasks.discover.outcomes import backfill_signatures, decide_outcomes, minhash_params_key
from tasks.discover.sources import RawRecord

FORMATS = {"s": ("prompt_response", "prompt", "response")}
NEAR = NearDedupeConfig()


def _texts(seed: int, n: int, words: tuple[int, int] = (100, 200)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(20_000)}" for _ in range(rng.randint(*words))) for _ in range(n)]


def _edit(text: str, seed: int) -> str:
    w = text.split()
    w[random.Random(seed).randrange(len(w))] = "edited"
    return " ".join(w)


def _records(texts: list[str], start: int = 0) -> list[RawRecord]:
    return [RawRecord("s", f"L{start + k}", {"prompt": t}) for k, t in enumerate(texts)]


def _outcomes(rows: list[dict]) -> list[tuple]:
    return [(r["record_key"], r["outcome"], r["prompt_id"], r["duplicate_of"]) for r in rows]


def _segment_files(store: LineageStore) -> list[str]:
    folder = params_folder(store.path.parent, minhash_params_key(NEAR))
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_crash_between_segment_write_and_registration_leaves_a_file_that_is_removed(tmp_path, monkeypatch):
    base = _texts(1, 60)
    first = _records(base)
    second = _records([_edit(t, k) for k, t in enumerate(base[:30])] + _texts(2, 30), start=100)

    # The reference: both batches written without a crash.
    ref = LineageStore(tmp_path / "ref" / "lineage.duckdb")
    b1 = decide_outcomes(first, FORMATS, ref, NEAR, None)
    ref.discover.write_batch("r1", b1.records, b1.prompts, b1.minhash)
    expected = _outcomes(decide_outcomes(second, FORMATS, ref, NEAR, None).records)
    assert sum(o == "near_duplicate" for _, o, _, _ in expected) == 30

    store = LineageStore(tmp_path / "ws" / "lineage.duckdb")
    b1 = decide_outcomes(first, FORMATS, store, NEAR, None)
    real_execute_registry = NearIndexStore.insert_segment

    def crash_after_files(self, con, params, ids, sig, keys):
        real_execute_registry(self, con, params, ids, sig, keys)  # files written and registered ...
        raise KeyboardInterrupt("killed before commit")  # ... but the transaction never commits

    monkeypatch.setattr(NearIndexStore, "insert_segment", crash_after_files)
    with pytest.raises(KeyboardInterrupt):
        store.discover.write_batch("r1", b1.records, b1.prompts, b1.minhash)
    monkeypatch.undo()
    left = _segment_files(store)
    assert len(left) == 3  # one segment's ids, sig and keys, never registered
    assert store.reports.query_readonly("SELECT count(*) FROM minhash_segments")[1] == [(0,)]
    assert store.reports.query_readonly("SELECT count(*) FROM prompts")[1] == [(0,)]

    # The rerun (a new process): the unregistered files go when the index is opened, the replayed
    # batch is committed, and the next batch gets the same outcomes as without the crash.
    again = LineageStore(store.path)
    replay = decide_outcomes(first, FORMATS, again, NEAR, None)
    assert _segment_files(again) == []
    assert _outcomes(replay.records) == _outcomes(b1.records)
    again.discover.write_batch("r1", replay.records, replay.prompts, replay.minhash)
    assert again.reports.query_readonly("SELECT sum(rows) FROM minhash_segments")[1] == [(60,)]
    assert _outcomes(decide_outcomes(second, FORMATS, again, NEAR, None).records) == expected
    # Replaying a committed batch indexes nothing twice: its prompts are stored already.
    again.discover.write_batch("r1", replay.records, replay.prompts, replay.minhash)
    assert again.reports.query_readonly("SELECT sum(rows), count(*) FROM minhash_segments")[1] == [(60, 1)]
    assert len(_segment_files(again)) == 3


def test_a_second_store_object_sees_segments_another_process_registered(tmp_path):
    path = tmp_path / "lineage.duckdb"
    mine, theirs = LineageStore(path), LineageStore(path)
    base = _texts(3, 40)
    first = decide_outcomes(_records(base), FORMATS, mine, NEAR, None)  # loads (an empty) index in `mine`
    mine.discover.write_batch("a", first.records, first.prompts, first.minhash)
    other = decide_outcomes(_records(_texts(4, 40), start=100), FORMATS, theirs, NEAR, None)
    theirs.discover.write_batch("b", other.records, other.prompts, other.minhash)
    # `mine` had its index loaded before `theirs` wrote: the next lookup picks their segment up.
    near_theirs = [_edit(t, k) for k, t in enumerate(_texts(4, 40)[:10])]
    batch = decide_outcomes(_records(near_theirs, start=200), FORMATS, mine, NEAR, None)
    kept_by_theirs = {r["prompt_id"] for r in other.records if r["outcome"] == "kept"}
    assert [r["outcome"] for r in batch.records] == ["near_duplicate"] * 10
    assert {r["duplicate_of"] for r in batch.records} <= kept_by_theirs
    assert mine.near_index.load(minhash_params_key(NEAR), NEAR.num_perm, 16).size == 80


def test_an_old_schema_workspace_upgrades_and_still_finds_a_near_duplicate(tmp_path, monkeypatch):
    path = tmp_path / "lineage.duckdb"
    base = _texts(5, 20)
    params = minhash_params_key(NEAR)
    bands, rows = lsh_params(NEAR.threshold, NEAR.num_perm)
    # A workspace at schema 11: prompts and their rows in the in-database index, as the old code wrote them.
    monkeypatch.setattr(storage.connection, "MIGRATIONS", [m for m in MIGRATIONS if m[0] <= 11])
    old = LineageStore(path)
    batch = decide_outcomes(_records(base), FORMATS, old, NEAR, None)
    sig = signatures(base, NEAR.num_perm, NEAR.ngram, NEAR.shingle)
    keys = band_keys(sig, bands, rows)
    ids = [r["prompt_id"] for r in batch.records]
    with old.db.write() as con:
        old.discover.insert_batch(con, "old", storage.connection.utc_now(), batch.records, batch.prompts, None)
        for pid, s, k in zip(ids, sig, keys):
            con.execute("INSERT INTO prompt_minhash VALUES (?, ?, ?)", [pid, params, s.tobytes()])
            con.executemany("INSERT INTO prompt_lsh_bands VALUES (?, ?, ?, ?)",
                            [[params, b, int(k[b]), pid] for b in range(bands)])
    assert old.db.schema_version() == 11
    monkeypatch.undo()

    store = LineageStore(path)
    assert backfill_signatures(store, NEAR) == 20  # the index is built from the stored prompts
    assert store.db.schema_version() == max(v for v, _, _ in MIGRATIONS)
    tables = {t for (t,) in store.reports.query_readonly("SELECT table_name FROM information_schema.tables")[1]}
    assert "prompt_minhash" not in tables and "prompt_lsh_bands" not in tables
    assert backfill_signatures(store, NEAR) == 0
    again = decide_outcomes(_records([_edit(base[7], 7)], start=50), FORMATS, LineageStore(path), NEAR, None)
    assert again.records[0]["outcome"] == "near_duplicate" and again.records[0]["duplicate_of"] == ids[7]


def _db_bytes_for(tmp_path, name: str, near: NearDedupeConfig, texts: list[str]) -> int:
    store = LineageStore(tmp_path / name / "lineage.duckdb")
    for k in range(0, len(texts), 10_000):
        batch = decide_outcomes(_records(texts[k : k + 10_000], start=k), FORMATS, store, near, None)
        store.discover.write_batch("r", batch.records, batch.prompts, batch.minhash)
    return store.path.stat().st_size


def test_the_near_dedupe_index_no_longer_grows_the_lineage_file(tmp_path):
    texts = _texts(6, 20_000, words=(15, 60))
    with_index = _db_bytes_for(tmp_path, "on", NEAR, texts)
    without = _db_bytes_for(tmp_path, "off", NearDedupeConfig(enabled=False), texts)
    # The in-database index added ~3 KB per kept prompt (about 60 MB here); segment files add none.
    assert (with_index - without) / len(texts) < 300
    folder = params_folder(tmp_path / "on", minhash_params_key(NEAR))
    on_disk = sum(p.stat().st_size for p in folder.iterdir())
    assert on_disk / len(texts) < 32 + 4 * NEAR.num_perm + 4 * 16 + 100  # ids, signature, folded keys


def test_band_lookups_match_a_brute_force_scan_across_runs():
    rng = np.random.default_rng(0)
    index = MinhashIndex(Path("/nonexistent"), 8, 4)
    all_keys = []
    for size in (50, 30, 200, 5, 70):  # several runs, some merged
        keys = rng.integers(0, 40, size=(size, 4)).astype(np.uint64)
        start = index.size
        # keys below 2**32 fold to themselves
        run = (keys.T << np.uint64(32)) | np.arange(start, start + size, dtype=np.uint64)
        run.sort(axis=1)
        index.starts = np.concatenate((index.starts, [start]))
        index.size += size
        index._push(list(run))
        all_keys.append(keys)
    assert len(index.runs) < 5  # geometric merging happened
    stored = np.concatenate(all_keys)
    query = rng.integers(0, 40, size=(25, 4)).astype(np.uint64)
    qi, entry = index.candidates(query)
    expect = sorted({(i, e) for i in range(25) for e in range(len(stored)) if (query[i] == stored[e]).any()})
    assert list(zip(qi.tolist(), entry.tolist())) == expect
