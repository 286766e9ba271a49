"""Dedupe a large synthetic catalog incrementally against the lineage store (issue 27).

The path is discover's own driver, `tasks.outcomes.decide_and_write`: per batch `prepare_batch`
(normalise, MinHash signatures), `resolve_batch` (exact dedupe against the store, LSH near dedupe
against the store's index and the batch), both while the previous batch is written, then
`LineageStore.write_discover_batch` (records, prompts with their text, the index segment, one
transaction) on its own thread. Timed: the driver's wall time; its phases are timed where they
run. Not timed: generating the records and the bookkeeping that scores them (reported separately).

Records: short prompts (15-120 words from a Zipf-like 50K-word vocabulary), made batch by batch
with numpy (never all in memory). 10% are planted variants of an earlier record: one edit kind
each (substitute/insert/delete/reorder/whitespace/case/combo, as benchmarks/dedupe.py); half of
the partners are in the same batch, a quarter 1-3 batches later, a quarter anywhere later (the
cross-batch path). Exact Jaccard of each planted pair: word 5-gram shingles of `canonical_text`.

    .venv/bin/python benchmarks/dedupe_catalog.py               # 10,000,000 records
    .venv/bin/python benchmarks/dedupe_catalog.py --quick       # 200,000
    .venv/bin/python benchmarks/dedupe_catalog.py --records 200000 --code /tmp/oldtree  # another checkout's code
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE, MIN_WORDS, MAX_WORDS = 50_000, 15, 120
PLANTED_SHARE, THRESHOLD_RECALL = 0.10, 0.85
TARGET_S, TARGET_GB, TARGET_RECALL = 600.0, 4.0, 0.99
EDIT_KINDS = ("substitute", "insert", "delete", "reorder", "whitespace", "case", "combo")
J_BUCKETS = (0.0, 0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0001)


# ---------------------------------------------------------------- synthetic catalog

class Words:
    """The vocabulary as one byte pool, so texts are built from word ids without a Python loop per word."""

    def __init__(self, rng: np.random.Generator, vocab: list[str]):
        self.vocab = vocab
        spaced = [w + " " for w in vocab]
        self.pool = np.frombuffer("".join(spaced).encode("ascii"), dtype=np.uint8)
        self.length = np.array([len(w) for w in spaced], dtype=np.int64)
        self.offset = np.cumsum(self.length) - self.length
        weights = 1.0 / (np.arange(len(vocab)) + 10.0)  # Zipf-ish, s = 1, flattened head
        self.cdf = np.cumsum(weights / weights.sum())
        self.rng = rng

    def draw(self, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, self.rng.random(n)), len(self.vocab) - 1)

    def texts(self, lengths: np.ndarray) -> list[str]:
        ids = self.draw(int(lengths.sum()))
        lens = self.length[ids]
        tok_start = np.cumsum(lens) - lens
        total = int(lens.sum())
        pos = np.repeat(self.offset[ids] - tok_start, lens) + np.arange(total)
        blob = self.pool[pos].tobytes().decode("ascii")
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        starts = tok_start[bounds[:-1]]
        ends = tok_start[bounds[1:] - 1] + lens[bounds[1:] - 1] - 1  # without the trailing space
        return [blob[a:b] for a, b in zip(starts.tolist(), ends.tolist())]


def variant(text: str, kind: str, words: Words, rng: np.random.Generator) -> str:
    w = text.split(" ")
    k = max(1, len(w) // 100)

    def pick() -> str:
        return words.vocab[int(words.draw(1)[0])]

    if kind in ("substitute", "combo"):
        for p in rng.choice(len(w), size=k, replace=False):
            w[p] = pick()
    elif kind == "insert":
        for _ in range(k):
            w.insert(int(rng.integers(0, len(w) + 1)), pick())
    elif kind == "delete":
        for p in sorted(rng.choice(len(w), size=k, replace=False), reverse=True):
            del w[p]
    elif kind == "reorder":  # two adjacent "sentences" of ~12 words swapped
        s = min(12, len(w) // 2)
        a = int(rng.integers(0, len(w) - 2 * s + 1))
        w[a : a + 2 * s] = w[a + s : a + 2 * s] + w[a : a + s]
    if kind in ("case", "combo"):
        w = [x.upper() if rng.random() < 0.3 else x for x in w] if kind == "combo" else [x.upper() for x in w]
    if kind in ("whitespace", "combo"):
        return "".join(x + ("  " if rng.random() < 0.2 else "\n" if rng.random() < 0.05 else " ") for x in w).strip()
    return " ".join(w)


@dataclass
class Planted:
    """Planted pairs: the two records' roots (the kept prompt each ends at), prompt ids, edit kind, exact Jaccard."""

    capacity: int
    root: np.ndarray = field(init=False)
    pid: np.ndarray = field(init=False)
    kind: np.ndarray = field(init=False)
    jaccard: np.ndarray = field(init=False)
    n: int = 0

    def __post_init__(self) -> None:
        self.root = np.zeros((self.capacity, 2), dtype="S32")
        self.pid = np.zeros((self.capacity, 2), dtype="S32")
        self.kind = np.zeros(self.capacity, dtype=np.int8)
        self.jaccard = np.zeros(self.capacity, dtype=np.float32)


