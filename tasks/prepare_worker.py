"""Discover's store-free preparation (`tasks.outcomes.prepare_batch`) in a second process.

Owns what crosses the process boundary. A batch's records go to the worker as four lists; its
prepared form comes back flattened into lists of strings and numpy arrays, and the parent
rebuilds the Prompts and message dicts. Promises: `unflatten(flatten(p), p.records)` equals `p`,
so a batch prepared in the worker is resolved exactly as one prepared here.

Why a process: deciding outcomes is Python under one GIL. In one process, preparing (normalise,
hash, sign: ~25 us a record) competes for it with resolving and with the write's Python, and the
10M-record dedupe kept 1.24 of 2 cores busy. Why flattened: pickling 100K Prompts with their
message dicts costs the parent ~1 s a batch to load, about what the worker saves it; flat lists
of strings load in ~20 ms and are rebuilt in ~0.2 s.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import numpy as np

from tasks.config import NearDedupeConfig
from tasks.decontaminate import NgramIndex
from tasks.outcomes import PreparedBatch, gc_paused, prepare_batch
from tasks.prompts import Prompt
from tasks.sources import RawRecord


@dataclass
class FlatPrepared:
    """A PreparedBatch without its records, in types that pickle fast."""
    decided: list[tuple[int, dict]]  # (record index, its row) for quarantined and contaminated records
    index: np.ndarray  # candidate -> its record index
    prompt_ids: list[str]
    formats: list[str]
    native_ids: list[str | None]
    dropped: list[int]
    turns: list[int]  # messages per candidate
    roles: list[str]  # every candidate's messages, one after another
    contents: list[str]
    signed: list[str]  # prompt ids in the order of `sig` rows
    sig: np.ndarray | None
    keys: np.ndarray | None


def flatten(prepared: PreparedBatch) -> FlatPrepared:
    cands = prepared.candidates
    return FlatPrepared(
        decided=[(i, row) for i, row in enumerate(prepared.rows) if row is not None],
        index=np.fromiter((i for i, _ in cands), dtype=np.int64, count=len(cands)),
        prompt_ids=[p.prompt_id for _, p in cands],
        formats=[p.format for _, p in cands],
        native_ids=[p.native_id for _, p in cands],
        dropped=[p.dropped_leading_assistant for _, p in cands],
        turns=[len(p.messages) for _, p in cands],
        roles=[m["role"] for _, p in cands for m in p.messages],
        contents=[m["content"] for _, p in cands for m in p.messages],
        signed=list(prepared.signed),
        sig=prepared.sig,
        keys=prepared.keys,
    )


def unflatten(flat: FlatPrepared, records: list[RawRecord]) -> PreparedBatch:
    rows: list[dict | None] = [None] * len(records)
    for i, row in flat.decided:
        rows[i] = row
    roles, contents = flat.roles, flat.contents
    candidates = []
    at = 0
    for i, pid, fmt, native, dropped, n in zip(flat.index.tolist(), flat.prompt_ids, flat.formats, flat.native_ids,
                                               flat.dropped, flat.turns):
        if n == 1:  # most prompts: one user turn
            messages = [{"role": roles[at], "content": contents[at]}]
        else:
            messages = [{"role": roles[k], "content": contents[k]} for k in range(at, at + n)]
        at += n
        candidates.append((i, Prompt(pid, messages, fmt, native, dropped)))
    signed = {pid: k for k, pid in enumerate(flat.signed)}
    return PreparedBatch(records, rows, candidates, signed, flat.sig, flat.keys)


# ---------------------------------------------------------------- the worker's side

_SETTINGS: tuple[dict[str, tuple[str, str, str]], NearDedupeConfig, NgramIndex | None] | None = None


def _start(formats: dict[str, tuple[str, str, str]], near: NearDedupeConfig, contamination: NgramIndex | None) -> None:
    global _SETTINGS
    _SETTINGS = (formats, near, contamination)


def _prepare(sources: list[str], keys: list[str], data: list[dict | None], errors: list[str | None]) -> FlatPrepared:
    records = [RawRecord(s, k, d, e) for s, k, d, e in zip(sources, keys, data, errors)]
    with gc_paused():
        return flatten(prepare_batch(records, *_SETTINGS))


class PrepareWorker:
    """One worker process preparing batches in the order they are submitted.

    Started with `spawn`: the parent holds DuckDB and Prefect threads, and a forked child could
    inherit one of their locks held. The settings (the contamination index among them) cross once.
    """

    def __init__(self, formats: dict[str, tuple[str, str, str]], near: NearDedupeConfig,
                 contamination: NgramIndex | None):
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start, initargs=(formats, near, contamination))

    def submit(self, records: list[RawRecord]) -> Future[FlatPrepared]:
        return self._pool.submit(_prepare, [r.source for r in records], [r.record_key for r in records],
                                 [r.data for r in records], [r.error for r in records])

    def __enter__(self) -> PrepareWorker:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        # On an error, batches still queued are not prepared for nothing.
        self._pool.shutdown(wait=True, cancel_futures=kind is not None)
