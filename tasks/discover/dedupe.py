"""Exact and near-duplicate detection (MinHash + LSH), vectorised over a whole batch.

Owns n-gram hashing of canonical text, MinHash signatures, LSH banding and clustering. Promises:
deterministic results across processes and runs (no Python `hash`), so signatures and band keys
stored in the lineage store stay comparable with every later batch.

Why not datasketch: it computes `num_perm` hashes per shingle one document at a time. Here the
batch is canonicalised in one pass, hashed in numpy in chunks on every core, and the signature
uses one-permutation hashing with optimal densification (Shrivastava, ICML 2017): one hash per
shingle, split into `num_perm` bins, empty bins filled from a seeded choice of non-empty ones. It
estimates Jaccard like `num_perm` independent permutations do, at a fraction of the cost
(benchmarks/dedupe.py).
"""

from __future__ import annotations

import os
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import numpy as np

from tasks.discover.prompts import canonical_text

_U64 = np.uint64
_P = _U64(0x100000001B3)  # odd, so invertible mod 2**64
_P_INV = _U64(pow(0x100000001B3, -1, 1 << 64))
_M1 = _U64(0xFF51AFD7ED558CCD)
_M2 = _U64(0xC4CEB9FE1A85EC53)
_MIX = _U64(0x9E3779B97F4A7C15)
_CHUNK_BYTES = 1 << 20  # small chunks: a small powers table, balanced threads


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: full avalanche, vectorised (wraps mod 2**64)."""
    x = x ^ (x >> _U64(33))
    x = x * _M1
    x = x ^ (x >> _U64(33))
    x = x * _M2
    return x ^ (x >> _U64(33))


_POWERS: tuple[np.ndarray, np.ndarray] = (np.ones(1, _U64), np.ones(1, _U64))


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """P**k and P**-k for k < n (mod 2**64): one table, grown by doubling, sliced per chunk."""
    global _POWERS
    if len(_POWERS[0]) < n:
        size = 1 << (n - 1).bit_length()  # next power of two: few regrowths, none per chunk
        p = np.full(size, _P, dtype=_U64)
        p[0] = 1
        q = np.full(size, _P_INV, dtype=_U64)
        q[0] = 1
        with np.errstate(over="ignore"):
            _POWERS = (np.cumprod(p, dtype=_U64), np.cumprod(q, dtype=_U64))
    return _POWERS[0][:n], _POWERS[1][:n]


# Whitespace that NFKC leaves as it is; str.split() (and so canonical_text) separates on it too.
_OTHER_SPACES = ("\x85", "\u1680", "\u2028", "\u2029")
_WS_BYTE = np.zeros(256, dtype=bool)
_WS_BYTE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True


def _canonical_blob(texts: list[str]) -> np.ndarray:
    """All texts canonicalised at once (NFKC, case-folded), NUL between texts, as UTF-8 bytes.

    Equal, token for token, to `canonical_text` of each text, without its per-text split and
    join: the tokenizer splits on whitespace bytes itself. A NUL inside a text is treated as
    whitespace.
    """
    # Per text, so an all-ASCII text (most of them) skips normalisation: one non-ASCII text would
    # otherwise send the whole joined string down NFKC's slow path.
    parts = [t.lower() if t.isascii() else unicodedata.normalize("NFKC", t).casefold() for t in texts]
    blob = "\x00".join(parts)
    if blob.count("\x00") != len(texts) - 1:
        blob = "\x00".join(t.replace("\x00", " ") for t in parts)
    for space in _OTHER_SPACES:
        if space in blob:
            blob = blob.replace(space, " ")
    return np.frombuffer(blob.encode("utf-8"), dtype=np.uint8)


def _word_hashes(blob: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hash of every word of a NUL-separated canonical blob, with the text (0-based) it is in."""
    n = len(blob)
    is_end = blob == 0
    seps = np.flatnonzero(_WS_BYTE[blob] | is_end)
    starts = np.concatenate(([0], seps + 1))
    ends = np.concatenate((seps, [n]))
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    # Polynomial hash of each word from prefix sums: H(a, e) = P^(e-1) * (C[e] - C[a]),
    # C[k] = sum_{j<k} b[j] * P^-j, all mod 2**64, so every word hashes in one vector pass.
    pw, pinv = _powers(max(n, 1))
    with np.errstate(over="ignore"):
        c = np.zeros(n + 1, dtype=_U64)
        np.cumsum(blob.astype(_U64) * pinv, dtype=_U64, out=c[1:])
        h = pw[ends - 1] * (c[ends] - c[starts]) + (ends - starts).astype(_U64) * _MIX
    doc = np.searchsorted(np.flatnonzero(is_end), starts)
    return fmix64(h), doc


