"""The `benchmark` flow: the serving contract first, then acceptance (offline) and speed (online).

Orchestration only: pick the draft (the latest export in lineage, or the one named), refuse it
unless the doctor passes, measure offline acceptance with the baselines in the same table (prompt
lookup, and the same draft fed only the final state, i.e. what `--speculative-algorithm EAGLE`
produces) on HumanEval, the workspace's held-out chat prompts (`heldout_chat`) and named sets,
optionally benchmark running servers (probe first, then every concurrency level, then
break-even), optionally start llama.cpp's llama-server here and measure the draft's GGUF export on
it (`serving`: the baseline, the draft at each K, n-gram drafting; lossless check, break-even, and
online vs offline acceptance), and store every number in `benchmark_results` linked to the
checkpoint, with Prefect table artifacts and PNG plots, the workspace's acceptance curve
(reports/acceptance_curve.png, from the view `acceptance_curve`) among them. The measuring is in
tasks/evaluate/offline.py, serving/bench/online.py and serving/bench/engines.py.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.runinfo import lineage_run
from storage.lineage import LineageError, LineageStore
from tasks.config import BenchConfig
from tasks.model.target import load_configured_target


class ContractFailed(RuntimeError):
    """The draft fails the serving contract: no benchmark number is produced for it."""


@dataclass
class BenchSummary:
    bench_id: str
    checkpoint: str | None = None
    draft_dir: str = ""
    doctor: str = ""
    k: int = 0
    rows: list[dict] = field(default_factory=list)
    acceptance: dict[str, float | None] = field(default_factory=dict)  # drafter -> token-weighted, all domains
    lossless_checked: int = 0  # outputs checked equal to the target's plain greedy output
    online_rows: list[dict] = field(default_factory=list)
    break_even: list[dict] = field(default_factory=list)
    throughput_png: str | None = None
    plot_png: str | None = None
    serving_rows: list[dict] = field(default_factory=list)  # every engine: one row per (engine, config, concurrency)
    serving_lines: list[str] = field(default_factory=list)  # verdict, break-even, lossless, online vs offline
    serving_png: str | None = None  # the first engine's plot
    serving_pngs: dict[str, str] = field(default_factory=dict)  # engine -> its plot
    draft_gguf: str | None = None
    draft_speculators: str | None = None
    curve_png: str | None = None  # the workspace's acceptance curve (reports/acceptance_curve.png), redrawn


@flow(name="benchmark", log_prints=True)
def benchmark(config: BenchConfig) -> BenchSummary:
    """Check the draft against the serving contract, then measure acceptance against the baselines."""
    logger = get_run_logger()
    ws = Path(config.workspace)
    store = LineageStore(ws / "lineage.duckdb")
    with lineage_run(store, "benchmark", config) as run:
        summary = _benchmark(config, store, run.run_id, logger)
        run.summary = {k: v for k, v in asdict(summary).items() if k != "rows"}
    return summary


def _benchmark(config: BenchConfig, store: LineageStore, run_id: str, logger) -> BenchSummary:
    from serving.doctor import expected_aux_layer_ids_from_lineage, run_doctor
    from serving.sglang.export import load_sglang
    from tasks.evaluate.offline import benchmark_sets, offline_acceptance
    from tasks.evaluate.curve import acceptance_curve_png
    from tasks.evaluate.heldout import heldout_set

    row = store.checkpoints.find(config.checkpoint) if config.checkpoint else store.checkpoints.find(fmt="sglang")
    draft_dir = Path(config.checkpoint) if config.checkpoint else Path(row["path"]) if row else None
    if draft_dir is None:
        raise LineageError("no exported draft in this workspace: run `eagle3 train` first, or name `checkpoint`")
    summary = BenchSummary(bench_id=uuid.uuid4().hex[:16], checkpoint=row["checkpoint"] if row else None,
                           draft_dir=str(draft_dir), k=config.draft_tokens)
    t = config.target
    model, tokenizer, identity = load_configured_target(t.gguf, t.model_path, t.revision, t.trust_remote_code, t.dtype,
                                                        t.device)
    # The contract before any number: a draft the server would run wrong has no acceptance to report.
    expected = expected_aux_layer_ids_from_lineage(store.path, draft_dir) if store.path.exists() else None
    report = run_doctor(draft_dir, model.config.to_dict(), engine="sglang", expected_aux_layer_ids=expected)
    if not report.passed:
        raise ContractFailed(f"{draft_dir} fails the serving contract; not benchmarked:\n"
                             + "\n".join(report.failure_lines()))
    summary.doctor = report.summary_line()
    logger.info(summary.doctor)
    # Before any measuring: a serving benchmark without the draft each engine loads fails now, not after the
    # offline numbers; and what each engine will load passes that engine's contract (llama.cpp: the GGUF, layer
    # ids as layer inputs, d2t ...; vLLM: the speculators export).
    engines = _serving_drafts(config, store, row) if config.serving is not None else {}
    for engine, (_, engine_draft) in engines.items():
        engine_report = run_doctor(engine_draft, model.config.to_dict(), engine=engine, expected_aux_layer_ids=expected)
        if not engine_report.passed:
            raise ContractFailed(f"{engine_draft} fails {engine}'s serving contract; not benchmarked:\n"
                                 + "\n".join(engine_report.failure_lines()))
        summary.doctor += "; " + engine_report.summary_line()
        logger.info(engine_report.summary_line())

    draft = load_sglang(draft_dir, embed_tokens=model.get_input_embeddings().weight.detach(),
                        expected_aux_layer_ids=expected).to(model.device).eval()
    sets = benchmark_sets(config.humaneval, [(e.name, e.path) for e in config.eval_sets])
    held = heldout_set(store.discover.heldout_prompts()) if config.heldout else None
    if held is not None:  # the workspace's held-out chat prompts, next to HumanEval, same serving template
        sets.insert(1 if config.humaneval else 0, held)
        logger.info("domain %s: %d held-out prompts (%d benchmarked)", held[0], len(held[1]),
                    min(len(held[1]), config.prompts_per_domain))
    acceptance = offline_acceptance(model, tokenizer, draft, chat_template=identity.chat_template, sets=sets,
                                    limit=config.prompts_per_domain, k=config.draft_tokens,
                                    max_new_tokens=config.max_new_tokens, baselines=config.baselines)
    summary.lossless_checked = acceptance.lossless_checked
    logger.info("lossless: %d outputs equal the target's greedy output token for token", acceptance.lossless_checked)
    summary.rows = acceptance.to_rows()
    summary.acceptance = {a.drafter: a.acceptance_length_token_weighted for a in acceptance.aggregates
                          if a.domain == "all"}
    store.benchmarks.write_results(run_id, [{
        "bench_id": summary.bench_id, "checkpoint": summary.checkpoint, "kind": "offline",
        "config_label": f"chain k={config.draft_tokens}", "drafter": a.drafter, "domain": a.domain,
        "concurrency": None, "requests": a.requests, "completion_tokens": a.completion_tokens,
        "verify_rounds": a.verify_rounds, "acceptance_token_weighted": a.acceptance_length_token_weighted,
        "acceptance_request_mean": a.acceptance_length_request_mean,
        "acceptance_by_position": [r if r is not None else float("nan") for r in a.position_accept_rate],
        "output_tok_s": None, "ttft_p50_s": None,
        "details": {"tokens_per_verify_round": a.tokens_per_verify_round, "max_new_tokens": config.max_new_tokens}}
        for a in acceptance.aggregates])
    if config.online is not None:
        summary.online_rows = _online(config, store, run_id, summary, sets, tokenizer, identity.chat_template, logger)
    for engine, (engine_target, engine_draft) in engines.items():
        _serving(config, store, run_id, summary, engine, engine_target, engine_draft, sets, tokenizer,
                 identity.chat_template, summary.acceptance.get("eagle3"), expected, logger)
    png = store.path.parent / "reports" / "benchmark" / f"{summary.bench_id}-acceptance.png"
    summary.plot_png = str(acceptance_png(acceptance, png))
    curve = acceptance_curve_png(store.benchmarks.acceptance_curve(), store.path.parent / "reports" / "acceptance_curve.png")
    if curve is not None:
        summary.curve_png = str(curve.path)
        logger.info("acceptance curve on %s (%s): %s", curve.domain, curve.config_label, curve.path)
    _artifacts(summary)
    return summary


def _online(config: BenchConfig, store: LineageStore, run_id: str, summary: BenchSummary, sets, tokenizer, template,
            logger) -> list[dict]:
    """Probe each speculative server, then every config at every concurrency, then break-even."""
    import asyncio

    from serving.bench.online import ServerConfig, plot_throughput, probe_acceptance, run_online_benchmark
    from tasks.evaluate.offline import prompts_for_benchmark

    online = config.online
    assert online is not None
    prompts = [p.text for p in prompts_for_benchmark(tokenizer, template, sets, config.prompts_per_domain)]
    servers = [ServerConfig(s.label, speculative=s.speculative, url=s.url, api=s.api, num_draft_tokens=s.num_draft_tokens)
               for s in [online.baseline.model_copy(update={"speculative": False}), *online.speculative]]

    async def run():
        for s in servers[1:]:  # a launch that does not speculate well stops here, with the likely causes
            probe = await probe_acceptance(s, prompts, online.probe_threshold, n_prompts=online.probe_prompts,
                                           num_draft_tokens=s.num_draft_tokens)
            logger.info("probe %s: acceptance %.2f", s.label, probe.accept_length_token_weighted)
        return await run_online_benchmark(None, prompts, servers, online.concurrency, online.max_new_tokens)

    result = asyncio.run(run())
    rows = result.to_rows(servers[0].label)
    breakeven = result.break_even(servers[0].label).to_rows() if len(servers) > 1 else []
    store.benchmarks.write_results(run_id, [{
        "bench_id": summary.bench_id, "checkpoint": summary.checkpoint, "kind": "online", "config_label": r["config"],
        "drafter": "server", "domain": "all", "concurrency": r["concurrency"], "requests": r["requests"],
        "completion_tokens": r["completion_tokens"], "verify_rounds": r["spec_verify_ct"],
        "acceptance_token_weighted": r["accept_len_token_weighted"],
        "acceptance_request_mean": r["accept_len_request_mean"], "acceptance_by_position": None,
        "output_tok_s": r["output_tok_s"], "ttft_p50_s": (r["ttft_p50_ms"] or 0) / 1000 if r["ttft_p50_ms"] else None,
        "details": {**r, "break_even": [b for b in breakeven if b.get("config") == r["config"]
                                        and b.get("concurrency") == r["concurrency"]]}} for r in rows])
    png = store.path.parent / "reports" / "benchmark" / f"{summary.bench_id}-throughput.png"
    summary.throughput_png = str(plot_throughput(result, png, baseline=servers[0].label))
    summary.break_even = breakeven
    return rows


def _serving(config: BenchConfig, store: LineageStore, run_id: str, summary: BenchSummary, engine_name: str,
             target: Path, draft: Path, sets, tokenizer, template, offline_acceptance: float | None,
             expected: list[int] | None, logger) -> None:
    """One engine started here: the baseline, the draft at each K, the engine's n-gram drafting; rows, plot, verdict."""
    from serving.bench.engines import LlamaCppEngine, plot_engine_benchmark, run_engine_benchmark
    from serving.bench.verdict import ENGINE_NAMES, agreement, agreement_line
    from tasks.evaluate.offline import prompts_for_benchmark

    serving = config.serving
    assert serving is not None
    prompts = [p.input_ids for p in prompts_for_benchmark(tokenizer, template, sets, config.prompts_per_domain)]
    sweep = serving.sweep(config.draft_tokens)
    max_new = serving.max_new_tokens or config.max_new_tokens
    check_server = None
    if engine_name == "llamacpp":
        summary.draft_gguf = str(draft)
        engine = LlamaCppEngine(target, parallel=serving.parallel, n_threads=serving.n_threads, n_ctx=serving.n_ctx)
        ngram = serving.ngram
    else:
        summary.draft_speculators = str(draft)
        engine, ngram = _vllm_engine(serving.vllm, target), serving.vllm.ngram
        check_server = _refuse_unlike_trained(draft, expected)
    name = ENGINE_NAMES[engine_name]
    logger.info("%s on %s: baseline, EAGLE-3 %s at k=%s, %s n-gram drafting; %d prompts, %d new tokens, concurrency "
                "%s", name, target, draft, sweep, "with" if ngram else "no", len(prompts), max_new, serving.levels())

    def progress(report, result) -> None:
        for lv in result.levels:
            logger.info("%s %s (%s) at concurrency %d: %.1f tok/s, acceptance %s", name, report.label,
                        report.server_build, lv.concurrency, lv.output_tok_s, lv.accept_length_token_weighted)

    logs = store.path.parent / "reports" / "benchmark" / f"{summary.bench_id}-servers"
    bench = run_engine_benchmark(engine, prompts, draft=draft, draft_tokens=sweep, ngram=ngram,
                                 ngram_k=serving.ngram_tokens, concurrency=serving.levels(), max_new_tokens=max_new,
                                 warmup=serving.warmup, log_dir=logs, recheck_baseline=serving.recheck_baseline,
                                 on_config=progress, check_server=check_server)
    rows = bench.rows()
    agree = agreement(rows, config.draft_tokens, offline_acceptance)
    summary.serving_rows += rows
    note = "" if max_new == config.max_new_tokens else \
        f"; not the same length: {max_new} new tokens online, {config.max_new_tokens} offline"
    lines = bench.verdict() + [agreement_line(agree, config.draft_tokens, note)]
    summary.serving_lines += [f"{name}: {line}" for line in lines]
    for line in lines:
        logger.info("%s: %s", name, line)
    store.benchmarks.write_results(run_id, [{
        "bench_id": summary.bench_id, "checkpoint": summary.checkpoint, "kind": "serving",
        "config_label": f"{engine_name}/{r['config']}", "drafter": r["drafter"], "domain": "all",
        "concurrency": r["concurrency"], "requests": r["requests"], "completion_tokens": r["completion_tokens"],
        "verify_rounds": r["verify_rounds"], "acceptance_token_weighted": r["acceptance"],
        "acceptance_request_mean": r["acceptance_request_mean"],
        "acceptance_by_position": r["accept_rate_by_position"], "output_tok_s": r["output_tok_s"],
        "ttft_p50_s": _seconds(r["ttft_p50_ms"]), "ttft_p90_s": _seconds(r["ttft_p90_ms"]),
        "server_build": r["server_build"],
        "details": {**r, "draft": str(draft), "target": str(target),
                    "offline_agreement": agree if r["drafter"] == "eagle3" and r["k"] == config.draft_tokens
                    and r["concurrency"] == 1 else None}} for r in rows])
    png = store.path.parent / "reports" / "benchmark" / f"{summary.bench_id}-serving-{engine_name}.png"
    offline = {config.draft_tokens: offline_acceptance} if offline_acceptance is not None else None
    summary.serving_pngs[engine_name] = str(plot_engine_benchmark(
        rows, png, offline=offline, title=f"{name} {rows[0]['server_build'] if rows else ''}"))
    summary.serving_png = summary.serving_png or summary.serving_pngs[engine_name]


