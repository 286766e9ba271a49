"""Exact dedupe's lookups, answered from memory: which prompt ids are stored, and where the texts
of earlier duplicate records lead.

Owns `ExactIndex` (stored prompt ids as sorted 16-byte keys in merged runs; the chain of every
duplicate record's text that is not itself stored) and `ExactIndexStore`, the lineage store's
side: the SQL that loads it and the check that it is current. Promises:
- `ExactIndexStore.matches` answers what `existing_prompt_ids` then `duplicate_chain_targets`
  answer over the store at that moment, whoever wrote it. The index is loaded once per process; each lookup
  first compares the store's row counts of `prompts` and `records` with the rows the index has
  accounted for (those tables are append-only), and loads it again when another writer (a
  process, or a write this process did not report) added rows.
- `batch_written` is told of each committed discover batch by its writer
  (`storage.discover.DiscoverRecords.write_batch`), so a process that is the store's only writer never reloads: at 10M records the two joins it replaces
  scanned every stored prompt and record for each batch.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pyarrow as pa

from storage.connection import DuckDBFile

_DUPLICATE = ("exact_duplicate", "near_duplicate")
_HEX_DIGITS = set("0123456789abcdef")
_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def id_keys(prompt_ids: list[str]) -> np.ndarray:
    """16-byte keys (S16) of prompt ids: a 32-hex-digit id (every id `prompt_id_of` makes) is its
    own 128 bits, so keys are equal exactly when ids are; any other id is hashed to 128 bits."""
    if prompt_ids and all(len(p) == 32 for p in prompt_ids):
        try:
            keys = _hex_keys(np.array(prompt_ids, dtype="S32").view(np.uint8).reshape(-1, 32))
        except UnicodeEncodeError:
            keys = None
        if keys is not None:
            return keys
    return np.array([_key(p) for p in prompt_ids], dtype="S16")


def _arrow_id_keys(ids: pa.Array) -> np.ndarray:
    """`id_keys` of an Arrow string column, read from its buffers when every id is 32 bytes."""
    ids = ids.cast(pa.string())
    if ids.null_count == 0 and len(ids):
        offsets = np.frombuffer(ids.buffers()[1], np.int32)[ids.offset : ids.offset + len(ids) + 1]
        if (np.diff(offsets) == 32).all():
            digits = np.frombuffer(ids.buffers()[2], np.uint8)[offsets[0] : offsets[-1]].reshape(-1, 32)
            keys = _hex_keys(digits)
            if keys is not None:
                return keys
    return id_keys(ids.to_pylist())


def _hex_keys(digits: np.ndarray) -> np.ndarray | None:
    """(n, 32) ASCII bytes of lower-case hex ids to their S16 keys; None if any is not one."""
    nibbles = _HEX[digits]
    if (nibbles == 255).any():
        return None
    return np.ascontiguousarray((nibbles[:, 0::2] << 4) | nibbles[:, 1::2]).view("S16").ravel()


def _is_hex_id(prompt_id: str) -> bool:
    return len(prompt_id) == 32 and set(prompt_id) <= _HEX_DIGITS  # lower case: "AB" is another id than "ab"


def _key(prompt_id: str) -> bytes:
    if _is_hex_id(prompt_id):
        return bytes.fromhex(prompt_id)
    return hashlib.blake2b(prompt_id.encode(), digest_size=16).digest()


# Keys per run at most: a merge copies no more than this (16 MB of keys), where merging the
# runs of 10M stored prompts into one copied 150 MB at once and took the 10M dedupe past 4 GB.
_MAX_RUN = 1 << 20


class _SortedKeys:
    """S16 keys, each with optional values, as sorted runs: a run is merged into the one before
    while that one is not more than twice its size and the two fit in `_MAX_RUN` keys, so adding
    a batch never re-sorts the whole set. A key added twice keeps the values it was added with first."""

    def __init__(self, *value_dtypes: np.dtype):
        self.value_dtypes = value_dtypes
        self.runs: list[tuple[np.ndarray, ...]] = []  # (keys sorted, *values in their order)

    def add(self, keys: np.ndarray, *values: np.ndarray) -> None:
        if not len(keys):
            return
        order = np.argsort(keys, kind="stable")
        self.runs.append((keys[order], *(v[order] for v in values)))
        while (len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0])
               and len(self.runs[-2][0]) + len(self.runs[-1][0]) <= _MAX_RUN):
            later, earlier = self.runs.pop(), self.runs.pop()
            order = np.argsort(np.concatenate((earlier[0], later[0])), kind="stable")  # earlier first among equals
            self.runs.append(tuple(np.concatenate((x, y))[order] for x, y in zip(earlier, later)))

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Which keys are present, and the values each was first added with."""
        found = np.zeros(len(keys), dtype=bool)
        values = tuple(np.zeros(len(keys), dtype=d) for d in self.value_dtypes)
        for run in self.runs:  # in the order added
            at = np.minimum(np.searchsorted(run[0], keys), len(run[0]) - 1)
            hit = (run[0][at] == keys) & ~found
            for out, v in zip(values, run[1:]):
                out[hit] = v[at[hit]]
            found |= hit
        return found, values

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.lookup(keys)[0]

    def __len__(self) -> int:
        return sum(len(r[0]) for r in self.runs)