def _char_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Hash of every character of canonical texts, with the text each belongs to."""
    parts = [np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32) for t in texts]
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    toks = np.concatenate(parts).astype(_U64) if parts else np.zeros(0, _U64)
    doc = np.repeat(np.arange(len(texts), dtype=np.int64), lengths)
    return fmix64(toks + _MIX), doc


def _combine(h: np.ndarray, doc: np.ndarray, n_docs: int, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Order-sensitive hashes of every run of `ngram` consecutive tokens inside one text.

    A text shorter than `ngram` tokens gets one shingle made of all its tokens.
    """
    m = len(h) - ngram + 1
    parts_h, parts_d = [], []
    with np.errstate(over="ignore"):
        if m > 0:
            acc = np.zeros(m, dtype=_U64)
            for k in range(ngram):
                acc = acc * _P + h[k : k + m]
            valid = doc[ngram - 1 : ngram - 1 + m] == doc[:m]
            parts_h.append(fmix64(acc[valid]))
            parts_d.append(doc[:m][valid])
        counts = np.bincount(doc, minlength=n_docs)
        short = np.flatnonzero((counts > 0) & (counts < ngram))
        if len(short):
            first = np.searchsorted(doc, short)
            acc = np.zeros(len(short), dtype=_U64)
            for k in range(ngram - 1):
                live = k < counts[short]
                acc = np.where(live, acc * _P + h[np.minimum(first + k, len(h) - 1)], acc)
            parts_h.append(fmix64(acc))
            parts_d.append(short)
    if not parts_h:
        return np.zeros(0, _U64), np.zeros(0, np.int64)
    return np.concatenate(parts_h), np.concatenate(parts_d)


def _chunk_jobs(texts: list[str], unit: str) -> list[tuple[int, int, Callable[[], tuple[np.ndarray, np.ndarray]]]]:
    """(first text, text count, token hasher) per chunk of about _CHUNK_BYTES of text."""
    if not texts:
        return []
    if unit == "char":
        canon = [canonical_text(t) for t in texts]
        ends = np.cumsum([len(t) + 1 for t in canon])
        cuts = _cuts(ends)
        return [(a, b - a, partial(_char_hashes, canon[a:b])) for a, b in zip(cuts[:-1], cuts[1:])]
    blob = _canonical_blob(texts)
    text_ends = np.concatenate((np.flatnonzero(blob == 0), [len(blob)]))
    cuts = _cuts(text_ends + 1)
    starts = np.concatenate(([0], text_ends + 1))
    return [(a, b - a, partial(_word_hashes, blob[starts[a] : text_ends[b - 1]])) for a, b in zip(cuts[:-1], cuts[1:])]


def _cuts(ends: np.ndarray) -> list[int]:
    """Text indexes where chunks start, from the cumulative end offset of each text."""
    cuts, start = [0], 0
    while start < len(ends):
        base = ends[start - 1] if start else 0
        start = max(start + 1, int(np.searchsorted(ends, base + _CHUNK_BYTES)))
        cuts.append(min(start, len(ends)))
    return cuts