def _refuse_unlike_trained(draft: Path, expected: list[int] | None):
    """Right after a vLLM server starts: what vLLM itself says it loaded must be the draft as trained."""
    from serving.vllm.doctor_live import failed_loaded_checks

    def check(ec, server) -> None:
        failed = failed_loaded_checks(server, expected)
        if failed:
            raise ContractFailed(f"vLLM loaded {draft} other than it was trained ({ec.label}); not benchmarked:\n"
                                 + "\n".join(f"{c.name}: {c.message}" for c in failed))
    return check


def _vllm_engine(v, target: Path):
    """vLLM's engine from `benchmark.serving.vllm`."""
    from serving.bench.engines import VllmEngine
    from serving.vllm.extract_server import VllmEngineArgs, default_vllm_python

    args = VllmEngineArgs(model=target, dtype=v.dtype, max_model_len=v.max_model_len, max_num_seqs=v.max_num_seqs,
                          cpu_kvcache_space_gib=v.cpu_kvcache_space_gib, enforce_eager=v.enforce_eager,
                          python=Path(v.python) if v.python else default_vllm_python(), extra_args=tuple(v.extra_args))
    return VllmEngine(args, startup_timeout_s=v.startup_timeout_s, prompt_lookup=(v.prompt_lookup_min,
                                                                                  v.prompt_lookup_max))


