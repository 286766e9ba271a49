"""Deciding each record's outcome in discover: quarantined, contaminated, duplicate, kept or held out.

Owns the order of the checks and the rows they produce. Promises: every record passed in gets
exactly one outcome row, so records in = kept + heldout + exact + near + contaminated + quarantined.

The order, and why:
1. quarantined: the record is unreadable or is not a usable conversation (tasks.discover.prompts).
2. contaminated: its system/user text shares an n-gram with an eval item. Checked before dedupe
   so a contaminated prompt never becomes the kept copy that others are duplicates of.
3. exact_duplicate: its prompt id (hash of the canonical text) is already stored, was seen in an
   earlier batch, or appeared earlier in the batch.
4. near_duplicate: MinHash/LSH finds an earlier kept prompt (stored or in this batch) at or above
   the Jaccard threshold; `duplicate_of` names the kept prompt heading its cluster.
5. heldout: a prompt that would be kept, chosen for the held-out chat set by a hash of its id
   (tasks.evaluate.heldout; only when a split is configured). Stored like a kept prompt, so later
   duplicates of it are duplicates, but never regenerated or trained on.
6. kept.

`duplicate_of` always names a kept (or held-out) prompt (kept in this batch, or stored, and stored
prompts are only ever kept or held-out ones), never a prompt that was itself a duplicate: chains are resolved here, when
the outcome is decided. So an exact twin of a record that turned out a near duplicate (in this
batch or an earlier one) names the kept prompt its twin duplicates, with its twin's similarity;
its own `prompt_id` still says which text it is. The outcome stays `exact_duplicate` (its text was
seen before), so how many records are exact duplicates does not depend on the order they came in.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from storage.lineage import LineageStore
from tasks.config import HeldoutConfig, NearDedupeConfig
from tasks.discover.decontaminate import NgramIndex
from tasks.discover.dedupe import band_keys, cluster, lsh_params, signatures
from tasks.evaluate.heldout import choose_heldout, split_key
from tasks.discover.prompts import Prompt, Quarantine, normalise_record, prompt_text
from tasks.discover.sources import RawRecord


def minhash_params_key(cfg: NearDedupeConfig) -> str:
    """Identifies how signatures and band keys were made; stored beside them."""
    bands, rows = lsh_params(cfg.threshold, cfg.num_perm)
    return f"oph1:{cfg.shingle}{cfg.ngram}:p{cfg.num_perm}:b{bands}x{rows}"


@dataclass
class DiscoverBatch:
    records: list[dict]
    prompts: list[dict]
    minhash: tuple[str, list[str], np.ndarray, np.ndarray] | None

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r["outcome"]] = out.get(r["outcome"], 0) + 1
        return out


def _row(rec: RawRecord, outcome: str, prompt: Prompt | None = None, **extra) -> dict:
    return {
        "source": rec.source,
        "record_key": rec.record_key,
        "native_id": prompt.native_id if prompt else None,
        "outcome": outcome,
        "reason": extra.get("reason"),
        "prompt_id": prompt.prompt_id if prompt else None,
        "duplicate_of": extra.get("duplicate_of"),
        "eval_item": extra.get("eval_item"),
        "similarity": extra.get("similarity"),
    }


def _prior_candidates(store: LineageStore, params: str, keys: np.ndarray, num_perm: int):
    """Stored prompts sharing an LSH bucket with batch texts: ((batch index, prior index) pairs,
    their signatures, their ids sorted), read from the near-dedupe index."""
    index = store.near_index.load(params, num_perm, keys.shape[1])
    idx, entries = index.candidates(keys)
    if not len(idx):
        return None, None, []
    entries_u, entry_pos = np.unique(entries, return_inverse=True)
    ids, sig = index.fetch(entries_u)
    # Prior prompts numbered in prompt id order, one number per prompt even if indexed twice.
    ids_u, first, id_pos = np.unique(ids, return_index=True, return_inverse=True)
    m = len(ids_u)
    code = np.unique(idx * m + id_pos[entry_pos])
    return (code // m, code % m), sig[first], [p.decode() for p in ids_u]


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a batch makes ~10 containers per record, and each
    collection walks every object the process holds (a source's records, the catalog). At 1M+
    records that was a third of deciding, growing with the store; a batch's rows free themselves
    by reference counting, and any cycle waits for the next collection after the batch."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def decide_outcomes(
    records: list[RawRecord],
    formats: dict[str, tuple[str, str, str]],
    store: LineageStore,
    near: NearDedupeConfig,
    contamination: NgramIndex | None,
    heldout: HeldoutConfig | None = None,
) -> DiscoverBatch:
    """Outcome rows, kept (and held-out) prompt rows and MinHash index rows for one batch of new records.

    `formats` maps a source name to (format, prompt_field, response_field). `heldout`: the held-out
    split; its cap counts the held-out prompts already stored.
    """
    with gc_paused():
        return resolve_batch(prepare_batch(records, formats, near, contamination), store, near, heldout)


@dataclass
class PreparedBatch:
    """A batch's work that needs no store: quarantined and contaminated rows decided, the other
    records normalised, and each text's first record in the batch signed for near dedupe."""
    records: list[RawRecord]
    rows: list[dict | None]
    candidates: list[tuple[int, Prompt]]
    signed: dict[str, int]  # prompt id -> its row in `sig` and `keys`
    sig: np.ndarray | None
    keys: np.ndarray | None  # LSH band keys of `sig`