def _parallel(jobs: list[Callable]) -> list:
    # numpy releases the GIL in the heavy loops (cumsum, arithmetic, ufunc.at), so chunks hashed
    # on separate threads use every core.
    if len(jobs) <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def ngram_hashes(texts: list[str], ngram: int, unit: str = "word") -> tuple[np.ndarray, np.ndarray]:
    """Hashes of all n-grams of every text's canonical form, with the index of the text of each."""
    jobs = _chunk_jobs(texts, unit)

    def run(first: int, count: int, tokens) -> tuple[np.ndarray, np.ndarray]:
        h, d = _combine(*tokens(), count, ngram)
        return h, d + first

    parts = _parallel([partial(run, *job) for job in jobs])
    if not parts:
        return np.zeros(0, _U64), np.zeros(0, np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


# ---------------------------------------------------------------- MinHash by one-permutation hashing

_EMPTY = np.iinfo(np.uint64).max


@lru_cache(maxsize=8)
def _densify_table(num_perm: int, attempts: int = 64) -> np.ndarray:
    """For each bin, a fixed pseudo-random sequence of donor bins (the same for every text)."""
    j = np.arange(num_perm, dtype=_U64)[None, :]
    t = np.arange(1, attempts + 1, dtype=_U64)[:, None]
    with np.errstate(over="ignore"):
        return (fmix64(j * _MIX + t * _M1) % _U64(num_perm)).astype(np.int64)


def clear_caches() -> None:
    """Forget the power and donor tables, as a new process starts: benchmarks/dedupe.py times cold runs."""
    global _POWERS
    _POWERS = (np.ones(1, _U64), np.ones(1, _U64))
    _densify_table.cache_clear()


def _signature_block(h: np.ndarray, doc: np.ndarray, n_docs: int, num_perm: int) -> np.ndarray:
    bits = num_perm.bit_length() - 1
    bins = (h >> _U64(64 - bits)).astype(np.int64)
    vals = h & _U64((1 << (64 - bits)) - 1)
    sig = np.full(n_docs * num_perm, _EMPTY, dtype=_U64)
    np.minimum.at(sig, doc * num_perm + bins, vals)
    original = sig != _EMPTY
    signed = original.reshape(n_docs, num_perm).any(axis=1)
    # Optimal densification, visiting only the empty bins: each takes the value of the first
    # originally non-empty bin along its fixed donor sequence. Bins are flat positions (a text's
    # row start plus its column): one gather per attempt where (row, column) pairs took three,
    # and this loop is most of a signature's cost on short texts, whose bins are mostly empty.
    empty = np.flatnonzero(~original & np.repeat(signed, num_perm))
    col = empty % num_perm
    row_start = empty - col
    for donors in _densify_table(num_perm):
        if not len(empty):
            break
        src = row_start + donors[col]
        ok = original[src]
        sig[empty[ok]] = sig[src[ok]]
        left = ~ok
        empty, col, row_start = empty[left], col[left], row_start[left]
    sig = sig.reshape(n_docs, num_perm)
    if len(empty):  # texts with very few shingles: the first non-empty bin
        rows = empty // num_perm
        first = original.reshape(n_docs, num_perm).argmax(axis=1)
        sig[rows, col] = sig[rows, first[rows]]
    sig[~signed] = 0
    return (sig & _U64(0xFFFFFFFF)).astype(np.uint32)


def signatures(texts: list[str], num_perm: int = 128, ngram: int = 5, unit: str = "word") -> np.ndarray:
    """MinHash signatures, shape (len(texts), num_perm), uint32. A text with no token gets all-zero."""
    if num_perm & (num_perm - 1):
        raise ValueError(f"num_perm must be a power of two, got {num_perm}")

    def block(count: int, tokens) -> np.ndarray:
        return _signature_block(*_combine(*tokens(), count, ngram), count, num_perm)

    blocks = _parallel([partial(block, count, tokens) for _, count, tokens in _chunk_jobs(texts, unit)])
    return np.concatenate(blocks) if blocks else np.zeros((0, num_perm), np.uint32)


def lsh_params(threshold: float, num_perm: int, recall_at_threshold: float = 0.9) -> tuple[int, int]:
    """(bands, rows): the most rows per band whose candidate probability at `threshold` is at
    least `recall_at_threshold`.

    LSH only proposes candidates here; each one is verified on its signature before it counts.
    So the bands are tuned for recall, unlike datasketch's balanced false-positive/negative
    choice (9 bands of 13 rows for 0.8 and 128, which proposes a pair at Jaccard 0.85 only 62%
    of the time). Extra candidates cost a cheap vectorised comparison, not precision.
    """
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= recall_at_threshold:
            return bands, rows
    return num_perm, 1


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One 64-bit key per (text, band); equal keys mean the band's `rows` values are equal."""
    out = np.empty((sig.shape[0], bands), dtype=_U64)
    with np.errstate(over="ignore"):
        for b in range(bands):
            acc = np.full(sig.shape[0], _U64(b + 1), dtype=_U64)
            for c in sig[:, b * rows : (b + 1) * rows].T:
                acc = acc * _P + c.astype(_U64)
            out[:, b] = fmix64(acc)
    return out


def candidate_pairs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (i < j) sharing a band key: each text with its bucket's first and its previous member."""
    n = keys.shape[0]
    found = []
    for b in range(keys.shape[1]):
        order = np.argsort(keys[:, b], kind="stable")
        k = keys[order, b]
        same = np.concatenate(([False], k[1:] == k[:-1]))
        if not same.any():
            continue
        head = np.maximum.accumulate(np.where(same, 0, np.arange(n)))
        j = order[same]
        prev = order[np.flatnonzero(same) - 1]
        first = order[head[same]]
        found.append(prev * n + j)
        found.append(first * n + j)
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    code = np.unique(np.concatenate(found))
    i, j = code // n, code % n
    return np.minimum(i, j), np.maximum(i, j)


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b).mean(axis=1)