def chain_rows(records: list[dict]) -> dict[str, tuple[str, float | None]]:
    """The chain each duplicate row of a batch starts, as `duplicate_chain_targets` reads it from
    the store: a duplicate naming another text; the first row for each text."""
    chains: dict[str, tuple[str, float | None]] = {}
    for r in records:
        if r["outcome"] in _DUPLICATE and r["duplicate_of"] is not None and r["duplicate_of"] != r["prompt_id"]:
            chains.setdefault(r["prompt_id"], (r["duplicate_of"], r["similarity"]))
    return chains


class ExactIndex:
    """What this process knows of the store for exact dedupe, and the row counts that knowledge covers."""

    def __init__(self, n_prompts: int, n_records: int):
        self.n_prompts, self.n_records = n_prompts, n_records
        self.stored = _SortedKeys()
        # Key of a prompt id (not stored) of an earlier duplicate record -> key of the stored prompt its
        # chain ends at, and the similarity (NaN: none). Keys, not strings: 36 bytes a chain, where a
        # dict of strings took 270 (120 MB for the 436K near duplicates of the 10M catalog).
        self.chains = _SortedKeys(np.dtype("S16"), np.dtype(np.float32))
        self.odd_targets: dict[bytes, str] = {}  # the ids of chain targets whose key is a hash

    def matches(self, prompt_ids: list[str]) -> tuple[set[str], dict[str, tuple[str, float | None]]]:
        if not prompt_ids:
            return set(), {}
        keys = id_keys(prompt_ids)
        hit = self.stored.contains(keys)
        stored = {p for p, h in zip(prompt_ids, hit) if h}
        found, (targets, sims) = self.chains.lookup(keys)
        earlier = {}
        for k in np.flatnonzero(found & ~hit):
            target = targets[k].ljust(16, b"\0")  # numpy drops trailing zero bytes
            sim = float(sims[k])
            earlier[prompt_ids[k]] = (self.odd_targets.get(target) or target.hex(), None if sim != sim else sim)
        return stored, earlier

    def add_chains(self, chains: dict[str, tuple[str, float | None]]) -> None:
        if not chains:
            return
        targets = [t for t, _ in chains.values()]
        target_keys = id_keys(targets)
        for t, k in zip(targets, target_keys.tolist()):
            if not _is_hex_id(t):
                self.odd_targets[k.ljust(16, b"\0")] = t
        sims = np.array([np.nan if s is None else s for _, s in chains.values()], dtype=np.float32)
        self.chains.add(id_keys(list(chains)), target_keys, sims)

    def add_batch(self, prompt_ids: list[str], records: list[dict], n_records: int) -> bool:
        """A committed batch: the prompts it inserted, its outcome rows, how many of those it inserted.

        False when the index cannot account for it and the caller drops it: some rows were already
        stored (a replay), or a duplicate names a prompt that is not stored (rows as old code wrote
        them, whose chain is the store's to follow).
        """
        if n_records != len(records):
            return False
        self.stored.add(id_keys(prompt_ids))
        self.n_prompts += len(prompt_ids)
        self.n_records += n_records
        chains = chain_rows(records)
        if chains and not self.stored.contains(id_keys([t for t, _ in chains.values()])).all():
            return False
        self.add_chains(chains)
        return True