def _serving_drafts(config: BenchConfig, store: LineageStore, row: dict | None) -> dict[str, tuple[Path, Path]]:
    """Per engine of `benchmark.serving.engines`: the target it serves and the draft it loads (each checked to exist)."""
    serving = config.serving
    assert serving is not None
    out = {}
    for engine in serving.engines:
        out[engine] = _serving_ggufs(config, store, row) if engine == "llamacpp" else _vllm_paths(config, store, row)
    return out


def _serving_ggufs(config: BenchConfig, store: LineageStore, row: dict | None) -> tuple[Path, Path]:
    """The target GGUF llama-server serves, and the draft's GGUF export (the checkpoint's, from lineage)."""
    from tasks.model.target import smollm2_gguf_path

    serving = config.serving
    assert serving is not None
    t = config.target
    if serving.target_gguf or t.gguf:
        target = Path(serving.target_gguf or t.gguf)
    elif t.model_path is None:
        target = smollm2_gguf_path()
    else:
        raise LineageError(f"benchmark.serving needs the target as a GGUF for llama-server: the target is "
                           f"{t.model_path}; set benchmark.serving.target_gguf")
    draft = Path(serving.draft_gguf) if serving.draft_gguf else \
        _lineage_export(config, store, row, "gguf", "benchmark.serving.draft_gguf")
    if draft.is_dir():
        from serving.llamacpp.export import GGUF_FILE

        draft = draft / GGUF_FILE
    for what, path in (("target", target), ("draft", draft)):
        if not path.is_file():
            raise LineageError(f"benchmark.serving: the {what} GGUF {path} does not exist")
    return target, draft