def prepare_batch(records: list[RawRecord], formats: dict[str, tuple[str, str, str]], near: NearDedupeConfig,
                  contamination: NgramIndex | None) -> PreparedBatch:
    """Steps 1-2 of the order, and MinHash signatures for step 4: nothing here reads the store, so
    it can run while the previous batch is written (`decide_and_write`)."""
    rows: list[dict | None] = [None] * len(records)
    candidates: list[tuple[int, Prompt]] = []
    for i, rec in enumerate(records):
        fmt, pf, rf = formats[rec.source]
        result = Quarantine(rec.error) if rec.error else normalise_record(rec.data, fmt, pf, rf)
        if isinstance(result, Quarantine):
            rows[i] = _row(rec, "quarantined", reason=result.reason)
        else:
            candidates.append((i, result))

    if contamination is not None and candidates:
        matches = contamination.first_match([p.text for _, p in candidates])
        clean = []
        for (i, p), item in zip(candidates, matches):
            if item is None:
                clean.append((i, p))
            else:
                rows[i] = _row(records[i], "contaminated", p, eval_item=item,
                               reason=f"shares a {contamination.ngram}-gram with {item}")
        candidates = clean

    signed: dict[str, int] = {}
    sig = keys = None
    if near.enabled:
        # A signature depends on its own text only, so signing every text's first record now gives
        # the signatures of exactly those step 3 leaves for step 4, whatever the store holds.
        texts = []
        for _, p in candidates:
            if p.prompt_id not in signed:
                signed[p.prompt_id] = len(texts)
                texts.append(p.text)
        if texts:
            sig = signatures(texts, near.num_perm, near.ngram, near.shingle)
            keys = band_keys(sig, *lsh_params(near.threshold, near.num_perm))
    return PreparedBatch(records, rows, candidates, signed, sig, keys)


def resolve_batch(prepared: PreparedBatch, store: LineageStore, near: NearDedupeConfig,
                  heldout: HeldoutConfig | None) -> DiscoverBatch:
    """Steps 3-6 of the order: everything that depends on what the store already holds."""
    records, rows, candidates = prepared.records, prepared.rows, prepared.candidates
    batch_ids = sorted({p.prompt_id for _, p in candidates})
    stored, earlier = store.exact_index.matches(batch_ids)
    first_seen: set[str] = set()
    unique: list[tuple[int, Prompt]] = []
    twins: list[tuple[int, Prompt]] = []  # exact duplicates of an earlier record of this batch
    for i, p in candidates:
        if p.prompt_id in stored:
            rows[i] = _row(records[i], "exact_duplicate", p, duplicate_of=p.prompt_id,
                           reason="same canonical text as a stored prompt")
        elif p.prompt_id in earlier:
            target, sim = earlier[p.prompt_id]
            rows[i] = _row(records[i], "exact_duplicate", p, duplicate_of=target, similarity=sim,
                           reason="same canonical text as a record of an earlier batch, itself a "
                                  "duplicate of a stored prompt")
        elif p.prompt_id in first_seen:
            twins.append((i, p))
        else:
            first_seen.add(p.prompt_id)
            unique.append((i, p))

    # prompt id of a near duplicate of this batch -> (kept prompt it names, similarity, where that is)
    near_of: dict[str, tuple[str, float, str]] = {}
    kept_targets = set(stored) | {t for t, _ in earlier.values()}
    minhash = None
    if near.enabled and unique:
        params = minhash_params_key(near)
        rows_of = [prepared.signed[p.prompt_id] for _, p in unique]
        sig, keys = prepared.sig[rows_of], prepared.keys[rows_of]
        prior_pairs, prior_sig, prior_ids = _prior_candidates(store, params, keys, near.num_perm)
        result = cluster(sig, keys, near.threshold, prior_pairs, prior_sig)
        n = len(unique)
        kept_pos = []
        for k, (i, p) in enumerate(unique):
            d = int(result.duplicate_of[k])
            if d < 0:
                kept_pos.append(k)
                continue
            # `cluster` roots every cluster at its earliest member, which is never a duplicate:
            # a stored (kept) prompt, or a batch text kept below.
            target = prior_ids[d - n] if d >= n else unique[d][1].prompt_id
            if d >= n:
                kept_targets.add(target)
            where = "a stored prompt" if d >= n else "an earlier record of this batch"
            near_of[p.prompt_id] = (target, float(result.similarity[k]), where)
            rows[i] = _row(records[i], "near_duplicate", p, duplicate_of=target,
                           similarity=float(result.similarity[k]),
                           reason=f"estimated Jaccard {result.similarity[k]:.2f} with {where}")
        kept = [unique[k] for k in kept_pos]
        minhash = (params, [p.prompt_id for _, p in kept], sig[kept_pos], keys[kept_pos])
    else:
        kept = unique

    for i, p in twins:
        if p.prompt_id in near_of:  # its twin is a near duplicate: name the kept prompt it names
            target, sim, where = near_of[p.prompt_id]
            rows[i] = _row(records[i], "exact_duplicate", p, duplicate_of=target, similarity=sim,
                           reason=f"same canonical text as an earlier record of this batch, itself a near "
                                  f"duplicate (estimated Jaccard {sim:.2f}) of {where}")
        else:
            rows[i] = _row(records[i], "exact_duplicate", p, duplicate_of=p.prompt_id,
                           reason="same canonical text as an earlier record of this batch")

    held: set[str] = set()
    if heldout is not None and heldout.fraction > 0 and kept:
        room = heldout.cap - store.discover.heldout_count()
        held = set(choose_heldout([p.prompt_id for _, p in kept], heldout.fraction, room))
    prompts = []
    for i, p in kept:
        note = f"dropped {p.dropped_leading_assistant} assistant turn(s) before the first user turn" if p.dropped_leading_assistant else None
        if p.prompt_id in held:
            why = f"held out for evaluation (split key {split_key(p.prompt_id):.4f} < {heldout.fraction})"
            rows[i] = _row(records[i], "heldout", p, reason=f"{why}; {note}" if note else why)
        else:
            rows[i] = _row(records[i], "kept", p, reason=note)
        prompts.append({
            "prompt_id": p.prompt_id,
            "messages": p.messages,
            "n_turns": len(p.messages),
            "chars": sum(len(m["content"]) for m in p.messages),
            "source": records[i].source,
            "record_key": records[i].record_key,
            "format": p.format,
        })
    assert all(r is not None for r in rows), "every record gets an outcome"
    kept_targets.update(p.prompt_id for _, p in kept)
    assert all(r["duplicate_of"] in kept_targets for r in rows if r["duplicate_of"] is not None), \
        "every duplicate names a kept prompt"
    return DiscoverBatch(rows, prompts, minhash)


