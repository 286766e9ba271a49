"""Filling the disk budget: shards of the next pending samples, planned, extracted and committed in order.

Owns the extract stage's in-stage loop (the rounds of extract -> train around it are tasks/rounds.py's):
tokenised samples queue up, `plan_shard` (tasks/extract/plan.py) takes the longest head that fits the
shard size and the room left, a job extracts and writes it (tasks/extract/shard_job.py, in this
process or on a worker) and this process commits each shard with every sample's outcome.
Promises: a shard's predicted bytes are reserved against the budget before it is submitted, so the
budget holds with shards in flight; shards are committed in the order they were planned (their
sequence numbers restart from the highest committed one after a crash); each sample is committed
once, as extracted, quarantined or skipped, in the same transaction as its shard; the run stops
*before* extracting a shard that would not fit (`stopped_by="budget"`).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from storage.shards import ShardStore
from tasks.extract.chat import Sample, Tokenised
from tasks.extract.draft_vocab import READ_CHUNK, StageContext
from tasks.extract.hf_backend import Extractor, ExtractSettings
from tasks.extract.plan import plan_shard
from tasks.extract.shard_job import ShardJob, ShardOutcome, run_shard_job
from tasks.extract.vocab import TokenCounter
from tasks.ids import sample_id


@dataclass
class ExtractSummary:
    """What an extract run did: the flow's result, filled by the flow and `fill_budget`."""

    run_id: str
    extract_key: str = ""
    vocab_id: str = ""
    vocab_coverage: float = 0.0  # of the tokens the vocab was built from
    vocab_expected_coverage: float | None = None  # of tokens it was not chosen from (tasks.extract.vocab.split_half_coverage)
    extracted_vocab_coverage: float | None = None  # of the loss-masked tokens this run extracted
    vocab_warning: str | None = None  # tasks.extract.vocab.vocab_drift_warning: this run's tokens covered worse than its own
    aux_layer_ids: list[int] = field(default_factory=list)
    pending_at_start: int = 0
    shards_written: int = 0
    extracted: int = 0
    quarantined: int = 0
    skipped: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    truncated_tokens: int = 0
    bytes_written: int = 0
    disk_used_bytes: int = 0
    disk_budget_bytes: int = 0
    peak_disk_bytes: int = 0
    stopped_by: str = "done"  # done | budget | limit
    ids_checked: int = 0
    ids_mismatched: int = 0
    first_mismatch: dict | None = None
    removed_leftovers: int = 0
    seconds: float = 0.0
    reasons: list = field(default_factory=list)
    workers: int = 1
    target_dtype: str = ""  # what the target computed in (`target.dtype: auto` depends on the machine)
    worker_pids: list[int] = field(default_factory=list)  # the processes that extracted this run's shards


def sample_row(sid: str, gid: str, ekey: str, t: Tokenised, outcome: str, reason: str | None = None,
               shard: str | None = None, index: int | None = None) -> dict:
    """A sample's lineage row: its outcome (extracted, quarantined, skipped), sizes and id check."""
    r = t.result
    sample = r if isinstance(r, Sample) else None
    return {
        "sample_id": sid, "generation_id": gid, "extract_key": ekey, "outcome": outcome,
        "reason": reason if reason is not None else (None if sample else r.reason),  # type: ignore[union-attr]
        "tokens": sample.num_tokens if sample else getattr(r, "num_tokens", None),
        "masked_tokens": sample.num_masked if sample else None,
        "truncated_tokens": sample.truncated_tokens if sample else None,
        "id_check": t.id_check,
        "id_mismatch": json.dumps(asdict(t.mismatch)) if t.mismatch else None,
        "shard": shard, "shard_index": index,
    }


# A submit function: it takes a planned shard and returns a function that waits for its outcome.
Submit = Callable[[ShardJob], Callable[[], ShardOutcome]]


@contextmanager
def in_process(extractor: Extractor, shards: ShardStore) -> Iterator[Submit]:
    """Jobs run here, at submission (one worker, or the vLLM backend's server)."""
    def submit(job: ShardJob) -> Callable[[], ShardOutcome]:
        outcome = run_shard_job(extractor, shards, job)
        return lambda: outcome
    yield submit


@dataclass
class _InFlight:
    job: ShardJob
    taken: list[tuple[str, str, Tokenised]]  # (sample id, generation id, tokenised), in job order
    reserved: int  # predicted bytes: counted against the budget until the shard is committed
    wait: Callable[[], ShardOutcome]


