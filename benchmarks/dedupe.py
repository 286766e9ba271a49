"""Near-duplicate detection: our vectorised MinHash + LSH (tasks/discover/dedupe.py) against datasketch.

Both sides get the same texts and the same parameters: word 5-gram shingles of `canonical_text`
(a text with fewer than 5 words is one shingle of all its words), 128 permutations, Jaccard
threshold 0.8, keep the first text of each group of near duplicates.

- ours: `signatures` -> `lsh_params` / `band_keys` -> `cluster` (which verifies every candidate pair
  by estimated Jaccard >= threshold and unions them, each cluster's root being its earliest text).
- datasketch: the plain loop a user would write, query-then-insert, keep first: for each text in
  order, build its shingle set, `MinHash(num_perm=128).update_batch(...)`, `lsh.query(m)`, verify
  each candidate with `m.jaccard(other) >= 0.8`; a verified text is a duplicate of its earliest
  verified candidate, otherwise it is inserted into `MinHashLSH(threshold=0.8, num_perm=128)`.

Datasets: the recovered ShareGPT prompts, and a seeded synthetic set with planted near duplicates
(one edit kind per planted pair) whose exact Jaccard is computed, so recall and precision can be
measured. Times include canonicalisation and shingling on both sides.

    .venv/bin/python -m benchmarks.dedupe                 # 200,000 synthetic texts
    .venv/bin/python -m benchmarks.dedupe --quick         # 5,000, a smoke run
    .venv/bin/python -m benchmarks.dedupe --baseline-limit 50000   # datasketch on a prefix only
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.report import table
from tasks.discover import dedupe
from tasks.discover.prompts import canonical_text

NUM_PERM = 128
NGRAM = 5
THRESHOLD = 0.8
TARGET_RATIO, TARGET_RECALL, TARGET_PRECISION = 10.0, 0.95, 0.99
EDIT_KINDS = ("substitute", "insert", "delete", "reorder", "whitespace", "case", "combo")


# ---------------------------------------------------------------- shingles and exact Jaccard

def shingle_set(text: str) -> set[str]:
    """Word 5-grams of the canonical text, each joined by single spaces (what both sides hash)."""
    c = canonical_text(text)
    if not c:
        return set()
    w = c.split(" ")
    if len(w) < NGRAM:
        return {c}
    return {" ".join(w[k : k + NGRAM]) for k in range(len(w) - NGRAM + 1)}


def exact_jaccard(a: set[str], b: set[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


class ShingleCache:
    def __init__(self, texts: list[str]):
        self.texts = texts
        self.sets: dict[int, set[str]] = {}

    def __call__(self, i: int) -> set[str]:
        s = self.sets.get(i)
        if s is None:
            s = self.sets[i] = shingle_set(self.texts[i])
        return s

    def jaccard(self, i: int, j: int) -> float:
        return exact_jaccard(self(i), self(j))


# ---------------------------------------------------------------- the two pipelines

def run_ours(texts: list[str]) -> np.ndarray:
    sig = dedupe.signatures(texts, num_perm=NUM_PERM, ngram=NGRAM, unit="word")
    bands, rows = dedupe.lsh_params(THRESHOLD, NUM_PERM)
    keys = dedupe.band_keys(sig, bands, rows)
    return dedupe.cluster(sig, keys, THRESHOLD).duplicate_of


def run_datasketch(texts: list[str]) -> np.ndarray:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    kept: dict[int, MinHash] = {}
    dup = np.full(len(texts), -1, dtype=np.int64)
    for i, text in enumerate(texts):
        m = MinHash(num_perm=NUM_PERM)
        m.update_batch([s.encode("utf-8") for s in shingle_set(text)])
        verified = [c for c in lsh.query(m) if m.jaccard(kept[c]) >= THRESHOLD]
        if verified:
            dup[i] = min(verified)
        else:
            lsh.insert(i, m)
            kept[i] = m
    return dup


def clear_caches() -> None:
    """Every timed run of ours starts cold, as the first batch of a new process would."""
    dedupe.clear_caches()


@dataclass
class Timing:
    runs: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return statistics.median(self.runs)


def timed(fn, texts: list[str], repeats: int, cold=None) -> tuple[np.ndarray, Timing]:
    t = Timing()
    out = None
    for _ in range(repeats):
        if cold:
            cold()
        gc.collect()
        start = time.perf_counter()
        out = fn(texts)
        t.runs.append(time.perf_counter() - start)
    return out, t


def roots(dup: np.ndarray) -> np.ndarray:
    """Cluster root of every text; both pipelines point a duplicate straight at a kept text."""
    r = np.where(dup < 0, np.arange(len(dup)), dup)
    bad = np.flatnonzero(dup[r[dup >= 0]] >= 0) if (dup >= 0).any() else []
    if len(bad):
        raise AssertionError(f"{len(bad)} duplicates point at a text that is itself a duplicate")
    return r


# ---------------------------------------------------------------- synthetic data

@dataclass
class Synthetic:
    texts: list[str]
    family: np.ndarray  # per text: its family id (the base it came from)
    pairs: np.ndarray  # (k, 2) positions (original, variant) of each planted pair
    kinds: list[str]  # per pair: the edit kind
    jaccard: np.ndarray  # per pair: exact Jaccard of the two shingle sets


def vocabulary(rng: np.random.Generator, size: int) -> list[str]:
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    words: dict[str, None] = {}
    while len(words) < size:
        lengths = rng.integers(2, 11, size=size)
        codes = letters[rng.integers(0, 26, size=(size, 10))]
        for row, n in zip(codes, lengths):
            words[row[:n].tobytes().decode()] = None
            if len(words) == size:
                break
    return list(words)


def make_synthetic(n_total: int, seed: int, planted_share: float = 0.2, vocab_size: int = 50_000) -> Synthetic:
    """Base texts of 30-300 Zipf-drawn words in sentences; a planted variant for `planted_share` of them."""
    rng = np.random.default_rng(seed)
    vocab = vocabulary(rng, vocab_size)
    weights = 1.0 / (np.arange(vocab_size) + 10.0)  # Zipf-ish, s = 1, flattened head
    weights /= weights.sum()
    # token forms: plain, sentence start (capitalised), sentence end (with a full stop), both
    forms = np.array(vocab + [w.capitalize() for w in vocab] + [w + "." for w in vocab]
                     + [w.capitalize() + "." for w in vocab], dtype=object)

    n_base = int(round(n_total / (1 + planted_share)))
    n_var = n_total - n_base
    lengths = rng.integers(30, 301, size=n_base)
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    ids = rng.choice(vocab_size, size=int(bounds[-1]), p=weights)
    end = rng.random(len(ids)) < 1 / 12  # sentences of ~12 words
    end[bounds[1:] - 1] = True
    start = np.concatenate(([True], end[:-1]))
    start[bounds[:-1]] = True
    tokens = forms[ids + vocab_size * (start + 2 * end)]
    base = [" ".join(tokens[bounds[k] : bounds[k + 1]].tolist()) for k in range(n_base)]
    del ids, end, start, tokens

    def draw() -> str:
        return vocab[int(rng.choice(vocab_size, p=weights))]

    def word_edits(words: list[str], kind: str) -> list[str]:
        w = list(words)
        for _ in range(max(1, len(w) // 100)):
            k = int(rng.integers(0, len(w)))
            if kind == "substitute":
                w[k] = draw() + ("." if w[k].endswith(".") else "")
            elif kind == "insert":
                w.insert(k, draw())
            elif kind == "delete" and len(w) > 1:
                del w[k]
        return w

    def reorder(words: list[str]) -> list[str]:
        sents, cur = [], []
        for tok in words:
            cur.append(tok)
            if tok.endswith("."):
                sents.append(cur)
                cur = []
        if cur:
            sents.append(cur)
        if len(sents) < 2:  # one sentence: swap its two halves (clauses)
            half = len(words) // 2
            return words[half:] + words[:half]
        k = int(rng.integers(0, len(sents) - 1))
        sents[k], sents[k + 1] = sents[k + 1], sents[k]
        return [t for s in sents for t in s]

    def whitespace(words: list[str]) -> str:
        seps = rng.choice(np.array([" ", "  ", "\n", "\t", " \n ", "\n\n"], dtype=object), size=len(words) - 1,
                          p=[0.8, 0.06, 0.05, 0.03, 0.03, 0.03])
        out = [words[0]]
        for sep, tok in zip(seps, words[1:]):
            out.append(sep)
            out.append(tok)
        return "  " + "".join(out) + "\n"

    def case(text: str) -> str:
        how = int(rng.integers(0, 3))
        if how == 0:
            return text.upper()
        if how == 1:
            return text.lower()
        return " ".join(t.upper() if rng.random() < 0.3 else t for t in text.split(" "))

    planted = rng.choice(n_base, size=n_var, replace=False)
    kinds = [EDIT_KINDS[int(k)] for k in rng.integers(0, len(EDIT_KINDS), size=n_var)]
    variants = []
    for b, kind in zip(planted.tolist(), kinds):
        words = base[b].split(" ")
        if kind in ("substitute", "insert", "delete"):
            v = " ".join(word_edits(words, kind))
        elif kind == "reorder":
            v = " ".join(reorder(words))
        elif kind == "whitespace":
            v = whitespace(words)
        elif kind == "case":
            v = case(base[b])
        else:  # combo: a substitution, then case and whitespace changes
            v = case(whitespace(word_edits(words, "substitute")))
        variants.append(v)

    texts_in = base + variants
    family_in = np.concatenate((np.arange(n_base), planted))
    order = rng.permutation(n_total)
    pos = np.empty(n_total, dtype=np.int64)
    pos[order] = np.arange(n_total)
    # no variant right next to its original
    for _ in range(100):
        gap = np.abs(pos[planted] - pos[n_base + np.arange(n_var)])
        close = np.flatnonzero(gap <= 1)
        if not len(close):
            break
        for c in close.tolist():
            v = n_base + c
            other = int(order[rng.integers(0, n_total)])
            pos[v], pos[other] = pos[other], pos[v]
        order[pos] = np.arange(n_total)
    texts = [texts_in[i] for i in order.tolist()]
    family = family_in[order]
    pairs = np.stack((pos[planted], pos[n_base + np.arange(n_var)]), axis=1)
    jac = np.array([exact_jaccard(shingle_set(base[b]), shingle_set(v)) for b, v in zip(planted.tolist(), variants)])
    return Synthetic(texts, family, pairs, kinds, jac)


# ---------------------------------------------------------------- evaluation

@dataclass
class Quality:
    pairs: int
    recall: float
    recall_85: float
    pairs_85: int
    edges: int
    true_edges: int
    precision: float
    false_edges: list[tuple[int, int, float]]
    found: np.ndarray  # per planted pair: same root


def evaluate(dup: np.ndarray, syn: Synthetic, pair_mask: np.ndarray, shingles: ShingleCache) -> Quality:
    r = roots(dup)
    pairs = syn.pairs[pair_mask]
    found = r[pairs[:, 0]] == r[pairs[:, 1]]
    j = syn.jaccard[pair_mask]
    hi = j >= 0.85
    src = np.flatnonzero(dup >= 0)
    dst = dup[src]
    true, false = 0, []
    for a, b in zip(src.tolist(), dst.tolist()):
        if syn.family[a] == syn.family[b]:
            true += 1
            continue
        jj = shingles.jaccard(a, b)
        if jj >= THRESHOLD:
            true += 1
        else:
            false.append((a, b, jj))
    return Quality(
        pairs=len(pairs), recall=float(found.mean()) if len(pairs) else float("nan"),
        recall_85=float(found[hi].mean()) if hi.any() else float("nan"), pairs_85=int(hi.sum()),
        edges=len(src), true_edges=true, precision=true / len(src) if len(src) else float("nan"),
        false_edges=false, found=found,
    )


# ---------------------------------------------------------------- output

def fmt_rate(n: int, s: float) -> str:
    return f"{n / s:,.0f}"


def speed_rows(n: int, t_ours: Timing, t_ds: Timing) -> list[list[str]]:
    def runs(t):
        return f"{len(t.runs)} ({', '.join(f'{x:.2f}' for x in t.runs)})"
    return [
        ["ours (tasks/discover/dedupe.py)", f"{n:,}", f"{t_ours.seconds:.2f}", fmt_rate(n, t_ours.seconds), runs(t_ours)],
        ["datasketch MinHashLSH", f"{n:,}", f"{t_ds.seconds:.2f}", fmt_rate(n, t_ds.seconds), runs(t_ds)],
    ]


SPEED_HEADER = ["pipeline", "texts", "seconds (median)", "texts/s", "runs (s each)"]


def load_sharegpt() -> list[str]:
    from tasks.config import SourceConfig
    from tasks.discover.prompts import Prompt, normalise_record
    from tasks.discover.sources import read_source

    recs, _ = read_source(SourceConfig(name="sharegpt", kind="sharegpt_package"))
    return [p.text for p in (normalise_record(r.data) for r in recs) if isinstance(p, Prompt)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", type=int, default=200_000, help="synthetic texts (default 200000)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 5000 synthetic texts")
    ap.add_argument("--baseline-limit", type=int, default=0,
                    help="run datasketch on the first N synthetic texts only (0: all); ours runs on both")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of ours per dataset (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-sharegpt", action="store_true")
    args = ap.parse_args()
    n_syn = 5000 if args.quick else args.synthetic
    import datasketch

    print(f"dedupe benchmark  {datetime.date.today()}  {platform.python_implementation()} {platform.python_version()}  "
          f"numpy {np.__version__}  datasketch {getattr(datasketch, '__version__', '?')}  cores {os.cpu_count()}  "
          f"load average {os.getloadavg()[0]:.2f}")
    src = Path(dedupe.__file__)
    print(f"code under test: {src.name} sha256 {hashlib.sha256(src.read_bytes()).hexdigest()[:12]}, "
          f"modified {datetime.datetime.fromtimestamp(src.stat().st_mtime):%Y-%m-%d %H:%M:%S}")
    bands, rows = dedupe.lsh_params(THRESHOLD, NUM_PERM)
    ds_lsh = datasketch.MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    print(f"parameters: word {NGRAM}-grams of canonical_text, {NUM_PERM} permutations, threshold {THRESHOLD}; "
          f"LSH bands x rows: ours {bands}x{rows}, datasketch {ds_lsh.b}x{ds_lsh.r}; keep first")
    print(f"timing: ours {args.repeats} run(s) per dataset, each cold (lru caches cleared), median reported; "
          f"datasketch 1 run")
    ratios: dict[str, float] = {}
    sharegpt_exact: dict[str, float] = {}

    # ------------------------------------------------ ShareGPT
    if not args.skip_sharegpt:
        texts = load_sharegpt()
        d_ours, t_ours = timed(run_ours, texts, args.repeats, clear_caches)
        d_ds, t_ds = timed(run_datasketch, texts, 1)
        ratios["sharegpt"] = t_ds.seconds / t_ours.seconds
        table(f"ShareGPT prompts ({len(texts):,} texts, {sum(map(len, texts)) / len(texts):,.0f} chars on average)",
              SPEED_HEADER, speed_rows(len(texts), t_ours, t_ds))
        print(f"throughput ratio ours/datasketch: {ratios['sharegpt']:.2f}x")
        sh = ShingleCache(texts)
        canon = [canonical_text(t) for t in texts]
        first_seen: dict[str, int] = {}
        exact = sum(1 for c in canon if first_seen.setdefault(c, len(first_seen)) != len(first_seen) - 1)
        fo, fd = d_ours >= 0, d_ds >= 0

        def verified(d):
            src = np.flatnonzero(d >= 0)
            return sum(sh.jaccard(a, int(d[a])) >= THRESHOLD for a in src.tolist())

        # edges of ours whose own estimated Jaccard to the root is below the threshold: the text joined
        # the cluster through another member (union-find is transitive), not by resembling the root
        sig = dedupe.signatures(texts, num_perm=NUM_PERM, ngram=NGRAM)
        src_o = np.flatnonzero(fo)
        chained = int((dedupe.estimated_jaccard(sig[src_o], sig[d_ours[src_o]]) < THRESHOLD).sum())
        v_ours, v_ds = verified(d_ours), verified(d_ds)
        sharegpt_exact = {"ours": v_ours / max(1, fo.sum()), "datasketch": v_ds / max(1, fd.sum())}

        table("ShareGPT near duplicates (flagged = marked a duplicate of an earlier text)",
              ["", "count"],
              [["flagged by ours", f"{fo.sum():,}"], ["flagged by datasketch", f"{fd.sum():,}"],
               ["flagged by both", f"{(fo & fd).sum():,}"], ["only ours", f"{(fo & ~fd).sum():,}"],
               ["only datasketch", f"{(~fo & fd).sum():,}"],
               ["ours: edges with exact Jaccard >= 0.8", f"{v_ours:,} / {fo.sum():,}"],
               ["datasketch: edges with exact Jaccard >= 0.8", f"{v_ds:,} / {fd.sum():,}"],
               ["ours: edges with estimated Jaccard to the root < 0.8 (chained)", f"{chained:,}"],
               ["(exact duplicates: same canonical text)", f"{exact:,}"]])
        del texts, sh, canon

    # ------------------------------------------------ synthetic
    t0 = time.perf_counter()
    syn = make_synthetic(n_syn, args.seed)
    n = len(syn.texts)
    print(f"\nsynthetic: {n:,} texts ({len(syn.pairs):,} planted pairs, seed {args.seed}) built in "
          f"{time.perf_counter() - t0:.1f}s; {sum(map(len, syn.texts)) / n:,.0f} chars on average")
    jac = syn.jaccard
    kinds = np.array(syn.kinds)
    buckets = [(0.0, 0.8), (0.8, 0.85), (0.85, 0.9), (0.9, 0.95), (0.95, 1.0), (1.0, 1.01)]

    limit = args.baseline_limit if 0 < args.baseline_limit < n else n
    sub = syn.texts[:limit]
    in_sub = (syn.pairs < limit).all(axis=1)
    d_ours_full, t_ours_full = timed(run_ours, syn.texts, args.repeats, clear_caches)
    if limit < n:
        d_ours_sub, t_ours_sub = timed(run_ours, sub, args.repeats, clear_caches)
    else:
        d_ours_sub, t_ours_sub = d_ours_full, t_ours_full
    d_ds, t_ds = timed(run_datasketch, sub, 1)
    ratios["synthetic"] = t_ds.seconds / t_ours_sub.seconds

    title = f"synthetic ({limit:,} texts{'' if limit == n else f', the first {limit:,} of {n:,}'})"
    rows_ = speed_rows(limit, t_ours_sub, t_ds)
    if limit < n:
        rows_.insert(1, [f"ours, all {n:,} texts", f"{n:,}", f"{t_ours_full.seconds:.2f}",
                         fmt_rate(n, t_ours_full.seconds), f"{len(t_ours_full.runs)}"])
        print(f"\nNOTE: datasketch ran on the first {limit:,} texts only; the ratio compares both on those texts, "
              f"recall counts only the planted pairs with both texts among them.")
    table(title, SPEED_HEADER, rows_)
    print(f"throughput ratio ours/datasketch (same {limit:,} texts): {ratios['synthetic']:.2f}x")

    shingles = ShingleCache(syn.texts)
    # evaluation on the texts both pipelines saw
    sub_syn = Synthetic(sub, syn.family[:limit], syn.pairs, syn.kinds, syn.jaccard)
    q_ours = evaluate(d_ours_sub, sub_syn, in_sub, shingles)
    q_ds = evaluate(d_ds, sub_syn, in_sub, shingles)
    qrows = []
    for name, q in (("ours", q_ours), ("datasketch", q_ds)):
        qrows.append([name, f"{q.pairs:,}", f"{q.recall:.4f}", f"{q.recall_85:.4f} ({q.pairs_85:,})",
                      f"{q.edges:,}", f"{q.precision:.4f}", f"{len(q.false_edges):,}"])
    q_full = None
    if limit < n:
        q_full = evaluate(d_ours_full, syn, np.ones(len(syn.pairs), bool), shingles)
        qrows.append([f"ours, all {n:,}", f"{q_full.pairs:,}", f"{q_full.recall:.4f}",
                      f"{q_full.recall_85:.4f} ({q_full.pairs_85:,})", f"{q_full.edges:,}",
                      f"{q_full.precision:.4f}", f"{len(q_full.false_edges):,}"])
    table("planted pairs: recall = both in one cluster; precision = reported edges (text -> the text it duplicates) "
          "in one planted family or with exact Jaccard >= 0.8",
          ["pipeline", "planted pairs", "recall", "recall, pairs J >= 0.85 (n)", "edges", "precision", "false edges"],
          qrows)

    js = jac[in_sub]
    print(f"\nplanted-pair exact Jaccard ({len(js):,} pairs): min {js.min():.3f}, median {np.median(js):.3f}, "
          f"share >= 0.8 {np.mean(js >= 0.8):.3f}, share >= 0.85 {np.mean(js >= 0.85):.3f}")
    krows = []
    for k in EDIT_KINDS:
        m = kinds[in_sub] == k
        if not m.any():
            continue
        jk = js[m]
        krows.append([k, f"{m.sum():,}", f"{jk.min():.3f}", f"{np.median(jk):.3f}", f"{np.mean(jk >= 0.85):.3f}",
                      f"{q_ours.found[m].mean():.4f}", f"{q_ds.found[m].mean():.4f}",
                      f"{q_ours.found[m & (js >= 0.85)].mean() if (m & (js >= 0.85)).any() else float('nan'):.4f}",
                      f"{q_ds.found[m & (js >= 0.85)].mean() if (m & (js >= 0.85)).any() else float('nan'):.4f}"])
    table("by edit kind", ["edit", "pairs", "J min", "J median", "share J >= 0.85", "recall ours", "recall datasketch",
                           "recall ours J>=.85", "recall ds J>=.85"], krows)
    brows = []
    for lo, hi in buckets:
        m = (js >= lo) & (js < hi)
        if not m.any():
            continue
        label = "J = 1" if lo == 1.0 else f"{lo:.2f} <= J < {hi:.2f}"
        brows.append([label, f"{m.sum():,}", f"{q_ours.found[m].mean():.4f}", f"{q_ds.found[m].mean():.4f}"])
    table("recall by exact Jaccard of the planted pair", ["exact Jaccard", "pairs", "recall ours", "recall datasketch"],
          brows)
    for name, q in (("ours", q_ours), ("datasketch", q_ds)):
        if q.false_edges:
            ex = ", ".join(f"{a}->{b} J={j:.3f}" for a, b, j in q.false_edges[:5])
            print(f"{name}: false edges, first {min(5, len(q.false_edges))}: {ex}")

    # ------------------------------------------------ target
    print(f"\ntarget: >= {TARGET_RATIO:.0f}x throughput, recall >= {TARGET_RECALL}, precision >= {TARGET_PRECISION}")
    print("  (recall is measured on planted pairs with exact Jaccard >= 0.85; all pairs shown above too)")
    for name, r in ratios.items():
        print(f"  throughput {name}: {r:.2f}x  {'MET' if r >= TARGET_RATIO else 'NOT MET'}")
    print(f"  recall (J >= 0.85): {q_ours.recall_85:.4f}  {'MET' if q_ours.recall_85 >= TARGET_RECALL else 'NOT MET'}"
          f"   (all planted pairs: {q_ours.recall:.4f})")
    print(f"  precision: {q_ours.precision:.4f}  {'MET' if q_ours.precision >= TARGET_PRECISION else 'NOT MET'}")
    if sharegpt_exact:
        print(f"  (not a target: on ShareGPT the share of reported edges with exact Jaccard >= 0.8 is "
              f"{sharegpt_exact['ours']:.4f} for ours, {sharegpt_exact['datasketch']:.4f} for datasketch)")
    met = (all(r >= TARGET_RATIO for r in ratios.values()) and q_ours.recall_85 >= TARGET_RECALL
           and q_ours.precision >= TARGET_PRECISION)
    print(f"  overall: {'MET' if met else 'NOT MET'}")
    print(f"load average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1 / 5 / 15 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