def decide_and_write(
    chunks: Iterable[list[RawRecord]],
    run_id: str,
    formats: dict[str, tuple[str, str, str]],
    store: LineageStore,
    near: NearDedupeConfig,
    contamination: NgramIndex | None,
    heldout: HeldoutConfig | None = None,
    on_written: Callable[[DiscoverBatch], None] | None = None,
    phase_seconds: dict[str, float] | None = None,
) -> None:
    """Each chunk decided and written as one batch, in order; `on_written(batch)` once it has committed;
    given `phase_seconds`, the wall seconds of each phase (`prepare`, `resolve`, `write`) are added to it
    (benchmarks/rehearsals/dedupe_catalog.py times the driver's phases where it calls them).

    The outcomes are those of `decide_outcomes` then `write_discover_batch`, batch after batch: a
    batch is resolved against the store only once the previous batch has committed, and each write
    is one transaction, so a crash loses no committed batch and a rerun continues after it. What
    overlaps is the next batch's store-free preparation with that write, which spends most of its
    time in DuckDB, off the GIL: at 10M records the write is 40% of the time, and two cores do both.
    """
    with gc_paused(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="discover-write") as writer:
        pending: tuple[DiscoverBatch, Future] | None = None
        for chunk in chunks:
            prepared = _timed(phase_seconds, "prepare", prepare_batch)(chunk, formats, near, contamination)
            if pending is not None:
                _committed(pending, on_written)
            batch = _timed(phase_seconds, "resolve", resolve_batch)(prepared, store, near, heldout)
            write = _timed(phase_seconds, "write", store.discover.write_batch)
            pending = (batch, writer.submit(write, run_id, batch.records, batch.prompts, batch.minhash))
        if pending is not None:
            _committed(pending, on_written)


def _timed(seconds: dict[str, float] | None, phase: str, fn: Callable) -> Callable:
    """`fn` itself, or, when a caller asked for the phases' seconds, `fn` adding its wall time to `seconds[phase]`."""
    if seconds is None:
        return fn

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t0
    return call


def _committed(pending: tuple[DiscoverBatch, Future], on_written: Callable[[DiscoverBatch], None] | None) -> None:
    batch, write = pending
    write.result()  # a failed write raises here, before anything is resolved against a store without it
    if on_written is not None:
        on_written(batch)


def backfill_signatures(store: LineageStore, near: NearDedupeConfig) -> int:
    """Index stored prompts the near-dedupe index lacks under the current parameters (after a
    change of parameters, or an upgrade from the in-database index)."""
    params = minhash_params_key(near)
    ids, messages = store.near_index.prompts_not_indexed(params)
    if not ids:
        return 0
    bands, band_rows = lsh_params(near.threshold, near.num_perm)
    sig = signatures([prompt_text(m) for m in messages], near.num_perm, near.ngram, near.shingle)
    return store.near_index.backfill(params, ids, sig, band_keys(sig, bands, band_rows))
