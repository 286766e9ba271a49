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
from prefect.utilities.annotations import quote
from rich.progress import Progress

from flows.runinfo import lineage_run
from storage.lineage import LineageStore
from storage.schema import OUTCOMES
from tasks.config import DiscoverConfig, SourceConfig
from tasks.discover.decontaminate import build_index
from tasks.discover.domains import tag_untagged
from tasks.discover.outcomes import backfill_signatures, decide_and_write
from tasks.discover.sources import RawRecord, ReadReport, read_source, sample_records, source_quotas

read_hub_task = task(read_source, name="read-hub-source", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE)
read_local_task = task(read_source, name="read-source", cache_policy=NO_CACHE)
build_index_task = task(build_index, name="build-decontamination-index", cache_policy=NO_CACHE)
backfill_task = task(backfill_signatures, name="backfill-minhash", cache_policy=NO_CACHE)
tag_task = task(tag_untagged, name="tag-prompts", cache_policy=NO_CACHE)
decide_write_task = task(decide_and_write, name="decide-and-write-outcomes", cache_policy=NO_CACHE)


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
    tagged: int = 0
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
    if config.near_dedupe.enabled:
        backfilled = backfill_task(store, config.near_dedupe)
        if backfilled:
            logger.info("computed MinHash signatures for %d stored prompts (parameters changed)", backfilled)
    index = build_index_task(config.decontaminate)
    formats = {s.name: (s.format, s.prompt_field, s.response_field) for s in config.sources}
    # A total limit shares records out by each source's size: then every source is read once to
    # count it (and let go) before any is decided. Sources are never all held at once: at 1M records
    # that held ~7 GB; one source at a time holds the largest one.
    sizes = {s.name: 0 for s in config.sources}
    if config.total_limit is not None:
        for src in config.sources:
            sizes[src.name] = len(_read(src)[0])
    quotas = source_quotas(config.sources, sizes, config.total_limit)

    artifact_id = create_progress_artifact(progress=0.0, key="discover-progress", description="discover: sources decided")
    with Progress(transient=True) as bar:
        job = bar.add_task("discover", total=None)
        for n, src in enumerate(config.sources):
            fresh = _read_new_records(src, quotas[src.name], config, store, summary, logger)
            # Batches are decided and written in order: each batch dedupes against everything
            # already stored, and each write is one transaction, so a crash loses no finished batch
            # and a rerun continues with the records not yet recorded.
            chunks = [fresh[b : b + config.write_batch_records] for b in range(0, len(fresh), config.write_batch_records)]
            # quote: Prefect would otherwise walk every record's nested dicts looking for futures,
            # twice per call (43% of discover's time at 1M records).
            decide_write_task(quote(chunks), summary.run_id, formats, store, config.near_dedupe, index, config.heldout,
                              on_written=lambda batch: bar.advance(job, len(batch.records)))
            update_progress_artifact(artifact_id, progress=100.0 * (n + 1) / len(config.sources))
    logger.info("%d records read, %d new after sampling and lineage", summary.records_read, summary.records_in)

    # Domain and cluster of every stored prompt (acceptance-aware selection reads them); after the
    # batches so deduping never waits on it, and a rerun tags what a crash left untagged.
    summary.tagged = tag_task(store)
    summary.outcomes = store.discover.outcome_counts(summary.run_id)
    summary.top_quarantine_reasons = store.discover.quarantine_reasons(summary.run_id)
    summary.stored_prompts = store.discover.export_prompts(Path(summary.dataset))
    if not summary.reconciles:
        raise RuntimeError(f"outcome counts do not reconcile: {summary.records_in} in, {summary.outcomes}")
    create_table_artifact(
        key="discover-outcomes",
        table=outcome_table(summary),
        description=f"discover run {summary.run_id}: records in = kept + heldout + duplicates + contaminated + "
                    "quarantined",
    )


def _read(src: SourceConfig) -> tuple[list[RawRecord], list[ReadReport]]:
    # Hub loads get retries; a local file that cannot be read will not improve.
    return (read_hub_task if src.kind == "hub" else read_local_task)(src)


def _read_new_records(src: SourceConfig, quota: int | None, config: DiscoverConfig, store: LineageStore,
                      summary: DiscoverSummary, logger) -> list[RawRecord]:
    """One source's sample, less the records lineage already has; its reads recorded, the summary counted."""
    records, reports = _read(src)
    store.discover.record_source_reads(summary.run_id, [{
        "source": r.source, "location": r.location, "records": r.records, "unreadable": r.unreadable,
        "complete": r.complete, "stop_reason": r.stop_reason, "notes": "; ".join(r.notes) or None,
    } for r in reports])
    for r in reports:
        if not r.complete:
            summary.truncated_sources.append(f"{r.source}: {r.stop_reason}")
            logger.warning("source %s stopped early: %s", r.source, r.stop_reason)
    sampled = sample_records(records, quota, config.seed)
    seen = store.discover.seen_record_keys(src.name)
    fresh = [r for r in sampled if r.record_key not in seen]
    summary.records_read += len(records)
    summary.not_sampled += len(records) - len(sampled)
    summary.already_seen += len(sampled) - len(fresh)
    summary.records_in += len(fresh)
    return fresh


def outcome_table(summary: DiscoverSummary) -> list[dict]:
    rows = [{"outcome": o, "records": summary.outcomes.get(o, 0)} for o in OUTCOMES]
    rows.append({"outcome": "total (records in)", "records": summary.records_in})
    rows.append({"outcome": "already in lineage (skipped)", "records": summary.already_seen})
    rows.append({"outcome": "not sampled (over a limit)", "records": summary.not_sampled})
    return rows
