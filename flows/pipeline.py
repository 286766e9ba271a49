"""The `pipeline` flow: every stage in order, resumable from lineage after any failure.

Orchestration only: discover -> regenerate -> rounds of (extract until the disk budget is full ->
train, which deletes the shards it consumed; with `benchmark.every_round`, benchmark that round's
export; the round loop and its stop rule are tasks/rounds.py's) -> probe (with
`regenerate.selection: acceptance`: the latest export's acceptance per cluster, where the next
run's regenerate draws its batch) -> benchmark (the serving-contract doctor first). Each
stage is its own Prefect subflow and its own `runs` row, and skips what lineage records as done, so
running the same pipeline again continues a multi-day run where it stopped; a stage that fails
leaves every other stage's work committed. Prefect global concurrency limits share the machine:
regenerate holds its server slots, extract / train / benchmark hold a GPU slot.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from flows.benchmark import benchmark as benchmark_flow
from flows.discover import discover as discover_flow
from flows.extract import extract as extract_flow
from flows.probe import probe as probe_flow
from flows.regenerate import regenerate as regenerate_flow
from flows.runinfo import lineage_run
from flows.train import train as train_flow
from storage.lineage import LineageError, LineageStore
from storage.locks import stage_lock
from tasks.config import PipelineConfig, RegenerateConfig, ResourcesConfig
from tasks.ids import config_hash
from tasks.rounds import PipelineStuck, Round, UntilExtractionDone, run_rounds  # noqa: F401 (PipelineStuck: the CLI's)

GPU_LIMIT = "eagle3-gpus"
SERVER_LIMIT = "eagle3-server-slots"


@dataclass
class StageRun:
    stage: str
    state: str  # ran | skipped
    seconds: float
    detail: str


@dataclass
class PipelineSummary:
    run_id: str
    workspace: str
    lineage_db: str
    rounds: int = 0
    stages: list[StageRun] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    seconds: float = 0.0


def server_slots_needed(regenerate: RegenerateConfig | None) -> int:
    """Requests regenerate keeps in flight: its endpoints' total, 1 for the embedded llama.cpp server."""
    if regenerate is None:
        return 0
    if regenerate.embedded_server is not None:
        return 1
    return sum(e.max_concurrency for e in regenerate.endpoints)


def ensure_concurrency_limits(resources: ResourcesConfig, regenerate: RegenerateConfig | None) -> dict[str, int]:
    """Create (or resize) the global concurrency limits on the Prefect server; returns their sizes."""
    from prefect.client.orchestration import get_client

    sizes = {GPU_LIMIT: resources.gpus,
             SERVER_LIMIT: resources.server_slots or max(server_slots_needed(regenerate), 1)}
    with get_client(sync_client=True) as client:
        for name, limit in sizes.items():
            client.upsert_global_concurrency_limit_by_name(name, limit)
    return sizes


# How long a stage waits for its slots before each warning that says who holds them and how to free them.
WAIT_WARNING_SECONDS = 60.0


