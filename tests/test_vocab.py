"""Reduced draft vocab: masked counting, deterministic choice, SGLang's d2t semantics, validation, file."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from tasks.extract.vocab import (
    TokenCounter,
    build_draft_vocab,
    count_tokens,
    coverage_report,
    load_vocab,
    save_vocab,
    split_half_coverage,
    thin_vocab_warning,
    validate_vocab,
    vocab_drift_warning,
)


def zipf_samples(seed: int, n_samples: int, length: int, vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.2, size=n_samples * length) - 1) % vocab
    mask = rng.random(n_samples * length) < 0.7
    return [(ids[i * length : (i + 1) * length], mask[i * length : (i + 1) * length]) for i in range(n_samples)]


def test_counts_ignore_unmasked_tokens():
    samples = [([5, 5, 7, 9], [0, 1, 1, 0]), ([9, 9, 2], [True, True, False]), ([], [])]
    counts = count_tokens(samples, 10)
    assert counts.dtype == np.int64 and counts.shape == (10,)
    assert counts.tolist() == [0, 0, 0, 0, 0, 1, 0, 1, 0, 2]


def test_counts_accumulate_over_batches_like_one_pass():
    samples = zipf_samples(0, 50, 200, 1000)
    whole = count_tokens(samples, 1000)
    summed = np.zeros(1000, dtype=np.int64)
    for k in range(0, 50, 7):
        summed += count_tokens(samples[k : k + 7], 1000)
    counter = TokenCounter(1000)
    for k in range(0, 50, 7):
        counter.update(samples[k : k + 7])
    assert np.array_equal(whole, summed)
    assert np.array_equal(whole, counter.counts)
    assert counter.samples_seen == 50 and counter.tokens_seen == int(whole.sum())
    # Brute-force reference.
    ref = np.zeros(1000, dtype=np.int64)
    for ids, mask in samples:
        for t, m in zip(ids, mask):
            ref[t] += bool(m)
    assert np.array_equal(whole, ref)


def test_out_of_range_ids_name_sample_and_id():
    with pytest.raises(ValueError, match=r"sample 1: token id 10 at position 2"):
        count_tokens([([1, 2], [1, 1]), ([3, 4, 10], [1, 1, 0])], 10)
    with pytest.raises(ValueError, match=r"sample 0: token id -1"):
        count_tokens([([-1, 2], [0, 1])], 10)
    # The counter numbers samples across batches.
    counter = TokenCounter(10).update([([1], [1])] * 3)
    with pytest.raises(ValueError, match=r"sample 3: token id 12"):
        counter.update([([12], [1])])
    with pytest.raises(ValueError, match=r"sample 0: 2 input_ids but 1 loss_mask"):
        count_tokens([([1, 2], [1])], 10)


def test_ties_are_deterministic_under_shuffled_input():
    # Ids 3, 4, 6 and 8 tie at count 2; draft size 3 keeps the top id (1) and ties 3 and 4.
    samples = [([1], [1])] * 5 + [([3], [1]), ([4], [1]), ([6], [1]), ([8], [1])] * 2
    ref = build_draft_vocab(count_tokens(samples, 10), 3)
    assert ref.draft_to_target.tolist() == [1, 3, 4]
    rng = random.Random(0)
    for _ in range(20):
        shuffled = samples[:]
        rng.shuffle(shuffled)
        v = build_draft_vocab(count_tokens(shuffled, 10), 3)
        assert np.array_equal(v.d2t, ref.d2t) and np.array_equal(v.t2d, ref.t2d)


def test_hand_example_coverage_offsets_and_fill():
    counts = np.array([0, 10, 0, 5, 5, 1, 0, 0], dtype=np.int64)  # 21 tokens
    v = build_draft_vocab(counts, 3)
    assert v.draft_to_target.tolist() == [1, 3, 4]
    assert v.d2t.tolist() == [1, 2, 2] and v.d2t.dtype == np.int64
    assert v.t2d.tolist() == [False, True, False, True, True, False, False, False]
    assert v.coverage == 20 / 21
    assert (v.n_seen, v.n_filled) == (4, 0)
    # Six slots but four ids seen: the two lowest unseen ids (0, 2) fill up.
    f = build_draft_vocab(counts, 6)
    assert f.draft_to_target.tolist() == [0, 1, 2, 3, 4, 5]
    assert f.n_filled == 2 and f.coverage == 1.0
    r = coverage_report(v)
    assert (r["total_tokens"], r["covered_tokens"], r["distinct_seen_in_vocab"]) == (21, 20, 3)
    assert r["top_missed"] == [[5, 1]] and r["top_k_share"]["1"] == 10 / 21
    # Coverage of other (held-out) counts.
    held = np.array([4, 1, 0, 0, 0, 0, 0, 5], dtype=np.int64)
    assert coverage_report(v, held)["coverage"] == 0.1
    assert coverage_report(v, held)["top_missed"] == [[7, 5], [0, 4]]


def test_a_fixed_vocab_warns_when_built_thin_or_when_later_tokens_fall_outside_it():
    counts = np.array([4, 0, 0, 10, 6, 0, 0, 0], dtype=np.int64)
    full = build_draft_vocab(counts, 3)  # three ids seen, three slots
    assert full.n_filled == 0 and thin_vocab_warning(full) is None
    thin = build_draft_vocab(counts, 5)  # two of five slots hold ids the data never showed
    assert "built from 20 loss-masked tokens" in thin_vocab_warning(thin)
    assert "2 of its 5 ids were never seen" in thin_vocab_warning(thin)
    # Later tokens like the build's: no warning; 1 point below: within tolerance; 25 points below: named.
    assert vocab_drift_warning(full, coverage_report(full, counts * 3)) is None
    assert vocab_drift_warning(full, coverage_report(full, np.array([33, 0, 0, 33, 33, 1, 0, 0]))) is None
    later = coverage_report(full, np.array([3, 0, 0, 3, 3, 0, 0, 3]))
    warning = vocab_drift_warning(full, later)
    assert later["coverage"] == 0.75
    assert "covers 75.0% of the 12 loss-masked tokens extracted now, against 100.0% of the 20" in warning
    assert "(target ids missed most, with counts: 7 (3))" in warning
    assert vocab_drift_warning(full, later, tolerance=0.3) is None
    nothing = coverage_report(full, np.zeros(8, dtype=np.int64))
    assert vocab_drift_warning(full, nothing) is None


def test_the_split_half_estimate_predicts_coverage_of_new_tokens_where_the_build_s_own_coverage_overstates_it():
    # Zipf-distributed ids, frequent ones low as in a BPE vocabulary: a vocab bigger than the ids a small
    # build used covers all of its own data and a good deal less of what comes later.
    rng = np.random.default_rng(0)
    p = 1 / np.arange(1, 4001)
    p /= p.sum()
    build, later = rng.choice(4000, size=6000, p=p), rng.choice(4000, size=60000, p=p)
    halves = np.bincount(build[::2], minlength=4000), np.bincount(build[1::2], minlength=4000)
    vocab = build_draft_vocab(halves[0] + halves[1], 2000)
    assert vocab.n_filled > 0 and vocab.coverage == 1.0
    new = coverage_report(vocab, np.bincount(later, minlength=4000))
    expected = split_half_coverage(*halves, 2000)
    assert new["coverage"] < 0.95 and abs(expected - new["coverage"]) < 0.02
    assert vocab_drift_warning(vocab, new, expected) is None  # later rounds as the data predicts: quiet
    assert "covers" in vocab_drift_warning(vocab, new)  # the in-sample basis would cry wolf
    assert f"expected coverage of new tokens {expected:.1%}" in thin_vocab_warning(vocab, expected)
    shifted = coverage_report(vocab, np.bincount(rng.integers(2000, 4000, size=1000), minlength=4000))
    assert f"against the {expected:.1%} expected of new tokens" in vocab_drift_warning(vocab, shifted, expected)
    assert split_half_coverage(halves[0], np.zeros(4000, dtype=np.int64), 2000) is None


def test_round_trip_matches_sglang_hot_token_id():
    counts = count_tokens(zipf_samples(1, 40, 500, 5000), 5000)
    v = build_draft_vocab(counts, 700)
    n = v.draft_vocab_size
    hot_token_id = v.d2t + np.arange(n)  # what SGLang's Eagle3 loader builds from d2t
    assert np.array_equal(hot_token_id, v.draft_to_target)
    assert np.all(np.diff(v.draft_to_target) > 0)
    assert np.array_equal(np.flatnonzero(v.t2d), v.draft_to_target)
    assert np.array_equal(v.to_target(v.to_draft(v.draft_to_target)), v.draft_to_target)
    assert np.array_equal(v.to_draft(hot_token_id), np.arange(n))
    assert np.all(v.to_draft(np.flatnonzero(~v.t2d)) == -1)
    # The chosen ids really are the most frequent ones.
    assert counts[v.draft_to_target].min() >= counts[~v.t2d].max()
    assert validate_vocab(v.d2t, v.t2d, 5000, 700) == []


@pytest.fixture
def vocab():
    counts = np.zeros(100, dtype=np.int64)
    counts[[3, 4, 5, 10, 11, 40, 41, 42, 90, 91]] = [9, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    return build_draft_vocab(counts, 8)  # target ids 3 4 5 10 11 40 41 42


def test_validate_catches_absolute_ids(vocab):
    absolute = vocab.draft_to_target.copy()  # small ids: d2t + i stays in range, t2d proves it
    problems = validate_vocab(absolute, vocab.t2d, 100, 8)
    assert len(problems) == 1 and "absolute target ids" in problems[0]
    # Without a usable t2d, the range check still names the mix-up.
    big = np.arange(92, 100, dtype=np.int64)
    problems = validate_vocab(big, None, 100, 8)
    assert any("outside the target vocab" in p for p in problems)
    assert any("absolute target ids" in p for p in problems)


def test_validate_catches_off_by_one(vocab):
    for shift in (1, -1):
        problems = validate_vocab(vocab.d2t + shift, vocab.t2d, 100, 8)
        assert any("t2d disagrees with d2t" in p for p in problems), problems
        assert any(f"off by {shift:+d}" in p for p in problems), problems
    # d2t = target_id - (i + 1): the first id lands on 2, unmarked.
    problems = validate_vocab(vocab.draft_to_target - np.arange(1, 9), vocab.t2d, 100, 8)
    assert any("off by -1" in p for p in problems)


def test_validate_catches_t2d_and_shape_faults(vocab):
    bad = vocab.t2d.copy()
    bad[vocab.draft_to_target[2]] = False
    bad[0] = True  # same count, wrong id
    problems = validate_vocab(vocab.d2t, bad, 100, 8)
    assert len(problems) == 1 and "draft id 2 -> target id 5" in problems[0]
    assert any("marks 7 target ids" in p for p in validate_vocab(vocab.d2t, vocab.t2d & (np.arange(100) != 3), 100, 8))
    assert any("shape (99,)" in p for p in validate_vocab(vocab.d2t, vocab.t2d[:99], 100, 8))
    assert any("d2t has shape (7,)" in p for p in validate_vocab(vocab.d2t[:7], vocab.t2d, 100, 8))
    assert any("dtype is int32" in p for p in validate_vocab(vocab.d2t.astype(np.int32), vocab.t2d, 100, 8))
    assert any("t2d dtype is uint8" in p for p in validate_vocab(vocab.d2t, vocab.t2d.astype(np.uint8), 100, 8))
    assert any("d2t is missing" in p for p in validate_vocab(None, vocab.t2d, 100, 8))
    swapped = vocab.draft_to_target.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    problems = validate_vocab(swapped - np.arange(8), vocab.t2d, 100, 8)
    assert len(problems) == 1 and "not strictly increasing" in problems[0]


def test_save_load_round_trip(tmp_path, vocab):
    path = save_vocab(vocab, tmp_path / "vocab" / "draft_vocab.safetensors")
    assert [p.name for p in path.parent.iterdir()] == ["draft_vocab.safetensors"]  # no temp left
    back = load_vocab(path)
    for name in ("draft_to_target", "d2t", "t2d", "counts"):
        a, b = getattr(vocab, name), getattr(back, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert (back.coverage, back.n_seen, back.n_filled) == (vocab.coverage, vocab.n_seen, vocab.n_filled)
    from safetensors.numpy import load_file

    raw = load_file(str(path))
    assert raw["t2d"].dtype == np.bool_ and raw["d2t"].dtype == np.int64


def test_load_refuses_absolute_ids(tmp_path, vocab):
    from safetensors.numpy import save_file

    path = tmp_path / "bad.safetensors"
    meta = {"format": "eagle3-draft-vocab/1", "target_vocab_size": "100", "draft_vocab_size": "8"}
    save_file({"d2t": vocab.draft_to_target, "t2d": vocab.t2d, "counts": vocab.counts}, str(path), metadata=meta)
    with pytest.raises(ValueError, match="absolute target ids"):
        load_vocab(path)


def test_scale_zipf_1m_tokens():
    v_size, n = 49152, 32000
    samples = zipf_samples(2, 1000, 1000, v_size)
    t0 = time.perf_counter()
    counts = count_tokens(samples, v_size)
    t1 = time.perf_counter()
    v = build_draft_vocab(counts, n)
    t2 = time.perf_counter()
    problems = validate_vocab(v.d2t, v.t2d, v_size, n)
    t3 = time.perf_counter()
    report = coverage_report(v)
    print(
        f"\ncount {t1 - t0:.3f}s build {t2 - t1:.3f}s validate {t3 - t2:.3f}s; "
        f"coverage {report['coverage']:.4f} seen {report['distinct_seen']} filled {v.n_filled}"
    )
    assert problems == []
    assert counts.sum() == sum(int(np.count_nonzero(m)) for _, m in samples)
    assert np.array_equal(v.d2t + np.arange(n), v.draft_to_target)
    assert v.n_filled == max(0, n - report["distinct_seen"])