def fill_budget(ctx: StageContext, pending: list[tuple[str, str, str]], ekey: str, settings: ExtractSettings,
                hidden_size: int, submit: Submit, max_in_flight: int, shards: ShardStore, summary: ExtractSummary,
                extracted_tokens: TokenCounter, logger, progress: Callable[[float], None] | None = None) -> None:
    """Shards of the pending samples, in order, until they are all extracted or the next does not fit the budget.

    Each shard is planned here, submitted (`submit`: in this process, on vLLM or on workers) with its
    predicted bytes reserved against the budget, and committed oldest first; `progress` gets the
    percent of `pending` done.
    """
    store, cfg = ctx.store, ctx.config
    seq = store.extraction.last_shard_seq()
    queue: list[tuple[str, str, Tokenised]] = []  # (sample id, generation id, tokenised) awaiting a shard
    no_shard_rows: list[dict] = []  # skipped samples: recorded with the next commit
    in_flight: deque[_InFlight] = deque()  # submitted, not yet committed; committed oldest first
    # Bytes on disk of shards not in flight. Refreshed from the folder whenever nothing is in flight;
    # while jobs are, their files (whole or partly written) are covered by their reservations instead.
    settled = 0
    pids: set[int] = set()
    done = tokens = 0
    started = time.monotonic()
    with Progress(TextColumn("extract"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeRemainingColumn(), transient=True) as bar:
        job_bar = bar.add_task("extract", total=len(pending), rate="")

        def commit_oldest() -> None:
            # In planning order: sequence numbers restart from the highest committed one after a crash,
            # so a later shard committed before an earlier one could collide with a name reused then.
            nonlocal no_shard_rows, settled, done, tokens
            f = in_flight.popleft()
            outcome = f.wait()
            n_tokens = _commit(ctx, f, outcome, ekey, no_shard_rows, summary)
            no_shard_rows = []
            settled += outcome.shard.bytes if outcome.shard else 0
            pids.add(outcome.pid)
            summary.peak_disk_bytes = max(summary.peak_disk_bytes, shards.used_bytes())
            done += len(f.taken)
            tokens += n_tokens
            rate = tokens / max(time.monotonic() - started, 1e-6)
            bar.update(job_bar, completed=done, rate=f"{rate:,.0f} tok/s, {shards.used_bytes() / 2**20:,.1f} MiB")
            if progress is not None:
                progress(100.0 * done / len(pending))

        for start in range(0, len(pending) + 1, READ_CHUNK):
            chunk = pending[start:start + READ_CHUNK]
            for (gid, _, _), t in zip(chunk, ctx.tokenise(chunk) if chunk else []):
                sid = sample_id(gid, ekey)
                if isinstance(t.result, Sample):
                    queue.append((sid, gid, t))
                else:
                    no_shard_rows.append(sample_row(sid, gid, ekey, t, "skipped"))
            exhausted = start + READ_CHUNK >= len(pending)
            while queue:
                if not in_flight:
                    settled = shards.used_bytes()
                lengths = [t.result.num_tokens for _, _, t in queue]  # type: ignore[union-attr]
                room = cfg.disk_budget_bytes - settled - sum(f.reserved for f in in_flight)
                plan = plan_shard(lengths, [s for s, _, _ in queue], ekey, settings, hidden_size, cfg.shard_bytes, room)
                if plan.count == 0:
                    if in_flight:
                        commit_oldest()  # a committed shard frees its reservation (quarantine makes it smaller)
                        continue
                    summary.stopped_by = "budget"
                    logger.info("disk budget reached: %d B used of %d B, the next shard needs %d B; "
                                "train on (and delete) the written shards, then extract again",
                                shards.used_bytes(), cfg.disk_budget_bytes, plan.predicted_bytes)
                    break
                if plan.count == len(queue) and not exhausted:
                    break  # a fuller shard is possible once the next chunk is tokenised
                taken, queue = queue[:plan.count], queue[plan.count:]
                for _, _, t in taken:  # what the vocab must cover: tasks.extract.vocab.vocab_drift_warning
                    extracted_tokens.add(t.result.input_ids, t.result.loss_mask)  # type: ignore[union-attr]
                seq += 1
                job = ShardJob(name=f"{ekey[:8]}-{seq:06d}.safetensors", extract_key=ekey, settings=settings,
                               sample_ids=[s for s, _, _ in taken],
                               samples=[(t.result.input_ids, t.result.loss_mask) for _, _, t in taken])  # type: ignore[union-attr]
                in_flight.append(_InFlight(job, taken, plan.predicted_bytes, submit(job)))
                while len(in_flight) >= max_in_flight:
                    commit_oldest()
            if summary.stopped_by == "budget" or exhausted:
                break
        while in_flight:
            commit_oldest()
        if no_shard_rows:
            store.extraction.write_batch(summary.run_id, None, no_shard_rows)
    summary.worker_pids = sorted(pids)
    if summary.stopped_by == "done" and cfg.limit is not None and len(pending) == cfg.limit:
        summary.stopped_by = "limit"


def _commit(ctx: StageContext, f: _InFlight, outcome: ShardOutcome, ekey: str, extra_rows: list[dict],
            summary: ExtractSummary) -> int:
    """Commit one written shard with every sample's outcome (and `extra_rows`); its tokens."""
    expected_kept = [i for i, r in enumerate(outcome.reasons) if r is None]
    if outcome.name != f.job.name or len(outcome.reasons) != len(f.taken) or outcome.kept != expected_kept:
        raise RuntimeError(f"shard {f.job.name}: the job's outcome does not match its samples")
    shard_row = None
    if outcome.shard is not None:
        kept_samples = [f.taken[i][2].result for i in outcome.kept]
        shard_row = {"shard": outcome.name, "extract_key": ekey, "bytes": outcome.shard.bytes,
                     "sha256": outcome.shard.sha256, "samples": len(outcome.kept),
                     "tokens": sum(s.num_tokens for s in kept_samples),  # type: ignore[union-attr]
                     "masked_tokens": sum(s.num_masked for s in kept_samples)}  # type: ignore[union-attr]
        summary.shards_written += 1
        summary.bytes_written += outcome.shard.bytes
    slot = {i: j for j, i in enumerate(outcome.kept)}
    rows = list(extra_rows)
    for i, ((sid, gid, t), reason) in enumerate(zip(f.taken, outcome.reasons)):
        if reason is None:
            rows.append(sample_row(sid, gid, ekey, t, "extracted", shard=outcome.name, index=slot[i]))
        else:
            rows.append(sample_row(sid, gid, ekey, t, "quarantined", reason=reason))
    ctx.store.extraction.write_batch(summary.run_id, shard_row, rows)
    return shard_row["tokens"] if shard_row else 0
