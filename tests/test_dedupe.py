"""MinHash/LSH: unbiased Jaccard estimates, planted near-duplicates found, determinism across processes."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np

from tasks.dedupe import band_keys, cluster, lsh_params, ngram_hashes, signatures
from tasks.prompts import canonical_text

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
        "import json,sys; from tasks.dedupe import signatures; "
        "print(json.dumps(signatures(json.loads(sys.argv[1])).tolist()))"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(texts)], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert json.loads(out.stdout) == signatures(texts).tolist()


def test_batch_canonicalisation_matches_canonical_text():
    odd = ["A\u3000b\x1cc\u2029d\x85e  F", "Ünïcode\u2028line\u00a0nbsp ﬁ ligature", "STRASSE straße", "x", "", "  \t "]
    assert (signatures(odd) == signatures([canonical_text(t) for t in odd])).all()
    assert (signatures(odd[:3]) == signatures([t.lower() for t in odd[:3]])).all()


def test_many_chunks_on_threads_give_the_same_signatures_as_one_by_one():
    import tasks.dedupe as d

    base, variants = corpus(n=300)
    texts = base + variants
    old = d._CHUNK_BYTES
    d._CHUNK_BYTES = 2_000  # force many chunks, hashed on a thread pool
    try:
        chunked = signatures(texts)
    finally:
        d._CHUNK_BYTES = old
    assert (chunked == np.concatenate([signatures([t]) for t in texts])).all()
