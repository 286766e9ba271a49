"""Dedupe a large synthetic catalog incrementally against the lineage store (issue 27).

The path is discover's own driver, `tasks.discover.outcomes.decide_and_write`: per batch `prepare_batch`
(normalise, MinHash signatures, while the previous batch is written), `resolve_batch` (exact dedupe
against the store, LSH near dedupe against the store's index and the batch), then
`store.discover.write_batch` (records, prompts with their text, the index segment, one
transaction) on its own thread.

The catalog is made first and written to disk, not timed. Then one timed pass per checkout (this
one, then each `--against`), each in its own process (its own peak memory) on a new store, so a
change and the code before it are compared in one run. Timed is the driver's whole wall time,
reading each batch from disk and scoring its outcomes included.

Records: short prompts (15-120 words from a Zipf-like 50K-word vocabulary), made batch by batch
with numpy. 10% are planted variants of an earlier record: one edit kind each
(substitute/insert/delete/reorder/whitespace/case/combo, as benchmarks/dedupe.py); half of the
partners are in the same batch, a quarter 1-3 batches later, a quarter anywhere later (the
cross-batch path). Exact Jaccard of each planted pair: word 5-gram shingles of `canonical_text`.

    .venv/bin/python -m benchmarks.rehearsals.dedupe_catalog --batch 100000    # 10,000,000 records
    .venv/bin/python -m benchmarks.rehearsals.dedupe_catalog --quick           # 200,000
    .venv/bin/python -m benchmarks.rehearsals.dedupe_catalog --quick --against /tmp/oldtree  # and another checkout's code
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.report import ROOT
VOCAB_SIZE, MIN_WORDS, MAX_WORDS = 50_000, 15, 120
PLANTED_SHARE, THRESHOLD_RECALL = 0.10, 0.85
TARGET_S, TARGET_GB, TARGET_RECALL = 600.0, 4.0, 0.99  # GB: 10^9 bytes (the peak is measured in GiB)
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
        from benchmarks.dedupe import exact_jaccard, shingle_set, vocabulary  # the dedupe benchmark's shingles

        self.shingles, self.jaccard_of = shingle_set, exact_jaccard
        self.rng = np.random.default_rng(seed)
        self.words = Words(self.rng, vocabulary(self.rng, VOCAB_SIZE))
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
    """Peak resident memory of this process plus its largest child, in GiB (2^30 bytes; the
    results' `*_gb` fields have always been GiB)."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return kb / 2**20


def rss_gb() -> dict[str, float]:
    """Resident memory now, in GiB, anonymous (the heap, DuckDB's buffers) and file-backed (mapped
    files): beside the peak, it tells a lasting rise from a passing one, and memory from cache."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile")))
    return {k: int(v.split()[0]) / 2**20 for k, v in fields.items()}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def write_catalog(catalog: Catalog, folder: Path) -> list[np.ndarray]:
    """Every batch's texts to `folder` (one NUL-joined UTF-8 array each), before anything is timed:
    made during the timed pass, they would take CPU from the driver. Returns each batch's planted
    members, (position, pair, role) rows."""
    folder.mkdir(parents=True, exist_ok=True)
    members_of = []
    for b in range(catalog.n_batches):
        texts, members = catalog.make(b)
        assert not any("\x00" in t for t in texts)
        np.save(folder / f"{b:05d}.npy", np.frombuffer("\x00".join(texts).encode("utf-8"), dtype=np.uint8))
        members_of.append(np.array(members, dtype=np.int64).reshape(-1, 3))
    return members_of


def read_batch(folder: Path, b: int) -> list[str]:
    return np.load(folder / f"{b:05d}.npy").tobytes().decode("utf-8").split("\x00")


def save_catalog(catalog: Catalog, members_of: list[np.ndarray], folder: Path) -> None:
    """What scoring needs besides the texts: planted members per batch, each pair's edit kind and Jaccard."""
    n = catalog.planted.n
    np.savez(folder / "planted.npz", members=np.concatenate(members_of), per_batch=[len(m) for m in members_of],
             kind=catalog.planted.kind[:n], jaccard=catalog.planted.jaccard[:n], made=catalog.made)


def load_catalog(folder: Path) -> tuple[SimpleNamespace, list[np.ndarray]]:
    from benchmarks.dedupe import exact_jaccard, shingle_set

    z = np.load(folder / "planted.npz")
    planted = Planted(len(z["kind"]))
    planted.n = len(z["kind"])
    planted.kind[:], planted.jaccard[:] = z["kind"], z["jaccard"]
    members_of = np.split(z["members"], np.cumsum(z["per_batch"])[:-1])
    catalog = SimpleNamespace(planted=planted, n_batches=len(members_of), made=int(z["made"]),
                              shingles=shingle_set, jaccard_of=exact_jaccard)
    return catalog, members_of


def run(args: argparse.Namespace) -> list[dict]:
    """The catalog made once (not timed); then one timed pass per checkout (this one, then each
    `--against`), each in its own process (its own peak memory) on a new store."""
    workspace = Path(args.workspace or tempfile.mkdtemp(prefix="dedupe-catalog-"))
    shutil.rmtree(workspace, ignore_errors=True)
    workspace.mkdir(parents=True)
    catalog = Catalog(args.records, args.batch, args.seed)
    t0 = time.perf_counter()
    members_of = write_catalog(catalog, workspace / "catalog")
    save_catalog(catalog, members_of, workspace / "catalog")
    generation_s = time.perf_counter() - t0
    del catalog, members_of
    print(f"  catalog made in {generation_s:.1f} s (not timed)", flush=True)
    results = []
    for k, code in enumerate([args.code] + (args.against or [])):
        out = workspace / f"pass{k}.json"
        cmd = [sys.executable, "-m", "benchmarks.rehearsals.dedupe_catalog", "--records", str(args.records),
               "--batch", str(args.batch), "--seed", str(args.seed), "--progress", str(args.progress),
               "--pass-in", str(workspace), "--pass-out", str(out)] + (["--code", code] if code else [])
        env = dict(os.environ)
        if code:
            # The other checkout's pipeline first, this one's benchmarks after it; -P keeps the working
            # folder off the path, so this tree's tasks/ cannot shadow the other checkout's.
            cmd[1:1] = ["-P"]
            env["PYTHONPATH"] = os.pathsep.join([str(Path(code).resolve()), str(ROOT)])
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        results.append({**json.loads(out.read_text()), "generation_s": round(generation_s, 1)})
    if not args.keep:
        shutil.rmtree(workspace, ignore_errors=True)
    return results


def timed_pass(args: argparse.Namespace, workspace: Path, name: str) -> dict:
    """One pass over the catalog in `workspace`/catalog, into a new store in `workspace`/`name`."""
    from storage.lineage import LineageStore
    from storage.studies import StudyReads
    from tasks.config import NearDedupeConfig
    from tasks.discover.dedupe import lsh_params
    from tasks.discover.outcomes import decide_and_write, minhash_params_key
    from tasks.discover.sources import RawRecord

    texts_folder = workspace / "catalog"
    catalog, members_of = load_catalog(texts_folder)
    workspace = workspace / name
    shutil.rmtree(workspace, ignore_errors=True)
    workspace.mkdir(parents=True)
    store = LineageStore(workspace / "lineage.duckdb")
    near = NearDedupeConfig()
    formats = {"catalog": ("prompt_response", "prompt", "response")}
    planted = catalog.planted
    counts: dict[str, int] = {}
    phase = {"read": 0.0, "prepare": 0.0, "resolve": 0.0, "write": 0.0, "scoring": 0.0}
    texts_of: dict[int, list[str]] = {}

    def chunks():
        first = 0
        for b in range(catalog.n_batches):
            t0 = time.perf_counter()
            texts = read_batch(texts_folder, b)
            texts_of[b] = texts
            records = [RawRecord("catalog", f"r{first + i}", {"prompt": t}) for i, t in enumerate(texts)]
            first += len(texts)
            phase["read"] += time.perf_counter() - t0
            yield records

    state = {"b": 0, "edges": 0, "explained": 0, "last": 0.0, "slowest": (0.0, -1), "peak_anon": 0.0}
    unexplained: list[tuple[str, str]] = []  # (record text, prompt id it was reported a duplicate of)

    def on_written(batch) -> None:
        t0 = time.perf_counter()
        b = state["b"]
        state["slowest"] = max(state["slowest"], (t0 - state["last"], b))
        texts = texts_of.pop(b)
        # Scoring, timed with the rest: it runs where a caller's on_written runs, on the main thread
        # beside the write. Roots of planted records, and which near-duplicate edges planting explains.
        rows = batch.records
        for r in rows:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        role_of = {}
        for pos, pair, role in members_of[b].tolist():
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
        state["b"] = b + 1
        rss = rss_gb()
        state["peak_anon"] = max(state["peak_anon"], rss["RssAnon"])
        if args.progress and (b % args.progress == 0 or b == catalog.n_batches - 1):
            print(f"  [{name}] batch {b + 1}/{catalog.n_batches}: timed {time.perf_counter() - t_start:.1f} s "
                  f"(prepare {phase['prepare']:.1f}, resolve {phase['resolve']:.1f}, "
                  f"write {phase['write']:.1f} on its own thread), RSS {rss['RssAnon']:.2f} GiB anonymous "
                  f"+ {rss['RssFile']:.2f} file-backed, peak {peak_rss_gb():.2f} GiB", flush=True)
        state["last"] = time.perf_counter()

    t_start = time.perf_counter()
    state["last"] = t_start
    # The phases, timed where discover's own driver calls them (the write on its own thread).
    decide_and_write(chunks(), "bench", formats, store, near, None, on_written=on_written, phase_seconds=phase)
    timed = time.perf_counter() - t_start
    peak_gb = peak_rss_gb()  # the run's, before the index is loaded again below
    edges, explained, slowest = state["edges"], state["explained"], state["slowest"]

    # Unexplained edges: true if exact Jaccard >= 0.8 with the stored prompt they name.
    true_unexplained = 0
    if unexplained:
        text_of = StudyReads(store).prompt_texts([d for _, d in unexplained])
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
        index = fresh.near_index.load(minhash_params_key(near), near.num_perm, lsh_params(near.threshold, near.num_perm)[0])
        load_s = time.perf_counter() - t0
        index_ram = index.nbytes()
    db_bytes = store.path.stat().st_size
    result = {
        "date": datetime.date.today().isoformat(),
        "code": args.code or str(ROOT),
        "records": catalog.made, "batch": args.batch, "batches": catalog.n_batches, "seed": args.seed,
        "timed_s": round(timed, 1), "prepare_s": round(phase["prepare"], 1),
        "read_s": round(phase["read"], 1), "resolve_s": round(phase["resolve"], 1),
        "write_s": round(phase["write"], 1), "write_overlapped": True, "resolves": state["b"],
        "records_per_s": round(catalog.made / timed), "scoring_s": round(phase["scoring"], 1),
        "slowest_batch_s": round(slowest[0], 2), "slowest_batch": slowest[1],
        "peak_rss_gb": round(peak_gb, 2), "peak_anon_gb_per_batch": round(state["peak_anon"], 2),
        "peak_rss_gb_after_index_load": round(peak_rss_gb(), 2),
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
    return result


def _phases(r: dict) -> list[tuple[str, str, str]]:
    return [("  prepare_batch (store-free)", f"{r['prepare_s']:.1f} s",
             f"during the previous write; reading the catalog {r['read_s']:.1f} s"),
            ("  resolve_batch (against the store)", f"{r['resolve_s']:.1f} s", ""),
            ("  write_discover_batch (own thread)", f"{r['write_s']:.1f} s", "")]


def report(r: dict) -> None:
    gb = 1e9
    rows = [
        ("records (batches of %s)" % f"{r['batch']:,}", f"{r['records']:,}", ""),
        ("timed: decide_and_write (discover's driver)", f"{r['timed_s']:.1f} s", f"<= {TARGET_S:.0f} s"),
        *_phases(r),
        ("records/s (timed)", f"{r['records_per_s']:,}", ""),
        ("slowest batch", f"{r['slowest_batch_s']:.2f} s (#{r['slowest_batch']})", ""),
        ("catalog made before (not timed)", f"{r['generation_s']:.1f} s", ""),
        ("scoring the outcomes (timed)", f"{r['scoring_s']:.1f} s", "on the main thread, beside the driver"),
        ("peak RSS (self + children)", f"{r['peak_rss_gb']:.2f} GiB ({r['peak_rss_gb'] * 2**30 / gb:.2f} GB)",
         f"<= {TARGET_GB:.0f} GB"),
        ("  anonymous, after a batch (largest)", f"{r['peak_anon_gb_per_batch']:.2f} GiB", "heap and DuckDB's buffers"),
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
    ok = (r["timed_s"] <= TARGET_S and r["peak_rss_gb"] * 2**30 <= TARGET_GB * 1e9
          and (r["recall_j_ge_0.85"] or 0) >= TARGET_RECALL)
    print(f"targets (time, memory, recall): {'met' if ok else 'NOT met'}")


def compare(results: list[dict]) -> None:
    """Each other checkout's time as a ratio to this one's, and whether their outcomes agree."""
    first = results[0]
    for r in results[1:]:
        same = r["outcomes"] == first["outcomes"]
        print(f"\n{r['code']}: {r['timed_s']:.1f} s against {first['timed_s']:.1f} s here: this checkout "
              f"{r['timed_s'] / first['timed_s']:.2f}x as fast; outcomes {'identical' if same else 'DIFFER'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true", help="200,000 records")
    ap.add_argument("--batch", type=int, default=20_000, help="records per batch (discover's write_batch_records)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workspace", help="default: a new temporary folder, removed after")
    ap.add_argument("--keep", action="store_true", help="keep the workspace")
    ap.add_argument("--code", help="time the pipeline of this checkout instead of this one")
    ap.add_argument("--against", action="append", metavar="CHECKOUT",
                    help="also a pass with this checkout's pipeline (e.g. the code before a change); repeatable")
    ap.add_argument("--progress", type=int, default=25, help="print every N batches (0: never)")
    ap.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results/dedupe_catalog.jsonl")
    ap.add_argument("--pass-in", help=argparse.SUPPRESS)  # one timed pass over a made catalog, in a child process
    ap.add_argument("--pass-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.records = 200_000
    if args.pass_in:
        Path(args.pass_out).write_text(json.dumps(timed_pass(args, Path(args.pass_in), Path(args.pass_out).stem)))
        return
    print(f"dedupe_catalog: {args.records:,} records, batches of {args.batch:,}, seed {args.seed}, "
          f"code {args.code or ROOT}")
    results = run(args)
    for result in results:
        report(result)
    compare(results)
    if not args.no_save:
        out = ROOT / "benchmarks" / "results" / "dedupe_catalog.jsonl"
        with open(out, "a") as f:
            for result in results:
                f.write(json.dumps(result) + "\n")
        print(f"appended to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