def slots_in_use(name: str) -> tuple[int, int]:
    """(active slots, limit) of a global concurrency limit, as the Prefect server counts them."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
    return limit.active_slots, limit.limit


def waiting_message(name: str, waited_s: float) -> str:
    active, limit = slots_in_use(name)
    return (f"waited {waited_s:.0f} s for a slot of the Prefect concurrency limit {name!r}: {active} of {limit} "
            "in use. Another eagle3 stage holds them, or a process killed while it held them whose lease the "
            "Prefect server lost (a server that keeps leases in memory loses them when it restarts, and never "
            f"frees those slots). If no other stage is running: prefect gcl update {name} --active-slots 0")


@contextmanager
def held(name: str, occupy: int, sizes: dict[str, int], resources: ResourcesConfig) -> Iterator[None]:
    """Hold `occupy` slots of a global limit (never more than it has) while the block runs.

    Waits up to `resources.wait_seconds` (None: for ever), with a warning every WAIT_WARNING_SECONDS that
    names the limit, its use and the cure: a wait for slots nobody will release is otherwise silent."""
    from prefect.concurrency.sync import concurrency

    deadline = None if resources.wait_seconds is None else time.monotonic() + resources.wait_seconds
    started = time.monotonic()
    with ExitStack() as stack:
        while True:
            step = WAIT_WARNING_SECONDS if deadline is None else \
                max(0.1, min(WAIT_WARNING_SECONDS, deadline - time.monotonic()))
            try:
                stack.enter_context(concurrency(name, occupy=max(1, min(occupy, sizes[name])), timeout_seconds=step,
                                                lease_duration=resources.lease_seconds, strict=True))
                break
            except TimeoutError as e:
                message = waiting_message(name, time.monotonic() - started)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(message) from e
                _logger().warning(message)
        yield


def _logger():
    import logging

    try:
        return get_run_logger()
    except Exception:  # outside a flow run (a plain call, a test)
        return logging.getLogger("eagle3.pipeline")


@flow(name="pipeline", log_prints=True)
def pipeline(config: PipelineConfig) -> PipelineSummary:
    """discover -> regenerate -> rounds of (extract to the disk budget -> train) -> doctor + benchmark."""
    logger = get_run_logger()
    ws = Path(config.workspace)
    started = time.monotonic()
    with stage_lock(ws, "pipeline"):
        store = LineageStore(ws / "lineage.duckdb")
        sizes = ensure_concurrency_limits(config.resources, config.regenerate)
        with lineage_run(store, "pipeline", config) as run:
            summary = PipelineSummary(run_id=run.run_id, workspace=str(ws), lineage_db=str(store.path))
            _stages(config, store, sizes, summary, logger)
            summary.seconds = time.monotonic() - started
            summary.report = store.reports.pipeline(config.train.run_name if config.train else None)
            run.summary = {"rounds": summary.rounds, "stages": [asdict(s) for s in summary.stages]}
    create_table_artifact(key="pipeline-stages", table=[asdict(s) for s in summary.stages],
                          description=f"pipeline run {summary.run_id}: what each stage did")
    create_table_artifact(key="pipeline-summary", table=report_rows(summary.report),
                          description=f"pipeline totals in {summary.lineage_db}")
    return summary


def _stages(config: PipelineConfig, store: LineageStore, sizes: dict[str, int], summary: PipelineSummary,
            logger) -> None:
    res = config.resources
    planned = ["discover", "regenerate", "extract+train", "probe", "benchmark"]
    progress = create_progress_artifact(0.0, key="pipeline-progress", description="pipeline: stages done")

    def stage(name: str, fn, *args):
        print(f"== stage {name}")  # one line per stage in the run log (and on the console)
        t0 = time.monotonic()
        out = fn(*args)
        summary.stages.append(StageRun(name, "ran", round(time.monotonic() - t0, 1), _detail(out)))
        return out

    def skipped(name: str, why: str) -> None:
        print(f"== stage {name}: skipped ({why})")
        summary.stages.append(StageRun(name, "skipped", 0.0, why))

    def done(n: int) -> None:
        update_progress_artifact(progress, progress=100.0 * n / len(planned))

    if config.discover is not None:
        stage("discover", discover_flow, config.discover)
    else:
        skipped("discover", "no discover section")
    done(1)
    if config.regenerate is not None:
        with held(SERVER_LIMIT, server_slots_needed(config.regenerate), sizes, res):
            stage("regenerate", regenerate_flow, config.regenerate)
    else:
        skipped("regenerate", "no regenerate section")
    done(2)
    if config.extract is not None and config.train is not None:
        _rounds(config, sizes, summary, stage, logger, store, skipped)
    else:
        skipped("extract+train", "needs both extract and train sections")
    done(3)
    probe_cfg = config.probe_section()
    if probe_cfg is None:
        skipped("probe", "regenerate.selection is uniform and no probe section")
    else:
        # The next regenerate (selection: acceptance) draws where this draft accepts least.
        with held(GPU_LIMIT, 1, sizes, res):
            stage("probe", probe_flow, probe_cfg)
    done(4)
    _benchmark_latest(config, store, sizes, stage, skipped, "benchmark")
    done(5)


def _benchmark_latest(config: PipelineConfig, store: LineageStore, sizes: dict[str, int], stage, skipped,
                      name: str) -> None:
    """Benchmark the latest export (or the configured checkpoint) unless this config already measured it."""
    bench = config.bench_section()
    latest = store.checkpoints.find(bench.checkpoint) if bench.checkpoint else store.checkpoints.find(fmt="sglang")
    if latest is None:
        raise LineageError("no exported draft to benchmark: the train stage exported none")
    already = store.benchmarks.completed(latest["checkpoint"], config_hash(bench))
    if already:
        skipped(name, f"checkpoint {latest['checkpoint']} already benchmarked ({already})")
    else:
        with held(GPU_LIMIT, 1, sizes, config.resources):
            stage(name, benchmark_flow, bench)


def _rounds(config: PipelineConfig, sizes: dict[str, int], summary: PipelineSummary, stage, logger,
            store: LineageStore | None = None, skipped=None) -> None:
    """The extract -> train rounds (tasks/rounds.py), each stage holding a GPU slot.

    With `benchmark.every_round`, each round's new export is benchmarked right after it (one point of
    the acceptance curve per round).
    """
    assert config.extract is not None and config.train is not None
    res = config.resources

    def extract(number: int, limit: int | None):
        summary.rounds = number
        with held(GPU_LIMIT, 1, sizes, res):
            return stage(f"extract (round {number})", extract_flow, config.extract)

    def train(number: int):
        with held(GPU_LIMIT, 1, sizes, res):
            return stage(f"train (round {number})", train_flow, config.train)

    def benchmark(r: Round) -> None:
        bench = config.bench_section()
        if store is not None and bench.every_round and not bench.checkpoint and r.trained.exports:
            _benchmark_latest(config, store, sizes, stage, skipped, f"benchmark (round {r.number})")

    done = run_rounds(extract, train, UntilExtractionDone(config.extract.disk_budget_bytes, config.train.run_name),
                      max_rounds=config.max_rounds, after_round=benchmark)
    if done.stopped_by == "max_rounds":
        logger.info("stopping after %d rounds (max_rounds); the next run continues", done.rounds)


# What a person checks first in each stage's summary, in this order.
DETAIL_FIELDS = ("records_in", "stored_prompts", "generated", "failed", "pending_at_start", "extracted", "quarantined",
                 "shards_written", "stopped_by", "steps_this_run", "shards_deleted", "acceptance")


def _detail(out) -> str:
    """One line of what a stage did, from its summary dataclass."""
    d = asdict(out) if hasattr(out, "__dataclass_fields__") else {}
    parts = []
    for k in DETAIL_FIELDS:
        v = d.get(k)
        if v is None or v == {}:
            continue
        if isinstance(v, dict):  # acceptance per drafter
            v = ", ".join(f"{a}={b:.2f}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items())
        parts.append(f"{k}={v}")
    return "; ".join(parts)


def report_rows(r: dict) -> list[dict]:
    """The closing summary as (what, value) rows: the Prefect table artifact and `eagle3 run`'s table."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.1f} MiB"  # noqa: E731
    train = r.get("train") or {}
    acc = train.get("accuracy") or []
    cond = train.get("conditional_accuracy") or []
    accept = r.get("acceptance") or {}
    rows = [
        ("records in", r["records_in"]),
        ("records kept / exact dup / near dup / contaminated / quarantined",
         " / ".join(str(r["record_outcomes"].get(k, 0))
                    for k in ("kept", "exact_duplicate", "near_duplicate", "contaminated", "quarantined"))),
        ("records held out for evaluation (heldout_chat)", r["record_outcomes"].get("heldout", 0)),
        ("generations (completion tokens)", f"{r['generations']} ({r['completion_tokens']:,})"),
        ("prompts failed at the server", r["failed_prompts"]),
        ("samples extracted / quarantined / skipped",
         " / ".join(str(r["samples"].get(k, 0)) for k in ("extracted", "quarantined", "skipped"))),
        ("tokens extracted (loss-masked)", f"{r['tokens']:,} ({r['masked_tokens']:,})"),
        ("shards written (deleted after training)",
         f"{sum(r['shards'].values())} ({r['shards'].get('deleted', 0)}), {mib(r['shard_bytes_written'])}"),
        ("peak disk / budget", f"{mib(r['peak_disk_bytes'])} / {mib(r['disk_budget_bytes'])}"),
        ("training run, step", f"{train.get('run_name', '-')}, {train.get('step', '-')}"),
        ("training accuracy, steps 0..k (last logged)", ", ".join(f"{a:.2f}" for a in acc) or "-"),
        ("conditional accuracy, steps 0..k", ", ".join(f"{a:.2f}" for a in cond) or "-"),
        ("exported draft", (r.get("checkpoint") or {}).get("path", "-")),
    ]
    for drafter, label in (("eagle3", "acceptance length: EAGLE-3 draft"),
                           ("eagle3-final-state-only", "  baseline: same draft, final state only (EAGLE flag)"),
                           ("prompt-lookup", "  baseline: prompt lookup (n-gram)")):
        v = accept.get(drafter)
        rows.append((label, "-" if v is None else f"{v:.2f}"))
    return [{"what": k, "value": str(v)} for k, v in rows]
