"""The `regenerate` flow: every kept prompt answered by the target, exactly once, resumable.

Orchestration only: one regenerate per workspace at a time, cleanup of what a crash left,
imports, the server (embedded llama-server with parallel slots, or configured endpoints), batching of durable writes,
progress (console bar with tokens/s and ETA, Prefect progress and table artifacts). It stops at
once, FAILED with the cause, when the embedded server dies (`ServerDied`) or every endpoint stays
down past the outage window (`EndpointsDown`): prompts are then left pending, never recorded as
failed, and the same command resumes. The work is in tasks/regenerate/answers.py, HTTP in serving/,
persistence in storage/.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from flows.runinfo import lineage_run
from serving.client import Endpoint, EndpointsDown, RetryPolicy, ServerPool
from serving.llamacpp.server import ServerDied
from storage.datasets import remove_unregistered
from storage.lineage import LineageStore
from storage.locks import stage_lock
from tasks.config import RegenerateConfig
from tasks.regenerate.answers import GenerationSpec, GenerationWriter, import_finished_generations, regenerate_all
from tasks.regenerate.selection import choose_batch, selection_table

choose_task = task(choose_batch, name="choose-prompts", cache_policy=NO_CACHE)


@dataclass
class RegenerateSummary:
    run_id: str
    params_key: str
    generations_dir: str
    pending_at_start: int = 0
    requeued_files: int = 0
    imported: int = 0
    generated: int = 0
    failed: int = 0
    deferred: int = 0
    completion_tokens: int = 0
    flagged_empty: int = 0
    flagged_length: int = 0
    with_token_ids: int = 0
    seconds: float = 0.0
    endpoints: list[str] = field(default_factory=list)


def _import_all(config: RegenerateConfig, writer: GenerationWriter, logger) -> int:
    imported = 0
    for i, imp in enumerate(config.imports):
        records, gens, stop = import_finished_generations(imp, i, writer)
        imported += gens
        logger.info("import %s: %d new records, %d finished generations imported (%s)", imp.name, records, gens,
                    stop or "read completely")
    return imported


import_task = task(_import_all, name="import-generations", cache_policy=NO_CACHE)


@flow(name="regenerate", log_prints=True)
def regenerate(config: RegenerateConfig) -> RegenerateSummary:
    """Answer every pending prompt with the target through a baseline (non-speculative) server."""
    logger = get_run_logger()
    ws = Path(config.workspace)
    with stage_lock(ws, "regenerate"):
        store = LineageStore(ws / "lineage.duckdb")
        if config.embedded_server is not None:
            from tasks.model.target import embedded_identity

            gguf, revision, template_id = embedded_identity(config.embedded_server.gguf)
            config = config.model_copy(update={"target_revision": revision})
        else:
            gguf, template_id = None, config.chat_template_id
        spec = GenerationSpec.from_config(config, template_id)
        # The server (in the stack) stops before the run's row is closed.
        with lineage_run(store, "regenerate", config) as run, ExitStack() as stack:
            summary = RegenerateSummary(run_id=run.run_id, params_key=spec.params_key,
                                        generations_dir=str(ws / "data" / "generations" / spec.params_key))
            run.summary = summary.__dict__  # the same dict: filled in as the run goes
            _regenerate(config, store, spec, gguf, summary, stack, logger)
    return summary


def _regenerate(config: RegenerateConfig, store: LineageStore, spec: GenerationSpec, gguf: Path | None,
                summary: RegenerateSummary, stack: ExitStack, logger) -> None:
    gen_dir = Path(summary.generations_dir)
    # Files written but never committed belong to generations that are still pending: remove
    # them, and those prompts are simply generated again (in-flight work re-queued).
    removed = remove_unregistered(gen_dir, store.generations.files(spec.params_key))
    summary.requeued_files = len(removed)
    if removed:
        logger.warning("removed %d uncommitted generation file(s) left by a crash; their prompts are re-queued", len(removed))
    writer = GenerationWriter(store, spec, summary.run_id, gen_dir)
    summary.imported = import_task(config, writer, logger)

    # Which pending prompts this run sends (all of them without a `limit`): uniform, or where the
    # latest probe found the draft accepting least (tasks/regenerate/selection.py).
    chosen = choose_task(store, spec.params_key, config.retry_failed, config.limit, config.selection,
                         config.selection_strength)
    pending = store.discover.prompt_messages([s.prompt_id for s in chosen])
    summary.pending_at_start = len(pending)
    if not pending:
        logger.info("nothing to generate: every prompt has a generation or a recorded failure")
        _finish(store, summary)
        return
    if config.embedded_server is None and not config.endpoints:
        # An imports-only run: the pending prompts wait for a run that has a server.
        logger.info("imports only: %d pending prompt(s) need `endpoints` or `embedded_server` to be answered",
                    len(pending))
        _finish(store, summary)
        return
    # Why each prompt is sent, stored before it is: lineage answers "why this prompt?" for every generation.
    store.selection.write_selections(summary.run_id, spec.params_key, [s.row(config.selection) for s in chosen])
    by_cluster = selection_table(chosen)
    create_table_artifact(key="regenerate-selection", table=by_cluster,
                          description=f"regenerate run {summary.run_id}: {config.selection} selection, by cluster")
    for row in by_cluster if config.selection == "acceptance" else []:
        logger.info("selection: cluster %s, %d prompt(s): %s", row["cluster"], row["prompts"], row["reason"])

    if config.embedded_server is not None:
        from serving.llamacpp.server import LlamaCppServer

        es = config.embedded_server
        server = stack.enter_context(LlamaCppServer(gguf=gguf, port=es.port, n_ctx=es.n_ctx, n_threads=es.n_threads,
                                                    parallel=es.parallel,
                                                    log_path=Path(config.workspace) / "logs" / "llama-server.log"))
        logger.info("embedded llama-server %s on %s: %d slot(s)", server.build_info, server.base_url, es.parallel)
        endpoints = [Endpoint(server.base_url, max_concurrency=es.parallel, kind="llamacpp")]
    else:
        server = None
        endpoints = [Endpoint(e.url, e.max_concurrency, e.api_key_env, e.api_key_secret_block, kind=e.kind)
                     for e in config.endpoints]
    summary.endpoints = [e.url for e in endpoints]
    policy = RetryPolicy(**config.retry.model_dump())

    artifact_id = create_progress_artifact(progress=0.0, key="regenerate-progress", description="regenerate: prompts answered")
    started = time.monotonic()
    tokens = 0
    bar = stack.enter_context(Progress(
        TextColumn("regenerate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(), transient=True))
    job = bar.add_task("regenerate", total=len(pending), rate="")

    def write_batch(gens: list[dict], fails: list[dict], deferrals: list[dict]) -> None:
        nonlocal tokens
        tokens += writer.write(gens, fails, deferrals=deferrals)
        rate = tokens / max(time.monotonic() - started, 1e-6)
        bar.update(job, advance=len(gens) + len(fails) + len(deferrals), rate=f"{rate:,.0f} tok/s")
        update_progress_artifact(artifact_id, progress=100.0 * bar.tasks[0].completed / len(pending))

    async def run() -> tuple[int, int, int]:
        async with ServerPool(endpoints, policy) as pool:
            concurrency = sum(e.max_concurrency for e in endpoints)
            work = regenerate_all(pool, pending, config, spec, write_batch, concurrency)
            return await (server.guard(work) if server is not None else work)

    try:
        summary.generated, summary.failed, summary.deferred = asyncio.run(run())
    except (ServerDied, EndpointsDown) as e:
        # One clear error (the run is marked FAILED with it); what was written stays, the rest is pending.
        summary.seconds = time.monotonic() - started
        logger.error("regenerate stopped: %s", e)
        raise
    if summary.deferred:
        logger.warning("%d prompt(s) reached no server on their last attempt; they stay pending for the next run",
                       summary.deferred)
    summary.seconds = time.monotonic() - started
    _finish(store, summary)


def _finish(store: LineageStore, summary: RegenerateSummary) -> None:
    counts = store.generations.summary(summary.run_id)
    summary.completion_tokens = counts["completion_tokens"]
    summary.flagged_empty = counts["flagged_empty"]
    summary.flagged_length = counts["flagged_length"]
    summary.with_token_ids = counts["with_token_ids"]
    create_table_artifact(
        key="regenerate-summary",
        table=summary_table(summary),
        description=f"regenerate run {summary.run_id} (generation parameters {summary.params_key})",
    )


def summary_table(s: RegenerateSummary) -> list[dict]:
    rate = s.completion_tokens / s.seconds if s.seconds else 0.0
    return [
        {"what": "pending at start", "value": s.pending_at_start},
        {"what": "generated", "value": s.generated},
        {"what": "failed (recorded with reason)", "value": s.failed},
        {"what": "deferred (no server answered; still pending)", "value": s.deferred},
        {"what": "imported (no server)", "value": s.imported},
        {"what": "completion tokens", "value": s.completion_tokens},
        {"what": "tokens/s", "value": round(rate, 1)},
        {"what": "flagged empty", "value": s.flagged_empty},
        {"what": "flagged length", "value": s.flagged_length},
        {"what": "uncommitted files removed (re-queued)", "value": s.requeued_files},
    ]
