"""The near-dedupe index: MinHash signatures and LSH band keys of stored prompts, as segment files.

Owns `<workspace>/data/minhash/<params>/<segment>.{ids,sig,keys}.npy` and the `minhash_segments`
registry table. Promises:
- Append-only and crash-safe like generation files: a segment's files are written and fsynced
  under the store's exclusive lock, inside the transaction that commits its prompts and registers
  the segment; a crash leaves a registered segment or an unregistered file, and unregistered files
  are deleted (under the same lock) when a process first opens the index.
- A prompt id is indexed at most once per parameters: a batch indexes only the prompts its own
  transaction inserted, a backfill only prompts not indexed yet. (Were one ever indexed twice,
  lookups would still be right: candidates are de-duplicated by prompt id.)
- In memory only the band keys (folded to 32 bits, packed with a 32-bit entry number into one
  sorted uint64 per entry and band, 8 bytes x bands per prompt), in LSM runs merged geometrically;
  signatures and ids stay on disk and are read, memory-mapped, for candidates only.
- Segments registered by other processes are picked up at the next lookup (one registry query).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa

from storage.connection import DuckDBFile, utc_now
from storage.datasets import fsync_dir

_LOW32 = np.uint64(0xFFFFFFFF)
_SUFFIXES = (".ids.npy", ".sig.npy", ".keys.npy")


def fold_keys(keys: np.ndarray) -> np.ndarray:
    """64-bit band keys to 32 bits (xor of halves): a false bucket match only adds a candidate,
    which signature verification then rejects."""
    k = np.asarray(keys, dtype=np.uint64)
    return ((k >> np.uint64(32)) ^ (k & _LOW32)).astype(np.uint32)


def _save(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


class MinhashIndex:
    """One parameters key's index, as this process has loaded it (entries numbered in load order)."""

    def __init__(self, folder: Path, num_perm: int, bands: int):
        self.folder, self.num_perm, self.bands = folder, num_perm, bands
        self.names: list[str] = []
        self.known: set[str] = set()
        self.starts = np.zeros(0, dtype=np.int64)  # first entry number of each loaded segment
        self.size = 0
        self.runs: list[list[np.ndarray]] = []  # each: per band, n packed uint64 keys, sorted

    # ------------------------------------------------------------ loading

    def load(self, segments: list[tuple[str, int]]) -> None:
        """Add registered segments not loaded yet, as one new sorted run."""
        new = [(name, rows) for name, rows in segments if name not in self.known and rows > 0]
        self.known.update(name for name, _ in segments)
        if not new:
            return
        total = sum(rows for _, rows in new)
        run = np.empty((self.bands, total), dtype=np.uint64)
        at, starts = 0, []
        for name, rows in new:
            keys = np.load(self.folder / f"{name}.keys.npy")
            if keys.shape != (rows, self.bands):
                raise ValueError(f"minhash segment {name}: keys {keys.shape}, registry says {rows} rows")
            entry = np.arange(self.size + at, self.size + at + rows, dtype=np.uint64)
            run[:, at : at + rows] = (keys.T.astype(np.uint64) << np.uint64(32)) | entry
            starts.append(self.size + at)
            self.names.append(name)
            at += rows
        run.sort(axis=1)
        self.starts = np.concatenate((self.starts, np.array(starts, dtype=np.int64)))
        self.size += total
        self._push(list(run))

    def _push(self, run: list[np.ndarray]) -> None:
        # LSM: a run is merged into the one before it while that one is not more than twice its
        # size, so every entry is re-sorted O(log n) times in all and a batch never sorts everything.
        self.runs.append(run)
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            b = self.runs.pop()
            a = self.runs.pop()
            merged = []
            for band in range(len(a)):
                # Band by band, each input freed as it is merged: the peak is one band's copy.
                m = np.concatenate((a[band], b[band]))
                a[band] = b[band] = None
                m.sort(kind="stable")  # timsort: two sorted runs merge in linear time
                merged.append(m)
            self.runs.append(merged)

    # ------------------------------------------------------------ lookups

    def candidates(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query row, entry number) pairs sharing a band bucket, distinct, sorted."""
        if self.size == 0 or keys.size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        q = fold_keys(keys).astype(np.uint64) << np.uint64(32)
        found = []
        for b in range(self.bands):
            # Queries in key order: numpy's binary search then starts from the previous answer.
            order = np.argsort(q[:, b])
            lo_key = q[order, b]
            for run in self.runs:
                keys_b = run[b]
                lo = np.searchsorted(keys_b, lo_key, side="left")
                # Most queries match nothing: look at the one key each lands on before searching again.
                inside = lo < len(keys_b)
                hit = np.flatnonzero(inside)
                hit = hit[(keys_b[lo[hit]] >> np.uint64(32)) == (lo_key[hit] >> np.uint64(32))]
                if not len(hit):
                    continue
                hi = np.searchsorted(keys_b, lo_key[hit] | _LOW32, side="right")
                n = hi - lo[hit]
                rows = np.repeat(order[hit], n)
                pos = np.repeat(lo[hit] - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
                found.append(rows.astype(np.int64) * self.size + (keys_b[pos] & _LOW32).astype(np.int64))
        if not found:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        code = np.unique(np.concatenate(found))
        return code // self.size, code % self.size

    def fetch(self, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Prompt ids (S32) and signatures of sorted entry numbers, read from the segment files."""
        ids = np.empty(len(entries), dtype="S32")
        sig = np.empty((len(entries), self.num_perm), dtype=np.uint32)
        seg = np.searchsorted(self.starts, entries, side="right") - 1
        bounds = np.flatnonzero(np.diff(seg)) + 1
        for a, b in zip(np.concatenate(([0], bounds)), np.concatenate((bounds, [len(entries)]))):
            if a == b:
                continue
            s = int(seg[a])
            rows = entries[a:b] - self.starts[s]
            name = self.names[s]
            # Memory-mapped and dropped after: resident memory holds only the band keys.
            ids[a:b] = np.load(self.folder / f"{name}.ids.npy", mmap_mode="r")[rows]
            sig[a:b] = np.load(self.folder / f"{name}.sig.npy", mmap_mode="r")[rows]
        return ids, sig

    def all_ids(self) -> np.ndarray:
        """Every indexed prompt id (S32): for the backfill, which is rare."""
        return indexed_ids(self.folder, self.names)

    def nbytes(self) -> int:
        return sum(k.nbytes for run in self.runs for k in run) + self.starts.nbytes


