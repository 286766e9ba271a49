"""The `discover` flow: sources -> sample -> outcomes -> lineage store and a Parquet dataset.

Orchestration only: the order of the steps, retries for sources, batching of writes, progress and
table artifacts. The work is in tasks/ (reading, normalising, dedupe, decontamination) and the
persistence in storage/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from rich.progress import Progress

from flows.runinfo import lineage_run
from storage.lineage import LineageStore
from storage.schema import OUTCOMES
from tasks.config import DiscoverConfig
from tasks.decontaminate import build_index
from tasks.outcomes import backfill_signatures, decide_outcomes
from tasks.sources import read_source, sample_records, source_quotas

# Only a hub load can fail for a passing reason; a local file that cannot be read will not improve.
read_hub_task = task(read_source, name="read-hub-source", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE)
read_local_task = task(read_source, name="read-source", cache_policy=NO_CACHE)
build_index_task = task(build_index, name="build-decontamination-index", cache_policy=NO_CACHE)
backfill_task = task(backfill_signatures, name="backfill-minhash", cache_policy=NO_CACHE)
decide_task = task(decide_outcomes, name="decide-outcomes", cache_policy=NO_CACHE)


@dataclass
class DiscoverSummary:
    run_id: str
    lineage_db: str
    dataset: str
    records_read: int = 0
    not_sampled: int = 0
    already_seen: int = 0
    records_in: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    stored_prompts: int = 0
    truncated_sources: list[str] = field(default_factory=list)
    top_quarantine_reasons: list[tuple[str, int]] = field(default_factory=list)

    @property
    def reconciles(self) -> bool:
        return self.records_in == sum(self.outcomes.get(o, 0) for o in OUTCOMES)


def workspace_paths(workspace: str | Path) -> tuple[Path, Path]:
    ws = Path(workspace)
    return ws / "lineage.duckdb", ws / "data" / "prompts" / "prompts.parquet"


@flow(name="discover", log_prints=True)
def discover(config: DiscoverConfig) -> DiscoverSummary:
    """Read every source, keep new, clean, unique, uncontaminated prompts (holding some out for evaluation);
    record every record's outcome."""
    logger = get_run_logger()
    db_path, dataset_path = workspace_paths(config.workspace)
    store = LineageStore(db_path)
    with lineage_run(store, "discover", config) as run:
        summary = DiscoverSummary(run_id=run.run_id, lineage_db=str(db_path), dataset=str(dataset_path))
        _discover(config, store, summary, logger)
        run.summary = summary.__dict__
    return summary


def _discover(config: DiscoverConfig, store: LineageStore, summary: DiscoverSummary, logger) -> None:
    # Read every source (hub loads get retries), then sample with the seed and quotas.
    read = {}
    reads = []
    for src in config.sources:
        records, reports = (read_hub_task if src.kind == "hub" else read_local_task)(src)
        read[src.name] = records
        for r in reports:
            reads.append({
                "source": r.source, "location": r.location, "records": r.records, "unreadable": r.unreadable,
                "complete": r.complete, "stop_reason": r.stop_reason, "notes": "; ".join(r.notes) or None,
            })
            if not r.complete:
                summary.truncated_sources.append(f"{r.source}: {r.stop_reason}")
                logger.warning("source %s stopped early: %s", r.source, r.stop_reason)
    store.record_source_reads(summary.run_id, reads)

    quotas = source_quotas(config.sources, {k: len(v) for k, v in read.items()}, config.total_limit)
    new_records = []
    for src in config.sources:
        sampled = sample_records(read[src.name], quotas[src.name], config.seed)
        seen = store.seen_record_keys(src.name)
        fresh = [r for r in sampled if r.record_key not in seen]
        summary.records_read += len(read[src.name])
        summary.not_sampled += len(read[src.name]) - len(sampled)
        summary.already_seen += len(sampled) - len(fresh)
        new_records.extend(fresh)
    summary.records_in = len(new_records)
    logger.info("%d records read, %d new after sampling and lineage", summary.records_read, summary.records_in)

    if config.near_dedupe.enabled:
        backfilled = backfill_task(store, config.near_dedupe)
        if backfilled:
            logger.info("computed MinHash signatures for %d stored prompts (parameters changed)", backfilled)
    index = build_index_task(config.decontaminate)
    formats = {s.name: (s.format, s.prompt_field, s.response_field) for s in config.sources}

    # Batches are decided and written one at a time: each batch dedupes against everything
    # already stored, and each write is one transaction, so a crash loses no finished batch and
    # a rerun continues with the records not yet recorded.
    batch_records = config.write_batch_records
    n_batches = max(1, -(-len(new_records) // batch_records))
    artifact_id = create_progress_artifact(progress=0.0, key="discover-progress", description="discover: records decided")
    with Progress(transient=True) as bar:
        job = bar.add_task("discover", total=len(new_records))
        for b in range(n_batches):
            chunk = new_records[b * batch_records : (b + 1) * batch_records]
            if not chunk:
                break
            batch = decide_task(chunk, formats, store, config.near_dedupe, index, config.heldout)
            store.write_discover_batch(summary.run_id, batch.records, batch.prompts, batch.minhash)
            bar.advance(job, len(chunk))
            update_progress_artifact(artifact_id, progress=100.0 * (b + 1) / n_batches)

    summary.outcomes = store.outcome_counts(summary.run_id)
    summary.top_quarantine_reasons = store.quarantine_reasons(summary.run_id)
    summary.stored_prompts = store.export_prompts(Path(summary.dataset))
    if not summary.reconciles:
        raise RuntimeError(f"outcome counts do not reconcile: {summary.records_in} in, {summary.outcomes}")
    create_table_artifact(
        key="discover-outcomes",
        table=outcome_table(summary),
        description=f"discover run {summary.run_id}: records in = kept + heldout + duplicates + contaminated + "
                    "quarantined",
    )


def outcome_table(summary: DiscoverSummary) -> list[dict]:
    rows = [{"outcome": o, "records": summary.outcomes.get(o, 0)} for o in OUTCOMES]
    rows.append({"outcome": "total (records in)", "records": summary.records_in})
    rows.append({"outcome": "already in lineage (skipped)", "records": summary.already_seen})
    rows.append({"outcome": "not sampled (over a limit)", "records": summary.not_sampled})
    return rows
