"""MinHash/LSH: unbiased Jaccard estimates, planted near-duplicates found, determinism across processes;
and discover outcomes whose `duplicate_of` always names a kept prompt."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from storage.lineage import LineageStore
from tasks.config import NearDedupeConfig
from tasks.discover.dedupe import _densify_table, _EMPTY, band_keys, cluster, lsh_params, ngram_hashes, signatures
from tasks.discover.outcomes import decide_and_write, decide_outcomes
from tasks.discover.prompts import canonical_text
from tasks.discover.sources import RawRecord

VOCAB = [f"w{i}" for i in range(20_000)]


def shingles(text: str, n: int = 5) -> set:
    w = canonical_text(text).split()
    return {tuple(w)} if len(w) < n else {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def jaccard(a: str, b: str) -> float:
    x, y = shingles(a), shingles(b)
    return len(x & y) / len(x | y)


def corpus(seed: int = 0, n: int = 400):
    rng = random.Random(seed)
    base = [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(40, 200))) for _ in range(n)]
    variants = []
    for t in base[: n // 2]:
        w = t.split()
        w[rng.randrange(len(w))] = rng.choice(VOCAB)  # one substitution
        variants.append("  ".join(w).upper())  # plus whitespace and case changes
    return base, variants


def test_signature_agreement_estimates_jaccard_without_bias():
    base, variants = corpus()
    sig = signatures(base + variants)
    n = len(base)
    est = np.array([(sig[i] == sig[n + i]).mean() for i in range(len(variants))])
    true = np.array([jaccard(base[i], variants[i]) for i in range(len(variants))])
    err = est - true
    assert abs(err.mean()) < 0.01
    assert err.std() < 0.06  # about sqrt(J(1-J)/128)


def test_word_hashes_match_a_direct_computation():
    h, d = ngram_hashes(["a b c", "x y"], ngram=1)
    h2, _ = ngram_hashes(["x y", "a b c"], ngram=1)
    assert list(d) == [0, 0, 0, 1, 1]
    assert set(h[:3]) == set(h2[2:]) and len(set(h)) == 5  # position-independent, distinct words differ


def test_short_texts_hash_as_one_shingle():
    h, d = ngram_hashes(["one two", "three"], ngram=5)
    assert list(d) == [0, 1]


def test_planted_pairs_are_clustered_and_unrelated_texts_are_not():
    base, variants = corpus()
    texts = base + variants
    sig = signatures(texts)
    bands, rows = lsh_params(0.8, 128)
    res = cluster(sig, band_keys(sig, bands, rows), 0.8)
    n = len(base)
    found = [res.duplicate_of[n + i] == i for i in range(len(variants)) if jaccard(base[i], variants[i]) >= 0.85]
    assert np.mean(found) >= 0.95
    assert (res.duplicate_of[:n] == -1).all()  # originals are never duplicates of each other


def test_prior_prompts_win_the_cluster():
    base, variants = corpus(n=40)
    sig_old = signatures(base[:20])
    sig_new = signatures(variants[:20])
    bands, rows = lsh_params(0.8, 128)
    keys = band_keys(sig_new, bands, rows)
    pairs = (np.arange(20), np.arange(20))  # candidate pairs as a store lookup would return them
    res = cluster(sig_new, keys, 0.8, pairs, sig_old)
    matched = res.duplicate_of >= 20
    assert matched.mean() > 0.8
    assert all(res.duplicate_of[i] == 20 + i for i in np.flatnonzero(matched))


def test_lsh_params_favour_recall_at_the_threshold():
    b, r = lsh_params(0.8, 128)
    assert b * r <= 128 and 1 - (1 - 0.8**r) ** b >= 0.9
    assert 1 - (1 - 0.8 ** (r + 1)) ** (128 // (r + 1)) < 0.9  # and no more bands than needed
    assert 1 - (1 - 0.3**r) ** b < 0.01  # unrelated texts are rarely even proposed


def test_signatures_are_identical_in_another_process():
    texts = ["The quick brown fox jumps over the lazy dog again and again", "héllo wörld ünïcode text here now"]
    code = (
        "import json,sys; from tasks.discover.dedupe import signatures; "
        "print(json.dumps(signatures(json.loads(sys.argv[1])).tolist()))"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(texts)], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert json.loads(out.stdout) == signatures(texts).tolist()


def test_empty_bins_take_the_value_of_their_first_non_empty_donor():
    # Short texts leave most of the 128 bins empty, so densification decides most of their values:
    # checked here against the definition, one bin at a time.
    texts = [" ".join(VOCAB[(7 * i + 3 * j) % len(VOCAB)] for j in range(n)) for i, n in
             enumerate([1, 2, 5, 6, 9, 14, 30, 60, 130] * 3)]
    num_perm = 128
    hashes, doc = ngram_hashes(texts, ngram=5)
    bins, vals = (hashes >> np.uint64(57)).astype(int), hashes & np.uint64((1 << 57) - 1)
    donors = _densify_table(num_perm)
    got = signatures(texts, num_perm)
    for t in range(len(texts)):
        raw = [int(_EMPTY)] * num_perm
        for b, v in zip(bins[doc == t], vals[doc == t]):
            raw[b] = min(raw[b], int(v))
        filled = [c for c in range(num_perm) if raw[c] != int(_EMPTY)]
        want = []
        for c in range(num_perm):
            if raw[c] != int(_EMPTY):
                want.append(raw[c])
                continue
            donor = next((int(d[c]) for d in donors if raw[int(d[c])] != int(_EMPTY)), filled[0])
            want.append(raw[donor])
        assert got[t].tolist() == [w & 0xFFFFFFFF for w in want], f"text {t} ({len(texts[t].split())} words)"


def test_batch_canonicalisation_matches_canonical_text():
    odd = ["A\u3000b\x1cc\u2029d\x85e  F", "Ünïcode\u2028line\u00a0nbsp ﬁ ligature", "STRASSE straße", "x", "", "  \t "]
    assert (signatures(odd) == signatures([canonical_text(t) for t in odd])).all()
    assert (signatures(odd[:3]) == signatures([t.lower() for t in odd[:3]])).all()


def test_many_chunks_on_threads_give_the_same_signatures_as_one_by_one():
    import tasks.discover.dedupe as d

    base, variants = corpus(n=300)
    texts = base + variants
    old = d._CHUNK_BYTES
    d._CHUNK_BYTES = 2_000  # force many chunks, hashed on a thread pool
    try:
        chunked = signatures(texts)
    finally:
        d._CHUNK_BYTES = old
    assert (chunked == np.concatenate([signatures([t]) for t in texts])).all()


# ------------------------------------------------------------ discover outcomes: duplicate_of names a kept prompt

FORMATS = {"s": ("prompt_response", "prompt", "response")}


def _records(texts: list[str], start: int = 0) -> list[RawRecord]:
    return [RawRecord("s", f"L{start + k}", {"prompt": t}) for k, t in enumerate(texts)]


def _reported_case() -> dict[str, str]:
    """The case from the report: a base prompt, its upper-cased copy and a one-word edit.

    The upper-cased copy has the base's prompt id (canonical text is case-folded): an exact
    duplicate of the base. The edit is a near duplicate of the base (Jaccard about 0.93).
    """
    rng = random.Random(11)
    base = " ".join(rng.choice(VOCAB) for _ in range(150))
    w = base.split()
    w[75] = "changed"
    return {"base": base, "upper": base.upper(), "edit": " ".join(w)}


def _assert_duplicates_name_kept_prompts(rows: list[dict], kept_ids: set[str]) -> None:
    bad = [r for r in rows if r["duplicate_of"] is not None and r["duplicate_of"] not in kept_ids]
    assert not bad, f"{len(bad)} duplicates name a prompt that is not kept, e.g. {bad[0]}"


@pytest.mark.parametrize("order", list(itertools.permutations(["edit", "base", "upper"])), ids="-".join)
def test_exact_twin_of_a_near_duplicate_names_the_kept_prompt(tmp_path, order):
    case = _reported_case()
    batch = decide_outcomes(_records([case[k] for k in order]), FORMATS, LineageStore(tmp_path / "l.duckdb"),
                            NearDedupeConfig(), None)
    rows = {k: r for k, r in zip(order, batch.records)}
    kept = [r for r in batch.records if r["outcome"] == "kept"]
    assert len(kept) == 1 and [p["prompt_id"] for p in batch.prompts] == [kept[0]["prompt_id"]]
    _assert_duplicates_name_kept_prompts(batch.records, {kept[0]["prompt_id"]})
    # The outcome does not depend on the order: one copy of the base text is an exact duplicate.
    assert batch.counts() == {"kept": 1, "near_duplicate": 1, "exact_duplicate": 1}
    assert rows["base"]["prompt_id"] == rows["upper"]["prompt_id"] != rows["edit"]["prompt_id"]
    if order[0] == "edit":  # the reported order: base and upper-cased copy both lead to the edit
        assert rows["edit"]["outcome"] == "kept"
        twin = rows[order[2]]
        assert twin["outcome"] == "exact_duplicate" and twin["duplicate_of"] == rows["edit"]["prompt_id"]
        assert twin["similarity"] == rows[order[1]]["similarity"] >= 0.8


def test_exact_twin_of_an_earlier_batchs_near_duplicate_names_the_stored_kept_prompt(tmp_path):
    case = _reported_case()
    store = LineageStore(tmp_path / "l.duckdb")
    first = decide_outcomes(_records([case["edit"], case["base"]]), FORMATS, store, NearDedupeConfig(), None)
    store.discover.write_batch("run1", first.records, first.prompts, first.minhash)
    edit_id = first.records[0]["prompt_id"]
    assert [r["outcome"] for r in first.records] == ["kept", "near_duplicate"]
    second = decide_outcomes(_records([case["upper"]], start=2), FORMATS, store, NearDedupeConfig(), None)
    (row,) = second.records
    assert row["outcome"] == "exact_duplicate" and row["duplicate_of"] == edit_id and not second.prompts
    assert row["prompt_id"] == first.records[1]["prompt_id"]


def test_a_stored_chain_left_by_older_runs_is_followed_to_the_kept_prompt(tmp_path):
    case = _reported_case()
    store = LineageStore(tmp_path / "l.duckdb")
    batch = decide_outcomes(_records([case["edit"], case["base"]]), FORMATS, store, NearDedupeConfig(), None)
    edit_id, base_id = batch.records[0]["prompt_id"], batch.records[1]["prompt_id"]
    # A row as the old code wrote it: the upper-cased copy naming the (near duplicate) base.
    legacy = {**batch.records[1], "record_key": "L2", "outcome": "exact_duplicate", "duplicate_of": base_id,
              "similarity": None}
    store.discover.write_batch("old", batch.records + [legacy], batch.prompts, batch.minhash)
    again = decide_outcomes(_records([case["base"] + "  "], start=3), FORMATS, store, NearDedupeConfig(), None)
    assert again.records[0]["outcome"] == "exact_duplicate" and again.records[0]["duplicate_of"] == edit_id


def _planted_records(seed: int = 3, n: int = 200) -> list[str]:
    """Bases, one-word edits of half of them, and case/whitespace copies of both, shuffled."""
    rng = random.Random(seed)
    base = [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(40, 200))) for _ in range(n)]
    texts = list(base)
    for t in base[: n // 2]:
        w = t.split()
        w[rng.randrange(len(w))] = rng.choice(VOCAB)
        edit = " ".join(w)
        texts += [edit, "  ".join(edit.split()).upper()]
    texts += [t.upper() for t in base[n // 4 : 3 * n // 4]] + [t.title() for t in base[: n // 8]]
    rng.shuffle(texts)
    return texts


@pytest.mark.parametrize("batch_size", [10_000, 37])
def test_every_duplicate_in_a_planted_fixture_names_a_kept_prompt(tmp_path, batch_size):
    texts = _planted_records()
    records = _records(texts)
    store = LineageStore(tmp_path / "l.duckdb")
    rows: list[dict] = []
    for k in range(0, len(records), batch_size):
        batch = decide_outcomes(records[k : k + batch_size], FORMATS, store, NearDedupeConfig(), None)
        assert sorted(p["prompt_id"] for p in batch.prompts) == sorted(
            r["prompt_id"] for r in batch.records if r["outcome"] == "kept")
        store.discover.write_batch(f"run{k}", batch.records, batch.prompts, batch.minhash)
        rows += batch.records
    kept_ids = {r["prompt_id"] for r in rows if r["outcome"] == "kept"}
    _assert_duplicates_name_kept_prompts(rows, kept_ids)
    # Counts reconcile and the fixture really holds the reported case (twins of near duplicates).
    assert len(rows) == len(records) and {r["outcome"] for r in rows} <= {"kept", "exact_duplicate", "near_duplicate"}
    assert len(kept_ids) == sum(r["outcome"] == "kept" for r in rows)
    exact = [r for r in rows if r["outcome"] == "exact_duplicate"]
    assert len(exact) == len(texts) - len({canonical_text(t) for t in texts})  # independent of order and batches
    assert sum(r["duplicate_of"] != r["prompt_id"] for r in exact) >= 10
    # And so says the stored `record_outcomes` view.
    _, bad = store.reports.query_readonly(
        "SELECT count(*) FROM record_outcomes d WHERE d.duplicate_of IS NOT NULL AND d.duplicate_of NOT IN "
        "(SELECT prompt_id FROM record_outcomes WHERE outcome = 'kept')")
    assert bad == [(0,)]


def test_deciding_a_batch_runs_without_cyclic_gc_and_gives_it_back(tmp_path, monkeypatch):
    """Each collection walks every object the process holds: at 1M+ records a third of deciding."""
    import gc

    import tasks.discover.outcomes as outcomes

    seen = []
    real = outcomes.normalise_record

    def watching(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(outcomes, "normalise_record", watching)
    assert gc.isenabled()
    decide_outcomes(_records(["one text", "another text"]), FORMATS, LineageStore(tmp_path / "l.duckdb"),
                    NearDedupeConfig(), None)
    assert seen == [False, False] and gc.isenabled()


def _outcome_rows(store: LineageStore) -> list[tuple]:
    return store.reports.query_readonly("SELECT source, record_key, outcome, prompt_id, duplicate_of, similarity "
                                "FROM records ORDER BY source, record_key")[1]


def test_overlapped_decide_and_write_gives_the_outcomes_of_one_batch_after_the_other(tmp_path):
    """The next batch is prepared while the last one is written, and still resolved against it."""
    records = _records(_planted_records())
    chunks = [records[k : k + 37] for k in range(0, len(records), 37)]
    one_by_one = LineageStore(tmp_path / "a.duckdb")
    for chunk in chunks:
        batch = decide_outcomes(chunk, FORMATS, one_by_one, NearDedupeConfig(), None)
        one_by_one.discover.write_batch("run", batch.records, batch.prompts, batch.minhash)
    overlapped = LineageStore(tmp_path / "b.duckdb")
    written = []
    decide_and_write(chunks, "run", FORMATS, overlapped, NearDedupeConfig(), None,
                     on_written=lambda b: written.append(len(b.records)))
    assert written == [len(c) for c in chunks]
    expected = _outcome_rows(one_by_one)
    assert len(expected) == len(records) and {r[2] for r in expected} >= {"exact_duplicate", "near_duplicate"}
    assert _outcome_rows(overlapped) == expected


class _SlowWriteStore(LineageStore):
    """Logs each write's start and end and each store read that resolving a batch starts with: its
    discover batch writes and exact-index lookups go through the logging ones below."""

    def __init__(self, path, log, fail_on=None, after_write=None):
        super().__init__(path)
        self.log, self.fail_on, self.after_write, self.writes = log, fail_on, after_write, 0
        self._write_batch, self._matches = self.discover.write_batch, self.exact_index.matches
        self.discover.write_batch, self.exact_index.matches = self._slow_write_batch, self._logged_matches

    def _slow_write_batch(self, run_id, records, prompts, minhash):
        n = self.writes = self.writes + 1
        self.log.append(("write start", n))
        time.sleep(0.3)
        if n == self.fail_on:
            raise OSError("disk full")
        self._write_batch(run_id, records, prompts, minhash)
        if self.after_write is not None:
            self.after_write(n)
        self.log.append(("write end", n))

    def _logged_matches(self, prompt_ids):
        self.log.append(("resolve", self.writes + 1))
        return self._matches(prompt_ids)


def test_a_batch_is_resolved_only_after_the_previous_write_committed_and_prepared_during_it(tmp_path, monkeypatch):
    import tasks.discover.outcomes as outcomes

    log: list[tuple[str, int]] = []
    real = outcomes.prepare_batch
    prepared = iter(range(1, 4))
    monkeypatch.setattr(outcomes, "prepare_batch",
                        lambda *a, **k: (log.append(("prepare", next(prepared))), real(*a, **k))[1])
    chunks = [_records([f"text number {k} " * 8], start=k) for k in range(3)]
    decide_and_write(chunks, "run", FORMATS, _SlowWriteStore(tmp_path / "l.duckdb", log), NearDedupeConfig(), None)
    at = {event: k for k, event in enumerate(log)}
    assert len(at) == len(log) == 12
    for n in (1, 2, 3):
        assert at[("prepare", n)] < at[("resolve", n)] < at[("write start", n)] < at[("write end", n)]
    for n in (1, 2):
        # the next batch is prepared while this one is written, and resolved only once it is in
        assert at[("write start", n)] < at[("write end", n)] and at[("prepare", n + 1)] < at[("write end", n)]
        assert at[("write end", n)] < at[("resolve", n + 1)]
        assert at[("resolve", n)] < at[("prepare", n + 1)]


def test_a_failed_write_stops_before_the_next_batch_is_resolved(tmp_path):
    log: list[tuple[str, int]] = []
    store = _SlowWriteStore(tmp_path / "l.duckdb", log, fail_on=2)
    chunks = [_records([f"text number {k} " * 8], start=k) for k in range(4)]
    with pytest.raises(OSError, match="disk full"):
        decide_and_write(chunks, "run", FORMATS, store, NearDedupeConfig(), None)
    assert ("resolve", 3) not in log and ("write start", 3) not in log
    assert [r[1] for r in _outcome_rows(store)] == ["L0"]  # batch 1 committed, nothing of batch 2


def test_a_batch_finds_what_another_writer_stored_while_the_one_before_was_written(tmp_path):
    """Another process stores the base text's one-word edit (near) and a prompt (exact) right after
    our first batch commits: our second batch must find both, though this process's exact index
    was told only of its own batch."""
    case = _reported_case()
    other_texts = [case["edit"], "another process's own prompt " * 6]
    path = tmp_path / "l.duckdb"

    def other_process_writes(n: int) -> None:
        if n == 1:
            other = LineageStore(path)
            batch = decide_outcomes(_records(other_texts, start=100), FORMATS, other, NearDedupeConfig(), None)
            other.discover.write_batch("other", batch.records, batch.prompts, batch.minhash)

    store = _SlowWriteStore(path, [], after_write=other_process_writes)
    chunks = [_records(["our first prompt " * 6]), _records([case["base"], other_texts[1].upper()], start=1)]
    decide_and_write(chunks, "run", FORMATS, store, NearDedupeConfig(), None)
    rows = {r[1]: r for r in _outcome_rows(store)}
    assert rows["L1"][2] == "near_duplicate" and rows["L1"][4] == rows["L100"][3]
    assert rows["L2"][2] == "exact_duplicate" and rows["L2"][4] == rows["L101"][3]
    assert [r[2] for r in rows.values()].count("kept") == 3  # ours, and the other process's two