def params_folder(workspace: Path, params: str) -> Path:
    return workspace / "data" / "minhash" / re.sub(r"[^A-Za-z0-9._-]", "_", params)


def indexed_ids(folder: Path, names: list[str]) -> np.ndarray:
    """The prompt ids (S32) of these segments, read from their id files alone."""
    parts = [np.load(folder / f"{name}.ids.npy") for name in names]
    return np.concatenate(parts) if parts else np.zeros(0, dtype="S32")


def write_segment(folder: Path, prompt_ids: list[str], sig: np.ndarray, keys: np.ndarray) -> str:
    """The segment's three files, fsynced; returns its name (unique across processes)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = uuid.uuid4().hex
    _save(folder / f"{name}.ids.npy", np.array(prompt_ids, dtype="S32"))
    _save(folder / f"{name}.sig.npy", np.ascontiguousarray(sig, dtype=np.uint32))
    _save(folder / f"{name}.keys.npy", fold_keys(keys))
    fsync_dir(folder)
    return name


def remove_unregistered_segments(folder: Path, registered: set[str]) -> list[Path]:
    removed = []
    if folder.exists():
        for p in folder.iterdir():
            if p.is_file() and p.name.split(".", 1)[0] not in registered:
                p.unlink()
                removed.append(p)
    if removed:
        fsync_dir(folder)
    return removed


class NearIndexStore:
    """The lineage store's side of the index: registry rows, segment writes, the cached index."""

    def __init__(self, db: DuckDBFile):
        self.db = db
        self._near_cache: dict[str, MinhashIndex] = {}  # by parameters key

    def load(self, params: str, num_perm: int, bands: int) -> MinhashIndex:
        """This parameters key's index, with every segment registered so far (by any process) loaded."""
        cache = self._near_cache
        folder = params_folder(self.db.path.parent, params)
        index = cache.get(params)
        if index is None:
            index = cache[params] = MinhashIndex(folder, num_perm, bands)
            if not self.db.path.exists():
                return index
            # First open in this process: under the writers' lock, files no transaction
            # registered are from a crashed writer and go.
            with self.db.write() as con:
                segments = self._segments(con, params)
                remove_unregistered_segments(folder, {name for name, _ in segments})
        elif not self.db.path.exists():
            return index
        else:
            with self.db.read() as con:
                segments = self._segments(con, params)
        index.load(segments)
        return index

    @staticmethod
    def _segments(con, params: str) -> list[tuple[str, int]]:
        return con.execute("SELECT name, rows FROM minhash_segments WHERE params = ? ORDER BY created_at, name",
                           [params]).fetchall()

    def insert_segment(self, con, params: str, prompt_ids: list[str], sig: np.ndarray, keys: np.ndarray) -> None:
        """Write and register one segment, inside the caller's transaction (so under the lock)."""
        if not prompt_ids:
            return
        name = write_segment(params_folder(self.db.path.parent, params), prompt_ids, sig, keys)
        con.execute("INSERT INTO minhash_segments VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    [params, name, len(prompt_ids), utc_now()])

    def backfill(self, params: str, prompt_ids: list[str], sig: np.ndarray, keys: np.ndarray) -> int:
        """Index stored prompts (the backfill); ones another process indexed meanwhile are left out."""
        with self.db.write() as con:
            index = self._near_cache.get(params) or MinhashIndex(
                params_folder(self.db.path.parent, params), sig.shape[1], keys.shape[1])
            self._near_cache[params] = index
            index.load(self._segments(con, params))
            fresh = ~np.isin(np.array(prompt_ids, dtype="S32"), index.all_ids())
            keep = np.flatnonzero(fresh)
            self.insert_segment(con, params, [prompt_ids[k] for k in keep], sig[keep], keys[keep])
        return len(keep)

    def prompts_not_indexed(self, params: str) -> tuple[list[str], list[list[dict]]]:
        """Stored (kept or held-out) prompts missing from the index under these parameters: after
        a parameter change, an upgrade from the old in-database index, or a run without near-dedupe."""
        if not self.db.path.exists():
            return [], []
        # A writer's open: it applies the migration that creates the registry to an old workspace.
        with self.db.write() as con:
            (n_prompts,), = con.execute("SELECT count(*) FROM prompts").fetchall()
            if not n_prompts:
                return [], []
            segments = self._segments(con, params)
            if sum(rows for _, rows in segments) >= n_prompts:  # one entry per prompt: complete
                return [], []
            ids = indexed_ids(params_folder(self.db.path.parent, params), [name for name, rows in segments if rows > 0])
            con.register("indexed", pa.table({"prompt_id": ids.astype(str)}))
            rows = con.execute("SELECT p.prompt_id, p.messages FROM prompts p ANTI JOIN indexed USING (prompt_id) "
                               "ORDER BY p.prompt_id").fetchall()
        return [r[0] for r in rows], [r[1] for r in rows]