class Catalog:
    """Batches of records, made on demand; planted partners scheduled into this or later batches."""

    def __init__(self, n_records: int, batch: int, seed: int):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from dedupe import _vocabulary, exact_jaccard, shingle_set  # benchmarks/dedupe.py: same shingles

        self.shingles, self.jaccard_of = shingle_set, exact_jaccard
        self.rng = np.random.default_rng(seed)
        self.words = Words(self.rng, _vocabulary(self.rng, VOCAB_SIZE))
        self.n_records, self.batch = n_records, batch
        self.n_batches = -(-n_records // batch)
        self.pending: dict[int, list[tuple[int, str]]] = {}  # batch -> (pair, base text)
        self.planted = Planted(int(n_records * PLANTED_SHARE) + batch + 16)
        self.made = 0

    def make(self, b: int) -> tuple[list[str], list[tuple[int, int, int]]]:
        """Texts of batch b and (position, pair, role 0 base / 1 variant) of its planted records."""
        size = min(self.batch, self.n_records - self.made) if b < self.n_batches - 1 else self.n_records - self.made
        due = self.pending.pop(b, [])
        later = b < self.n_batches - 1
        n_same = int(round(size * PLANTED_SHARE / 2))
        n_later = n_same if later else 0
        n_new = max(0, size - len(due) - n_same)
        bases = self.words.texts(self.rng.integers(MIN_WORDS, MAX_WORDS + 1, size=n_new))
        parents = self.rng.choice(n_new, size=min(n_new, n_same + n_later), replace=False)
        texts = list(bases)
        members: list[tuple[int, int, int]] = []
        for j, parent in enumerate(parents.tolist()):
            pair = self.planted.n
            self.planted.n += 1
            members.append((parent, pair, 0))
            if j < n_same:
                texts.append(self._variant(pair, bases[parent]))
                members.append((len(texts) - 1, pair, 1))
            else:  # half within 3 batches, half anywhere later: the cross-batch path
                near = self.rng.random() < 0.5
                to = b + int(self.rng.integers(1, 4)) if near else int(self.rng.integers(b + 1, self.n_batches))
                self.pending.setdefault(min(to, self.n_batches - 1), []).append((pair, bases[parent]))
        for pair, base in due:
            texts.append(self._variant(pair, base))
            members.append((len(texts) - 1, pair, 1))
        order = self.rng.permutation(len(texts))
        where = np.empty(len(texts), dtype=np.int64)
        where[order] = np.arange(len(texts))
        self.made += len(texts)
        return [texts[i] for i in order.tolist()], [(int(where[p]), pair, role) for p, pair, role in members]

    def _variant(self, pair: int, base: str) -> str:
        kind = int(self.rng.integers(0, len(EDIT_KINDS)))
        text = variant(base, EDIT_KINDS[kind], self.words, self.rng)
        self.planted.kind[pair] = kind
        self.planted.jaccard[pair] = self.jaccard_of(self.shingles(base), self.shingles(text))
        return text


# ---------------------------------------------------------------- the run

def peak_rss_gb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return kb / 2**20


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def run(args: argparse.Namespace) -> dict:
    from storage.lineage import LineageStore
    from tasks.config import NearDedupeConfig
    from tasks.dedupe import lsh_params
    import tasks.outcomes as outcomes
    from tasks.outcomes import decide_and_write, minhash_params_key
    from tasks.sources import RawRecord

    workspace = Path(args.workspace or tempfile.mkdtemp(prefix="dedupe-catalog-"))
    shutil.rmtree(workspace, ignore_errors=True)
    workspace.mkdir(parents=True)
    store = LineageStore(workspace / "lineage.duckdb")
    near = NearDedupeConfig()
    formats = {"catalog": ("prompt_response", "prompt", "response")}
    catalog = Catalog(args.records, args.batch, args.seed)
    planted = catalog.planted
    counts: dict[str, int] = {}
    phase = {"generation": 0.0, "prepare": 0.0, "resolve": 0.0, "write": 0.0, "scoring": 0.0}
    calls = {"prepare": 0, "resolve": 0, "write": 0}

    def timed_as(name, fn):
        def call(*a, **k):
            calls[name] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phase[name] += time.perf_counter() - t0
        return call

    # Code from before 2026-12-03 resolved a batch only after the previous write had committed.
    resolve_overlapped = "in_flight" in inspect.signature(outcomes.resolve_batch).parameters
    # The phases, timed where discover's own driver calls them (the write on its own thread).
    outcomes.prepare_batch = timed_as("prepare", outcomes.prepare_batch)
    outcomes.resolve_batch = timed_as("resolve", outcomes.resolve_batch)
    store.write_discover_batch = timed_as("write", store.write_discover_batch)

    made: list[tuple[list[RawRecord], list[tuple[int, int, int]], list[str]]] = []

    def generate(b: int) -> None:
        t0 = time.perf_counter()
        texts, members = catalog.make(b)
        records = [RawRecord("catalog", f"r{catalog.made - len(texts) + i}", {"prompt": t}) for i, t in enumerate(texts)]
        made.append((records, members, texts))
        phase["generation"] += time.perf_counter() - t0

    def chunks():
        for b in range(catalog.n_batches):
            yield made[b][0]

    state = {"b": 0, "edges": 0, "explained": 0, "last": 0.0, "slowest": (0.0, -1)}
    unexplained: list[tuple[str, str]] = []  # (record text, prompt id it was reported a duplicate of)

    def on_written(batch) -> None:
        t0 = time.perf_counter()
        b = state["b"]
        state["slowest"] = max(state["slowest"], (t0 - state["last"], b))
        _, members, texts = made[b]
        made[b] = (None, None, None)  # let the batch go
        # Scoring, not timed: roots of planted records, and which near-duplicate edges planting explains.
        rows = batch.records
        for r in rows:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        role_of = {}
        for pos, pair, role in members:
            r = rows[pos]
            planted.pid[pair, role] = r["prompt_id"]
            planted.root[pair, role] = r["duplicate_of"] or r["prompt_id"]
            role_of[pos] = (pair, role)
        for pos, r in enumerate(rows):
            if r["outcome"] != "near_duplicate":
                continue
            state["edges"] += 1
            hit = role_of.get(pos)
            target = r["duplicate_of"].encode()
            if hit is not None and target in (planted.pid[hit[0], 1 - hit[1]], planted.root[hit[0], 1 - hit[1]]):
                state["explained"] += 1
            else:
                unexplained.append((texts[pos], r["duplicate_of"]))
        phase["scoring"] += time.perf_counter() - t0
        # The driver takes batch b + 2 next (b + 1 is being prepared): made here, not while a write runs.
        if b + 2 < catalog.n_batches:
            generate(b + 2)
        state["b"] = b + 1
        if args.progress and (b % args.progress == 0 or b == catalog.n_batches - 1):
            print(f"  batch {b + 1}/{catalog.n_batches}: {catalog.made:,} records, "
                  f"timed {time.perf_counter() - t_start - phase['generation'] - phase['scoring']:.1f} s "
                  f"(prepare {phase['prepare']:.1f}, resolve {phase['resolve']:.1f}, write {phase['write']:.1f} "
                  f"on its own thread), generation {phase['generation']:.1f} s, peak RSS {peak_rss_gb():.2f} GB",
                  flush=True)
        state["last"] = time.perf_counter()

    for b in range(min(2, catalog.n_batches)):
        generate(b)
    t_start = time.perf_counter()
    state["last"] = t_start
    untimed_before = phase["generation"]
    phase["generation"] = 0.0
    decide_and_write(chunks(), "bench", formats, store, near, None, on_written=on_written)
    t_total = time.perf_counter() - t_start
    timed = t_total - phase["generation"] - phase["scoring"]
    phase["generation"] += untimed_before
    edges, explained, slowest = state["edges"], state["explained"], state["slowest"]

    # Unexplained edges: true if exact Jaccard >= 0.8 with the stored prompt they name.
    true_unexplained = 0
    if unexplained:
        _, stored = store.query_readonly(
            "SELECT prompt_id, messages[1].content FROM prompts WHERE prompt_id IN ("
            + ",".join(f"'{d}'" for _, d in unexplained) + ")")
        text_of = dict(stored)
        true_unexplained = sum(catalog.jaccard_of(catalog.shingles(t), catalog.shingles(text_of[d])) >= 0.8
                               for t, d in unexplained)

    n = planted.n
    found = planted.root[:n, 0] == planted.root[:n, 1]
    jac = planted.jaccard[:n]
    high = jac >= THRESHOLD_RECALL
    by_bucket = []
    for lo, hi in zip(J_BUCKETS[:-1], J_BUCKETS[1:]):
        m = (jac >= lo) & (jac < hi)
        by_bucket.append({"jaccard": f"[{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'}", "pairs": int(m.sum()),
                          "recall": float(found[m].mean()) if m.any() else None})
    by_kind = [{"kind": k, "pairs": int((planted.kind[:n] == i).sum()),
                "recall_j>=0.85": float(found[(planted.kind[:n] == i) & high].mean())
                if ((planted.kind[:n] == i) & high).any() else None} for i, k in enumerate(EDIT_KINDS)]

    # A new process's view: the whole index loaded from its segment files.
    load_s = index_ram = None
    index_folder = workspace / "data" / "minhash"
    if hasattr(store, "near_index"):
        fresh = LineageStore(store.path)
        t0 = time.perf_counter()
        index = fresh.near_index(minhash_params_key(near), near.num_perm, lsh_params(near.threshold, near.num_perm)[0])
        load_s = time.perf_counter() - t0
        index_ram = index.nbytes()
    db_bytes = store.path.stat().st_size
    result = {
        "date": datetime.date.today().isoformat(),
        "code": args.code or str(ROOT),
        "records": catalog.made, "batch": args.batch, "batches": catalog.n_batches, "seed": args.seed,
        "timed_s": round(timed, 1), "prepare_s": round(phase["prepare"], 1), "resolve_s": round(phase["resolve"], 1),
        "write_s": round(phase["write"], 1), "write_overlapped": True, "resolve_overlapped": resolve_overlapped,
        "resolves": calls["resolve"],
        "records_per_s": round(catalog.made / timed), "generation_s": round(phase["generation"], 1),
        "scoring_s": round(phase["scoring"], 1), "wall_s": round(t_total + untimed_before, 1),
        "slowest_batch_s": round(slowest[0], 2), "slowest_batch": slowest[1],
        "peak_rss_gb": round(peak_rss_gb(), 2),
        "outcomes": counts, "planted_pairs": n, "pairs_j_ge_0.85": int(high.sum()),
        "recall_j_ge_0.85": float(found[high].mean()) if high.any() else None,
        "recall_all": float(found.mean()) if n else None,
        "recall_by_jaccard": by_bucket, "recall_by_kind": by_kind,
        "near_edges": edges, "edges_planted": explained, "edges_other": len(unexplained),
        "edges_other_true": int(true_unexplained),
        "precision": (explained + true_unexplained) / edges if edges else None,
        "db_bytes": db_bytes, "index_bytes": folder_bytes(index_folder),
        "index_load_s": None if load_s is None else round(load_s, 2),
        "index_ram_bytes": index_ram,
        "python": platform.python_version(), "numpy": np.__version__, "cores": os.cpu_count(),
    }
    if not args.keep:
        shutil.rmtree(workspace, ignore_errors=True)
    return result


def _phases(r: dict) -> list[tuple[str, str, str]]:
    if "decide_s" in r:  # results from before the write overlapped the next batch's preparation
        return [("  of which decide_outcomes", f"{r['decide_s']:.1f} s", ""),
                ("  of which write_discover_batch", f"{r['write_s']:.1f} s", "")]
    if not r.get("resolve_overlapped"):  # results from before the next batch was resolved during the write
        return [("  prepare_batch (store-free)", f"{r['prepare_s']:.1f} s", "overlaps the previous write"),
                ("  resolve_batch (against the store)", f"{r['resolve_s']:.1f} s", ""),
                ("  write_discover_batch (own thread)", f"{r['write_s']:.1f} s", "")]
    return [("  prepare_batch (store-free)", f"{r['prepare_s']:.1f} s", "overlaps the previous write"),
            ("  resolve_batch", f"{r['resolve_s']:.1f} s",
             f"overlaps the previous write; {r['resolves']} calls for {r['batches']} batches"),
            ("  write_discover_batch (own thread)", f"{r['write_s']:.1f} s", "")]


def report(r: dict) -> None:
    gb = 1e9
    rows = [
        ("records (batches of %s)" % f"{r['batch']:,}", f"{r['records']:,}", ""),
        ("timed: decide_and_write (discover's driver)", f"{r['timed_s']:.1f} s", f"<= {TARGET_S:.0f} s"),
        *_phases(r),
        ("records/s (timed)", f"{r['records_per_s']:,}", ""),
        ("slowest batch", f"{r['slowest_batch_s']:.2f} s (#{r['slowest_batch']})", ""),
        ("generation + scoring (not timed)", f"{r['generation_s']:.1f} s gen, {r.get('scoring_s', 0):.1f} s scoring, "
                                             f"{r['wall_s']:.1f} s wall in all", ""),
        ("peak RSS (self + children)", f"{r['peak_rss_gb']:.2f} GB", f"<= {TARGET_GB:.0f} GB"),
        ("planted pairs (J >= 0.85)", f"{r['planted_pairs']:,} ({r['pairs_j_ge_0.85']:,})", ""),
        ("recall, planted J >= 0.85", f"{r['recall_j_ge_0.85']:.4f}" if r["recall_j_ge_0.85"] is not None else "-",
         f">= {TARGET_RECALL}"),
        ("recall, all planted pairs", f"{r['recall_all']:.4f}" if r["recall_all"] is not None else "-", ""),
        ("precision (near-duplicate edges true)", f"{r['precision']:.4f}" if r["precision"] is not None else "-",
         f"{r['edges_planted']:,} planted + {r['edges_other_true']:,}/{r['edges_other']:,} other"),
        ("lineage.duckdb", f"{r['db_bytes'] / gb:.2f} GB ({r['db_bytes'] / r['records']:.0f} B/record)", ""),
        ("index segment files", f"{r['index_bytes'] / gb:.2f} GB", ""),
        ("index load in a new process", "-" if r["index_load_s"] is None else
         f"{r['index_load_s']:.2f} s, {r['index_ram_bytes'] / gb:.2f} GB in memory", ""),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    print(f"\n| {'measure':<{w0}} | {'value':>{w1}} | target / note |")
    print(f"|{'-' * (w0 + 2)}|{'-' * (w1 + 1)}:|---|")
    for a, b, c in rows:
        print(f"| {a:<{w0}} | {b:>{w1}} | {c} |")
    print("\nrecall by exact Jaccard of the planted pair:")
    for x in r["recall_by_jaccard"]:
        rec = "-" if x["recall"] is None else f"{x['recall']:.4f}"
        print(f"  {x['jaccard']:<14} {x['pairs']:>9,} pairs  recall {rec}")
    print("recall (J >= 0.85) by edit kind:")
    for x in r["recall_by_kind"]:
        rec = "-" if x["recall_j>=0.85"] is None else f"{x['recall_j>=0.85']:.4f}"
        print(f"  {x['kind']:<11} {x['pairs']:>9,} pairs  recall {rec}")
    print("outcomes:", ", ".join(f"{k} {v:,}" for k, v in sorted(r["outcomes"].items())))
    ok = (r["timed_s"] <= TARGET_S and r["peak_rss_gb"] <= TARGET_GB
          and (r["recall_j_ge_0.85"] or 0) >= TARGET_RECALL)
    print(f"targets (time, memory, recall): {'met' if ok else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true", help="200,000 records")
    ap.add_argument("--batch", type=int, default=20_000, help="records per batch (discover's write_batch_records)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workspace", help="default: a new temporary folder, removed after")
    ap.add_argument("--keep", action="store_true", help="keep the workspace")
    ap.add_argument("--code", help="import the pipeline from this checkout instead (e.g. the old code)")
    ap.add_argument("--progress", type=int, default=25, help="print every N batches (0: never)")
    ap.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results/dedupe_catalog.jsonl")
    args = ap.parse_args()
    if args.quick:
        args.records = 200_000
    sys.path.insert(0, str(ROOT))
    if args.code:
        sys.path.insert(0, str(Path(args.code).resolve()))
    print(f"dedupe_catalog: {args.records:,} records, batches of {args.batch:,}, seed {args.seed}, "
          f"code {args.code or ROOT}")
    result = run(args)
    report(result)
    if not args.no_save:
        out = ROOT / "benchmarks" / "results" / "dedupe_catalog.jsonl"
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"appended to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