class ExactIndexStore:
    """The lineage store's side of the exact index: loading it, and checking it is current."""

    def __init__(self, db: DuckDBFile):
        self.db = db
        self._cache: ExactIndex | None = None
        # discover's writer thread reports each batch it committed; lookups run on another thread.
        self._mutex = threading.Lock()

    def matches(self, prompt_ids: list[str]) -> tuple[set[str], dict[str, tuple[str, float | None]]]:
        """(the ids stored as prompts, the others' duplicate-chain targets), from the in-memory index."""
        with self._mutex:
            if not self.db.path.exists():  # an empty store: the first write's batch is added after it
                self._cache = self._cache or ExactIndex(0, 0)
                return self._cache.matches(prompt_ids)
            index = self._cache
            with self.db.read() as con:
                counts = _row_counts(con)
                if index is None or (index.n_prompts, index.n_records) != counts:
                    index = self._cache = self._load_exact(con, counts)
            return index.matches(prompt_ids)

    def batch_written(self, prompt_ids: list[str], records: list[dict], n_records: int) -> None:
        """Called by the writer after a discover batch committed: `prompt_ids` and `n_records` are
        the prompts and outcome rows its transaction inserted."""
        with self._mutex:
            if self._cache is not None and not self._cache.add_batch(prompt_ids, records, n_records):
                self._cache = None

    def _load_exact(self, con, counts: tuple[int, int]) -> ExactIndex:
        index = ExactIndex(*counts)
        # In batches of a million: a 10M-prompt store never holds its ids as Python strings.
        for batch in con.sql("SELECT prompt_id FROM prompts").to_arrow_reader(1_000_000):
            index.stored.add(_arrow_id_keys(batch.column(0)))
        starts = [p for (p,) in con.execute(
            "SELECT DISTINCT r.prompt_id FROM records r ANTI JOIN prompts p USING (prompt_id) "
            f"WHERE r.outcome IN {_DUPLICATE} AND r.duplicate_of IS NOT NULL AND r.duplicate_of <> r.prompt_id"
        ).fetchall()]
        index.add_chains(_chain_targets(con, starts))
        return index

    def existing_prompt_ids(self, prompt_ids: list[str]) -> set[str]:
        """The ids stored as prompts, asked of the store itself."""
        return self.db.stored_ids("prompts", "prompt_id", prompt_ids)

    def duplicate_chain_targets(self, prompt_ids: list[str]) -> dict[str, tuple[str, float | None]]:
        """Prompt ids (not stored as prompts) that earlier records were duplicates with, mapped to the
        stored kept prompt their chain ends at and the similarity recorded on the way, asked of the store.

        Follows `duplicate_of` through earlier duplicate records until it reaches a stored prompt, so
        rows written before chains were resolved at decision time still lead to a kept prompt. An id
        whose chain ends nowhere is left out: its record then goes through near-dedupe as new.
        """
        if not prompt_ids or not self.db.path.exists():
            return {}
        with self.db.read() as con:
            return _chain_targets(con, prompt_ids)


def _row_counts(con) -> tuple[int, int]:
    (n_prompts, n_records), = con.execute(
        "SELECT (SELECT count(*) FROM prompts), (SELECT count(*) FROM records)").fetchall()
    return n_prompts, n_records


def _chain_targets(con, prompt_ids: list[str]) -> dict[str, tuple[str, float | None]]:
    resolved: dict[str, tuple[str, float | None]] = {}
    # start id -> (id reached, lowest similarity on the way); one step a round, cycles cut at 32.
    frontier = {p: (p, None) for p in prompt_ids}
    for _ in range(32):
        if not frontier:
            break
        con.register("ids_in", pa.table({"prompt_id": sorted({cur for cur, _ in frontier.values()})}))
        rows = con.execute(
            "SELECT r.prompt_id, r.duplicate_of, r.similarity, p.prompt_id IS NOT NULL FROM records r "
            "JOIN ids_in USING (prompt_id) LEFT JOIN prompts p ON p.prompt_id = r.duplicate_of "
            f"WHERE r.outcome IN {_DUPLICATE} AND r.duplicate_of IS NOT NULL "
            "AND r.duplicate_of <> r.prompt_id "
            "ORDER BY r.recorded_at, r.source, r.record_key"
        ).fetchall()
        con.unregister("ids_in")
        step: dict[str, tuple[str, float | None, bool]] = {}
        for pid, dup, sim, is_kept in rows:
            if pid not in step or (is_kept and not step[pid][2]):  # the first, or the first to a kept prompt
                step[pid] = (dup, sim, bool(is_kept))
        nxt = {}
        for start, (cur, sim) in frontier.items():
            if cur not in step:
                continue
            dup, s, is_kept = step[cur]
            sim = s if sim is None else sim if s is None else min(sim, s)
            if is_kept:
                resolved[start] = (dup, sim)
            else:
                nxt[start] = (dup, sim)
        frontier = nxt
    return resolved