def _lineage_export(config: BenchConfig, store: LineageStore, row: dict | None, fmt: str, setting: str) -> Path:
    """The benchmarked checkpoint's export in format `fmt` (same training run and step), from lineage."""
    if row is None:
        raise LineageError(f"benchmark.serving needs the draft as {fmt}: {config.checkpoint} is not a checkpoint "
                           f"registered in lineage, so no {fmt} export of it is known; set {setting}")
    export = store.checkpoints.export_of(row["run_name"], row["step"], fmt)
    if export is None:
        raise LineageError(f"benchmark.serving needs the draft as {fmt}: lineage has no {fmt} export of "
                           f"{row['checkpoint']} (training run {row['run_name']!r}, step {row['step']}); train with "
                           f"export_formats including {fmt}, or set {setting}")
    return Path(export["path"])


def _vllm_paths(config: BenchConfig, store: LineageStore, row: dict | None) -> tuple[Path, Path]:
    """The target's transformers folder vLLM serves, and the draft's speculators export (the checkpoint's, from lineage)."""
    from tasks.model.target import load_configured_target_files

    serving = config.serving
    assert serving is not None
    t = config.target
    target = load_configured_target_files(t.gguf, t.model_path, t.revision, t.trust_remote_code,
                                          serving.vllm.dtype).folder
    draft = Path(serving.vllm.draft) if serving.vllm.draft else \
        _lineage_export(config, store, row, "speculators", "benchmark.serving.vllm.draft")
    if not (draft / "config.json").is_file():
        raise LineageError(f"benchmark.serving (vllm): the draft folder {draft} has no config.json")
    return target, draft


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def acceptance_png(report, path: Path) -> Path:
    """Acceptance rate by draft position, one line per drafter (all domains)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for a in report.aggregates:
        if a.domain != "all":
            continue
        rates = [r if r is not None else 0.0 for r in a.position_accept_rate]
        al = a.acceptance_length_token_weighted
        ax.plot(range(1, len(rates) + 1), rates, marker="o",
                label=f"{a.drafter} (acceptance length {al:.2f})" if al is not None else a.drafter)
    ax.set_xticks(range(1, report.k + 1))  # positions are whole numbers: no 1.5 between them
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted per verify round")
    ax.set_ylim(0, 1)
    ax.set_title(f"offline acceptance, chain k={report.k}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _artifacts(summary: BenchSummary) -> None:
    from serving.bench.verdict import ENGINE_NAMES

    create_table_artifact(key="benchmark-acceptance", table=summary.rows,
                          description=f"offline acceptance of {summary.checkpoint or summary.draft_dir} "
                                      "(acceptance length = completion tokens / verify rounds, token-weighted "
                                      "and per-request mean)")
    if summary.online_rows:
        create_table_artifact(key="benchmark-online", table=summary.online_rows,
                              description="online: tok/s, TTFT, acceptance (token-weighted and per-request mean)")
    if summary.break_even:
        create_table_artifact(key="benchmark-break-even", table=summary.break_even,
                              description="acceptance length needed to beat the baseline, per config")
    if summary.serving_rows:
        create_table_artifact(key="benchmark-serving", table=summary.serving_rows,
                              description="engines started here (llama.cpp's llama-server, vLLM), greedy: tok/s, "
                                          "TTFT, acceptance (completion tokens / target forwards after the prefill, "
                                          "token-weighted, from the engine's own counters), draft tokens "
                                          "accepted/proposed, lossless (ids equal to the same engine's baseline), "
                                          "break-even. " + " ".join(summary.serving_lines))
    for engine, png in summary.serving_pngs.items():
        data = base64.b64encode(Path(png).read_bytes()).decode()
        lines = [line for line in summary.serving_lines if line.startswith(ENGINE_NAMES[engine] + ":")]
        create_markdown_artifact(key=f"benchmark-serving-plot-{engine}", markdown=f"# {engine}\n\n"
                                 + "\n".join(f"- {line}" for line in lines)
                                 + f"\n\n![tok/s and acceptance by config](data:image/png;base64,{data})")
    if summary.curve_png:
        data = base64.b64encode(Path(summary.curve_png).read_bytes()).decode()
        create_markdown_artifact(key="acceptance-curve", markdown="# acceptance against training data\n\n"
                                 "`eagle3 sql \"SELECT * FROM acceptance_curve\"` has every point.\n\n"
                                 f"![acceptance curve](data:image/png;base64,{data})")
    if summary.plot_png:
        data = base64.b64encode(Path(summary.plot_png).read_bytes()).decode()
        create_markdown_artifact(key="benchmark-plot", markdown=f"# {summary.doctor}\n\n"
                                 f"![acceptance by position](data:image/png;base64,{data})")
