"""The `extract` flow: generations -> tokenised samples -> hidden-state shards, one disk budget at a time.

Orchestration only: one extract per workspace at a time, cleanup of what a crash left, loading the
target, where the shards are extracted (in this process, on a vLLM server, or on Dask workers),
progress (console bar, Prefect progress and table artifacts). The work is in tasks/extract/: the
draft vocab (draft_vocab.py), filling the budget shard by shard (fill.py, planning in plan.py, one
shard's job in shard_job.py); persistence in storage/.

A run ends when every pending generation is done, the sample limit is reached, or the next shard
would not fit in the disk budget; training consumes shards and deletes them, and the next
`extract` continues with the next samples (the rounds: tasks/rounds.py).

With `workers` > 1 (or a `dask_address`) the shards are extracted by Dask worker processes
(prefect-dask), each holding its own copy of the target; this process still plans every shard,
reserves its predicted bytes against the budget before it is submitted, and is the only one that
writes lineage (DuckDB has one writer), committing the shards in the order they were planned.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from flows.runinfo import lineage_run
from storage.lineage import LineageError, LineageStore
from storage.locks import stage_lock
from storage.shards import ShardStore
from tasks.config import ExtractConfig
from tasks.extract.draft_vocab import StageContext, draft_vocab_for
from tasks.extract.fill import ExtractSummary, Submit, fill_budget, in_process
from tasks.extract.hf_backend import ExtractSettings, build_extractor, default_aux_layer_ids
from tasks.extract.shard_job import ShardJob, ShardOutcome, WorkerSpec, run_shard_job_on_worker
from tasks.extract.vllm_backend import open_vllm_extractor, text_config
from tasks.extract.vocab import TokenCounter, coverage_report, vocab_drift_warning
from tasks.ids import extract_key, tokenize_key
from tasks.model.target import TargetFiles, load_configured_target, load_configured_target_files, resolve_target_dtype


def _load_target(config: ExtractConfig):
    t = config.target
    return load_configured_target(t.gguf, t.model_path, t.revision, t.trust_remote_code, t.dtype, t.device)


def _load_target_files(config: ExtractConfig) -> TargetFiles:
    t = config.target
    return load_configured_target_files(t.gguf, t.model_path, t.revision, t.trust_remote_code, t.dtype)


load_target_task = task(_load_target, name="load-target", cache_policy=NO_CACHE)
# The vllm backend's server loads the weights; this process needs the folder, config and tokenizer only.
load_target_files_task = task(_load_target_files, name="load-target-files", cache_policy=NO_CACHE)


vocab_task = task(draft_vocab_for, name="draft-vocab", cache_policy=NO_CACHE)


@flow(name="extract", log_prints=True)
def extract(config: ExtractConfig) -> ExtractSummary:
    """Tokenise generations with the serving template, build the draft vocab, and fill the disk
    budget with hidden-state shards of the next pending samples."""
    logger = get_run_logger()
    ws = Path(config.workspace)
    with stage_lock(ws, "extract"):
        store = LineageStore(ws / "lineage.duckdb")
        with lineage_run(store, "extract", config) as run:
            summary = ExtractSummary(run_id=run.run_id, disk_budget_bytes=config.disk_budget_bytes)
            _extract(config, store, ws, summary, logger)
            run.summary = asdict(summary)
    return summary


def _extract(config: ExtractConfig, store: LineageStore, ws: Path, summary: ExtractSummary, logger) -> None:
    started = time.monotonic()
    if config.backend == "vllm":
        files = load_target_files_task(config)
        model, tokenizer, identity, model_config = None, files.tokenizer, files.identity, text_config(files.config)
    else:
        model, tokenizer, identity = load_target_task(config)
        model_config = model.config
    summary.target_dtype = (resolve_target_dtype(config.target.dtype) if model is None
                            else str(model.dtype).removeprefix("torch."))
    logger.info("the target computes in %s (target.dtype: %s)", summary.target_dtype, config.target.dtype)
    num_layers = model_config.num_hidden_layers
    hidden_size = model_config.hidden_size
    settings = ExtractSettings(aux_layer_ids=config.aux_layer_ids or default_aux_layer_ids(num_layers),
                               teacher=config.teacher, topk=config.topk, storage=config.storage)
    summary.aux_layer_ids = settings.aux_layer_ids
    tkey = tokenize_key(identity.name, identity.revision, identity.template_id, config.max_length, config.overflow,
                        config.generation_params_keys)
    ctx = StageContext(config, store, ws, tokenizer, identity, tkey)
    vocab, vocab_id, report = vocab_task(ctx, summary.run_id, logger)
    summary.vocab_id, summary.vocab_coverage = vocab_id, vocab.coverage
    # what it should cover of tokens it was not chosen from: a built vocab's split-half estimate, a given
    # one's coverage of this workspace's tokens at its first use (None: built before this was recorded)
    summary.vocab_expected_coverage = report.get("expected_coverage")
    ekey = extract_key(tkey, vocab_id, settings)
    summary.extract_key = ekey
    store.extraction.register_settings(summary.run_id, ekey, vocab_id, {
        "tokenize_key": tkey, "target": identity.name, "target_revision": identity.revision,
        "template_id": identity.template_id, "hidden_size": hidden_size, "num_layers": num_layers,
        "max_length": config.max_length, "overflow": config.overflow,
        "generation_params_keys": config.generation_params_keys, **asdict(settings)})

    shards = ShardStore(ws / "shards", config.disk_budget_bytes)
    live = store.extraction.live_shards()
    removed = shards.cleanup(set(live))
    summary.removed_leftovers = len(removed)
    if removed:
        logger.warning("removed %d shard file(s) a crash left uncommitted; their samples are pending again", len(removed))
    missing = [n for n in live if not (shards.folder / n).exists()]
    if missing:
        raise LineageError(f"{len(missing)} registered shard(s) are missing from {shards.folder} (e.g. {missing[0]}); "
                           "shards are deleted only through the pipeline")
    summary.workers = config.workers
    distributed = config.workers > 1 or config.dask_address is not None
    if distributed:
        row = store.extraction.draft_vocab(tkey, config.draft_vocab_size, vocab_id)
        spec = WorkerSpec(
            target=config.target, backend=config.backend, settings=settings, max_batch_tokens=config.max_batch_tokens,
            vocab_path=str(ws / row["file"]), vocab_sha256=row["sha256"],
            identity=(identity.name, identity.revision, identity.template_id),
            # Local workers share this machine's cores; an external cluster's workers size themselves.
            threads=None if config.dask_address else max(1, (os.cpu_count() or 1) // config.workers))
        executor, max_in_flight = _on_workers(config, spec, shards, logger), 2 * config.workers
    elif config.backend == "vllm":
        executor, max_in_flight = _on_vllm(config, files, settings, torch.from_numpy(vocab.t2d), ws, shards, logger), 1
    else:
        extractor = build_extractor(config.backend, model, tokenizer, settings, torch.from_numpy(vocab.t2d),
                                    config.max_batch_tokens)
        executor, max_in_flight = in_process(extractor, shards), 1
    del model  # with workers, this process needs the target's tokenizer and config only

    pending = store.extraction.pending_generations(ekey, config.generation_params_keys, config.limit)
    summary.pending_at_start = len(pending)
    summary.peak_disk_bytes = shards.used_bytes()
    extracted_tokens = TokenCounter(vocab.target_vocab_size)
    if not pending:
        logger.info("nothing to extract: every generation has a sample under extract key %s", ekey)
    else:
        artifact_id = create_progress_artifact(progress=0.0, key="extract-progress",
                                               description="extract: generations done")
        with executor as submit:
            fill_budget(ctx, pending, ekey, settings, hidden_size, submit, max_in_flight, shards, summary,
                        extracted_tokens, logger, lambda percent: update_progress_artifact(artifact_id, progress=percent))
    if extracted_tokens.tokens_seen:
        extracted = coverage_report(vocab, extracted_tokens.counts)
        summary.extracted_vocab_coverage = extracted["coverage"]
        summary.vocab_warning = vocab_drift_warning(vocab, extracted, summary.vocab_expected_coverage)
        if summary.vocab_warning is not None:
            logger.warning(summary.vocab_warning)
    summary.disk_used_bytes = shards.used_bytes()
    summary.seconds = time.monotonic() - started
    counts = store.extraction.summary(summary.run_id)
    for k in ("extracted", "quarantined", "skipped", "tokens", "masked_tokens", "truncated_tokens", "ids_checked",
              "ids_mismatched", "first_mismatch", "reasons"):
        setattr(summary, k, counts[k])
    if summary.ids_mismatched:
        logger.warning("%d of %d samples' rendering differed from the server's token ids (the server's were used); "
                       "first: %s", summary.ids_mismatched, summary.ids_checked, summary.first_mismatch)
    create_table_artifact(key="extract-summary", table=summary_table(summary),
                          description=f"extract run {summary.run_id} (extract key {ekey})")
    create_table_artifact(key="draft-vocab-coverage", description=f"draft vocab {vocab_id}", table=[
        {"what": k, "value": json.dumps(v) if isinstance(v, (dict, list)) else v} for k, v in report.items()])


# The job as a Prefect task, so that each shard a worker extracts is a task run of this flow run.
# No retries: a retry would find its own half-committed file name taken; the next run redoes it.
shard_task = task(run_shard_job_on_worker, name="extract-shard", cache_policy=NO_CACHE)


@contextmanager
def _on_vllm(config: ExtractConfig, files: TargetFiles, settings: ExtractSettings, t2d: torch.Tensor, ws: Path,
             shards: ShardStore, logger) -> Iterator[Submit]:
    """Jobs run here, at submission, on a vLLM server this block starts and stops."""
    log = ws / "logs" / "vllm-server.log"
    logger.info("starting vLLM (tensor parallel %d) on %s; log %s", config.vllm.tensor_parallel_size, files.folder, log)
    with open_vllm_extractor(config, files, settings, t2d, ws / "vllm-states", log_path=log) as extractor:
        logger.info("vLLM %s up in %.0f s at %s", extractor.server.version, extractor.server.startup_s,
                    extractor.server.base_url)
        with in_process(extractor, shards) as submit:
            yield submit


@contextmanager
def _on_workers(config: ExtractConfig, spec: WorkerSpec, shards: ShardStore, logger) -> Iterator[Submit]:
    """Jobs run as `extract-shard` task runs on Dask workers: `config.workers` local processes, or
    the cluster at `config.dask_address`. The cluster lives as long as the block."""
    from prefect_dask import DaskTaskRunner

    if config.dask_address:
        runner = DaskTaskRunner(address=config.dask_address)
        logger.info("extracting on the Dask cluster at %s", config.dask_address)
    else:
        # One Dask thread per worker process: torch parallelises inside it (spec.threads). No
        # memory limit: the target a worker holds is not Dask data, and the nanny would kill a
        # worker whose model alone passes total/workers. Dashboard on loopback, any free port:
        # runs in other workspaces may overlap.
        runner = DaskTaskRunner(cluster_kwargs={"n_workers": config.workers, "threads_per_worker": 1, "processes": True,
                                                "memory_limit": 0, "dashboard_address": "127.0.0.1:0"})
        logger.info("extracting on %d local worker processes, %s torch thread(s) each", config.workers, spec.threads)
    # No PREFECT_API_URL in os.environ needed: prefect-dask sends the settings context with every task,
    # so a URL the CLI set with `temporary_settings` reaches the workers' task runs and logs.
    with _quiet("distributed"), runner:
        def submit(job: ShardJob) -> Callable[[], ShardOutcome]:
            future = runner.submit(shard_task, parameters={"spec": spec, "shard_folder": str(shards.folder),
                                                           "disk_budget_bytes": shards.budget, "job": job})
            return future.result
        yield submit


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Warnings and errors only from `logger_name` in the block: the local cluster's scheduler and
    nannies run in this process and log every start, connection and close at INFO."""
    log = logging.getLogger(logger_name)
    before = log.level
    log.setLevel(max(before, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(before)


def summary_table(s: ExtractSummary) -> list[dict]:
    rate = s.tokens / s.seconds if s.seconds else 0.0
    return [
        {"what": "pending at start", "value": s.pending_at_start},
        {"what": "samples extracted", "value": s.extracted},
        {"what": "quarantined (non-finite states)", "value": s.quarantined},
        {"what": "skipped (tokenisation, with reason)", "value": s.skipped},
        {"what": "tokens extracted", "value": s.tokens},
        {"what": "loss-masked tokens", "value": s.masked_tokens},
        {"what": "tokens cut by max_length", "value": s.truncated_tokens},
        {"what": "tokens/s", "value": round(rate, 1)},
        {"what": "shards written", "value": s.shards_written},
        {"what": "bytes written", "value": s.bytes_written},
        {"what": "disk used / budget (B)", "value": f"{s.disk_used_bytes} / {s.disk_budget_bytes}"},
        {"what": "peak disk (B)", "value": s.peak_disk_bytes},
        {"what": "stopped by", "value": s.stopped_by},
        {"what": "server ids checked / mismatched", "value": f"{s.ids_checked} / {s.ids_mismatched}"},
        {"what": "draft vocab coverage (tokens it was built from)", "value": round(s.vocab_coverage, 4)},
        {"what": "draft vocab coverage expected of new tokens",
         "value": None if s.vocab_expected_coverage is None else round(s.vocab_expected_coverage, 4)},
        {"what": "draft vocab coverage (tokens extracted now)",
         "value": None if s.extracted_vocab_coverage is None else round(s.extracted_vocab_coverage, 4)},
        {"what": "draft vocab warning", "value": s.vocab_warning or "none"},
        {"what": "aux layer ids (output of layer i)", "value": str(s.aux_layer_ids)},
        {"what": "uncommitted shard files removed", "value": s.removed_leftovers},
        {"what": "extraction workers", "value": s.workers},
    ]