@dataclass
class NearDuplicateResult:
    """For each text of the batch: -1 if it starts a cluster (kept), else the node it duplicates.

    Nodes are numbered batch texts first (0..n-1), then the stored prompts given as `prior`
    (n..n+m-1), so `duplicate_of[i] >= n` points at a prompt already in the lineage store.
    """

    duplicate_of: np.ndarray
    similarity: np.ndarray


def cluster(
    sig: np.ndarray,
    keys: np.ndarray,
    threshold: float,
    prior_pairs: tuple[np.ndarray, np.ndarray] | None = None,
    prior_sig: np.ndarray | None = None,
) -> NearDuplicateResult:
    """Union-find over verified candidate pairs; each cluster's root is its earliest member.

    Stored prompts (`prior_sig`, with candidate pairs `prior_pairs` = (batch index, prior index))
    rank before every batch text, so a text near an already kept prompt is its duplicate.
    """
    n = sig.shape[0]
    m = 0 if prior_sig is None else prior_sig.shape[0]
    i, j = candidate_pairs(keys)
    sim = estimated_jaccard(sig[i], sig[j])
    ok = sim >= threshold
    edges_a, edges_b, edges_s = [i[ok]], [j[ok]], [sim[ok]]
    if prior_pairs is not None and m:
        bi, pj = prior_pairs
        psim = estimated_jaccard(sig[bi], prior_sig[pj])
        pok = psim >= threshold
        edges_a.append(pj[pok] + n)
        edges_b.append(bi[pok])
        edges_s.append(psim[pok])
    a = np.concatenate(edges_a).tolist()
    b = np.concatenate(edges_b).tolist()
    s = np.concatenate(edges_s).tolist()

    def rank(x: int) -> int:  # stored prompts first, then batch order
        return x - n if x >= n else x + m

    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    for x, y in zip(a, b):
        rx, ry = find(x), find(y)
        if rx != ry:
            if rank(rx) < rank(ry):
                parent[ry] = rx
            else:
                parent[rx] = ry
    best_sim: dict[int, float] = {}
    for x, y, v in zip(a, b, s):
        for node in (x, y):
            if node < n:
                best_sim[node] = max(best_sim.get(node, 0.0), v)
    dup = np.full(n, -1, dtype=np.int64)
    similarity = np.zeros(n, dtype=np.float32)
    for node in parent:
        if node < n:
            root = find(node)
            if root != node:
                dup[node] = root
                similarity[node] = best_sim.get(node, 0.0)
    return NearDuplicateResult(dup, similarity)
