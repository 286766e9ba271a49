"""The `extract` flow: generations -> tokenised samples -> hidden-state shards, one disk budget at a time.

Orchestration only: one extract per workspace at a time, cleanup of what a crash left, the draft
vocab (built once per tokenisation, or given as a file, then reused), the round loop (plan a shard
that fits, extract, write the file, commit its lineage), progress (console bar, Prefect progress and
table artifacts).
The work is in tasks/ (chat, vocab, extract, rounds), persistence in storage/.

A round ends when every pending generation is done, the sample limit is reached, or the next shard
would not fit in the disk budget; training consumes shards and deletes them, and the next
`extract` continues with the next samples.

With `workers` > 1 (or a `dask_address`) the shards of a round are extracted by Dask worker
processes (prefect-dask), each holding its own copy of the target; this process still plans every
shard, reserves its predicted bytes against the budget before it is submitted, and is the only one
that writes lineage (DuckDB has one writer), committing the shards in the order they were planned.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from flows.regenerate import stage_lock
from flows.runinfo import lineage_run
from storage.datasets import file_sha256, read_generation_rows, write_bytes_atomic
from storage.lineage import LineageError, LineageStore
from storage.shards import ShardStore
from tasks.extract.chat import Sample, Tokenised, tokenise_rows
from tasks.config import ExtractConfig
from tasks.extract.hf_backend import Extractor, ExtractSettings, build_extractor, default_aux_layer_ids
from tasks.extract.plan import extract_key, plan_shard, sample_id, tokenize_key
from tasks.extract.shard_job import ShardJob, ShardOutcome, WorkerSpec, run_shard_job, run_shard_job_on_worker
from tasks.extract.vllm_backend import open_vllm_extractor, text_config
from tasks.model.target import (TargetFiles, TargetIdentity, load_configured_target, load_configured_target_files,
                          resolve_target_dtype)
from tasks.extract.vocab import (DraftVocab, TokenCounter, build_draft_vocab, coverage_report, load_vocab, save_vocab,
                         split_half_coverage, thin_vocab_warning, vocab_drift_warning)

READ_CHUNK = 256  # generations read and tokenised at a time


@dataclass
class ExtractSummary:
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


@dataclass
class StageContext:
    """What every step of a run shares: where things are, what the target is, how samples are made."""

    config: ExtractConfig
    store: LineageStore
    workspace: Path
    tokenizer: object
    identity: TargetIdentity
    tokenize_key: str

    @property
    def generations_dir(self) -> Path:
        return self.workspace / "data" / "generations"

    def tokenise(self, items: list[tuple[str, str, str]]) -> list[Tokenised]:
        """Samples of (generation_id, params_key, file) items, in order."""
        rows = read_generation_rows(self.generations_dir, [(g, f"{p}/{f}") for g, p, f in items])
        return tokenise_rows(self.tokenizer, rows, self.config.max_length, self.config.overflow,
                             self.identity.chat_template)


def _load_target(config: ExtractConfig):
    t = config.target
    return load_configured_target(t.gguf, t.model_path, t.revision, t.trust_remote_code, t.dtype, t.device)


def _load_target_files(config: ExtractConfig) -> TargetFiles:
    t = config.target
    return load_configured_target_files(t.gguf, t.model_path, t.revision, t.trust_remote_code, t.dtype)


load_target_task = task(_load_target, name="load-target", cache_policy=NO_CACHE)
# The vllm backend's server loads the weights; this process needs the folder, config and tokenizer only.
load_target_files_task = task(_load_target_files, name="load-target-files", cache_policy=NO_CACHE)


def draft_vocab_for(ctx: StageContext, run_id: str, logger) -> tuple[DraftVocab, str, dict]:
    """The vocab of this tokenisation: the given file's (`draft_vocab_file`), else built from every
    generation's loss-masked tokens the first time, then loaded (checksum verified) so that later rounds
    keep the same draft ids."""
    cfg, store = ctx.config, ctx.store
    given = _given_vocab(cfg) if cfg.draft_vocab_file else None
    row = store.draft_vocab(ctx.tokenize_key, cfg.draft_vocab_size, given[2][:16] if given else None)
    if row is not None:
        path = ctx.workspace / row["file"]
        if file_sha256(path) != row["sha256"]:
            raise LineageError(f"draft vocab {path} does not match its recorded sha256; it was changed after it was built")
        return load_vocab(path), row["vocab_id"], json.loads(row["report"])
    items = store.generations_to_tokenise(cfg.generation_params_keys)
    if not items:
        raise LineageError("no generations to tokenise: run `eagle3 regenerate` first")
    halves = (TokenCounter(len(ctx.tokenizer)), TokenCounter(len(ctx.tokenizer)))  # alternate samples
    samples = 0
    for start in range(0, len(items), READ_CHUNK):
        for t in ctx.tokenise(items[start:start + READ_CHUNK]):
            if isinstance(t.result, Sample):
                halves[samples % 2].add(t.result.input_ids, t.result.loss_mask)
                samples += 1
    counts = halves[0].counts + halves[1].counts
    if given is None:
        vocab = build_draft_vocab(counts, cfg.draft_vocab_size)
        expected = split_half_coverage(halves[0].counts, halves[1].counts, cfg.draft_vocab_size)
        report = {**coverage_report(vocab), "expected_coverage": expected, "expected_from": "split-half",
                  "warning": thin_vocab_warning(vocab, expected)}
        rel = Path("vocab") / f"{ctx.tokenize_key}-{cfg.draft_vocab_size}.safetensors"
        save_vocab(vocab, ctx.workspace / rel)
    else:  # what it covers of this workspace's tokens is recorded, and later rounds are held to it
        vocab, data, digest = given
        if vocab.target_vocab_size != len(ctx.tokenizer):
            raise LineageError(f"draft_vocab_file {cfg.draft_vocab_file}: built for a target vocabulary of "
                               f"{vocab.target_vocab_size} tokens; this target's tokenizer has {len(ctx.tokenizer)}")
        report = coverage_report(vocab, counts)
        report.update({"expected_coverage": report["coverage"], "expected_from": "first use",
                       "given": cfg.draft_vocab_file, "built_coverage": vocab.coverage, "warning": None})
        rel = Path("vocab") / f"{ctx.tokenize_key}-{cfg.draft_vocab_size}-{digest[:16]}.safetensors"
        write_bytes_atomic(data, ctx.workspace / rel)  # byte for byte, so the same id
    digest = file_sha256(ctx.workspace / rel)
    vocab_id = digest[:16]
    store.register_draft_vocab(run_id, {
        "vocab_id": vocab_id, "tokenize_key": ctx.tokenize_key, "file": str(rel), "sha256": digest,
        "draft_vocab_size": vocab.draft_vocab_size, "target_vocab_size": vocab.target_vocab_size,
        "coverage": report["coverage"], "counted_tokens": report["total_tokens"], "counted_samples": samples,
        "report": report})
    logger.info("draft vocab %s%s: %d of %d target tokens, coverage %.4f of %d loss-masked tokens from %d samples",
                vocab_id, f" (from {cfg.draft_vocab_file})" if given else "", vocab.draft_vocab_size,
                vocab.target_vocab_size, report["coverage"], report["total_tokens"], samples)
    if report["warning"] is not None:
        logger.warning(report["warning"])
    return vocab, vocab_id, report


def _given_vocab(cfg: ExtractConfig) -> tuple[DraftVocab, bytes, str]:
    """The `draft_vocab_file` vocab (validated on load), the file's bytes and their sha256, which names it (the
    workspace keeps a byte-for-byte copy, so the id is the same in every workspace that uses the file)."""
    path = Path(cfg.draft_vocab_file)
    try:
        data = path.read_bytes()
        vocab = load_vocab(path)
    except Exception as e:  # missing, not safetensors (safetensors' own error type), or not a valid vocab
        raise LineageError(f"draft_vocab_file {path}: {e}") from e
    if vocab.draft_vocab_size != cfg.draft_vocab_size:
        raise LineageError(f"draft_vocab_file {path} holds {vocab.draft_vocab_size} draft tokens; draft_vocab_size "
                           f"is {cfg.draft_vocab_size}: set it to {vocab.draft_vocab_size}")
    return vocab, data, hashlib.sha256(data).hexdigest()


vocab_task = task(draft_vocab_for, name="draft-vocab", cache_policy=NO_CACHE)


def _sample_row(sid: str, gid: str, ekey: str, t: Tokenised, outcome: str, reason: str | None = None,
                shard: str | None = None, index: int | None = None) -> dict:
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
    store.register_extract_settings(summary.run_id, ekey, vocab_id, {
        "tokenize_key": tkey, "target": identity.name, "target_revision": identity.revision,
        "template_id": identity.template_id, "hidden_size": hidden_size, "num_layers": num_layers,
        "max_length": config.max_length, "overflow": config.overflow,
        "generation_params_keys": config.generation_params_keys, **asdict(settings)})

    shards = ShardStore(ws / "shards", config.disk_budget_bytes)
    live = store.live_shards()
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
        row = store.draft_vocab(tkey, config.draft_vocab_size, vocab_id)
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
        executor, max_in_flight = _in_process(extractor, shards), 1
    del model  # with workers, this process needs the target's tokenizer and config only

    pending = store.pending_generations(ekey, config.generation_params_keys, config.limit)
    summary.pending_at_start = len(pending)
    summary.peak_disk_bytes = shards.used_bytes()
    extracted_tokens = TokenCounter(vocab.target_vocab_size)
    if not pending:
        logger.info("nothing to extract: every generation has a sample under extract key %s", ekey)
    else:
        with executor as submit:
            _rounds(ctx, pending, ekey, settings, hidden_size, submit, max_in_flight, shards, summary, extracted_tokens,
                    logger)
    if extracted_tokens.tokens_seen:
        extracted = coverage_report(vocab, extracted_tokens.counts)
        summary.extracted_vocab_coverage = extracted["coverage"]
        summary.vocab_warning = vocab_drift_warning(vocab, extracted, summary.vocab_expected_coverage)
        if summary.vocab_warning is not None:
            logger.warning(summary.vocab_warning)
    summary.disk_used_bytes = shards.used_bytes()
    summary.seconds = time.monotonic() - started
    counts = store.extract_summary(summary.run_id)
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


# A submit function: it takes a planned shard and returns a function that waits for its outcome.
Submit = Callable[[ShardJob], Callable[[], ShardOutcome]]

# The job as a Prefect task, so that each shard a worker extracts is a task run of this flow run.
# No retries: a retry would find its own half-committed file name taken; the next run redoes it.
shard_task = task(run_shard_job_on_worker, name="extract-shard", cache_policy=NO_CACHE)


@contextmanager
def _in_process(extractor: Extractor, shards: ShardStore) -> Iterator[Submit]:
    """Jobs run here, at submission (workers = 1: as the flow always did)."""
    def submit(job: ShardJob) -> Callable[[], ShardOutcome]:
        outcome = run_shard_job(extractor, shards, job)
        return lambda: outcome
    yield submit


@contextmanager
def _on_vllm(config: ExtractConfig, files: TargetFiles, settings: ExtractSettings, t2d: torch.Tensor, ws: Path,
             shards: ShardStore, logger) -> Iterator[Submit]:
    """Jobs run here, at submission, on a vLLM server this block starts and stops."""
    log = ws / "logs" / "vllm-server.log"
    logger.info("starting vLLM (tensor parallel %d) on %s; log %s", config.vllm.tensor_parallel_size, files.folder, log)
    with open_vllm_extractor(config, files, settings, t2d, ws / "vllm-states", log_path=log) as extractor:
        logger.info("vLLM %s up in %.0f s at %s", extractor.server.version, extractor.server.startup_s,
                    extractor.server.base_url)
        with _in_process(extractor, shards) as submit:
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


@dataclass
class _InFlight:
    job: ShardJob
    taken: list[tuple[str, str, Tokenised]]  # (sample id, generation id, tokenised), in job order
    reserved: int  # predicted bytes: counted against the budget until the shard is committed
    wait: Callable[[], ShardOutcome]


def _rounds(ctx: StageContext, pending: list[tuple[str, str, str]], ekey: str, settings: ExtractSettings,
            hidden_size: int, submit: Submit, max_in_flight: int, shards: ShardStore, summary: ExtractSummary,
            extracted_tokens: TokenCounter, logger) -> None:
    store, cfg = ctx.store, ctx.config
    artifact_id = create_progress_artifact(progress=0.0, key="extract-progress", description="extract: generations done")
    seq = store.last_shard_seq()
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
            update_progress_artifact(artifact_id, progress=100.0 * done / len(pending))

        for start in range(0, len(pending) + 1, READ_CHUNK):
            chunk = pending[start:start + READ_CHUNK]
            for (gid, _, _), t in zip(chunk, ctx.tokenise(chunk) if chunk else []):
                sid = sample_id(gid, ekey)
                if isinstance(t.result, Sample):
                    queue.append((sid, gid, t))
                else:
                    no_shard_rows.append(_sample_row(sid, gid, ekey, t, "skipped"))
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
            store.write_extract_batch(summary.run_id, None, no_shard_rows)
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
            rows.append(_sample_row(sid, gid, ekey, t, "extracted", shard=outcome.name, index=slot[i]))
        else:
            rows.append(_sample_row(sid, gid, ekey, t, "quarantined", reason=reason))
    ctx.store.write_extract_batch(summary.run_id, shard_row, rows)
    return shard_row["tokens"] if shard_row else 0


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
