"""Our EAGLE-3 draft served by vLLM's own EAGLE-3, against vLLM without speculation and vLLM's n-gram method.

One run, one server at a time, on the same held-out chat prompts (a workspace's `heldout_chat`, rendered
with the serving chat template, sent as token ids), greedy: vLLM alone, each draft at each k of
`--ks`, vLLM's n-gram (prompt lookup) at each k of `--ngram-ks` and each window of `--prompt-lookup`; each at
every concurrency of `--concurrency`; then vLLM alone again (a warning if the machine's speed changed
meanwhile). `--passes 2` runs the whole sweep twice, one pass after the other (so a slow spell of the
machine falls on every config of a pass, not on one config twice), the second pass in reverse order after the
baseline (so a steady drift weighs every config alike in the mean), and reports each pass and their mean.
Every output is checked against the baseline's ids (lossless), acceptance and acceptance by position
come from vLLM's own per-request counters, and the break-even acceptance per k is measured from each
config's verify round cost. The offline evaluator's acceptance for the same draft, prompts and k is read from the
scaling or selection study's results when the draft is one of their points, else measured here (`--offline`).

The draft: a speculators export, or an SGLang export (the scaling study writes those), converted here
once into `<draft>-speculators` through the project's own export (serving/vllm/export.py).

Run (after `make install vllm`):
    .venv/bin/python -m benchmarks.vllm_serving --workspace runs/scaling --draft PATH [--ks 1 2 3 4]
        [--concurrency 1 4] [--prompts 32] [--max-new 64] [--dtype bfloat16] [--offline]
The goal measurement (issue 42: both drafts and the n-gram each at its best k and window, quiet machine; vLLM
compiled, as it serves by default, and with the Intel OpenMP its CPU build asks for, which every server here gets):
    .venv/bin/python -m benchmarks.vllm_serving --workspace runs/selection/recipe-data --dtype float32 \\
        --draft ours=EXPORT speculators=IMPORT --ks 1 2 3 --ngram-ks 1 2 3 --prompt-lookup 1:3 2:4 \\
        --concurrency 1 --prompts 64 --passes 2 --offline --compile
Results: a table and the verdict on stdout, one JSON line appended to benchmarks/results/vllm_serving.jsonl,
and a plot (PNG) beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from benchmarks.report import ROOT, load, table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "vllm_serving.jsonl"


def speculators_folder(draft: Path, target_folder: Path) -> Path:
    """`draft` itself if it is a speculators export, else its SGLang export converted once beside it."""
    from serving.draft_folder import SPECULATORS_ARCHITECTURE
    from serving.sglang.export import load_sglang
    from serving.vllm.export import export_speculators

    config = json.loads((draft / "config.json").read_text())
    if config.get("architectures") == [SPECULATORS_ARCHITECTURE]:
        return draft
    out = draft.parent / f"{draft.name}-speculators"
    if not (out / "config.json").is_file():
        export_speculators(load_sglang(draft), out, str(target_folder))
        print(f"converted {draft} to the speculators format: {out}", flush=True)
    return out


def offline_from_study(draft: Path, k: int, max_new: int, prompts: int) -> float | None:
    """The scaling or selection study's offline held-out chat acceptance of this export at k (same prompts)."""
    for path in (ROOT / "runs" / "scaling" / "reports" / "scaling.jsonl",
                 ROOT / "runs" / "selection" / "reports" / "selection.jsonl"):
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            try:
                point = json.loads(line)
            except json.JSONDecodeError:
                continue
            if Path(point.get("export", "")).resolve() == draft.resolve() and point.get("k") == k \
                    and point.get("eagle3_heldout_chat_requests") == prompts:
                return point.get("eagle3_heldout_chat")
    return None


def named_drafts(specs: list[str]) -> dict[str, Path]:
    """`--draft` values, `PATH` or `NAME=PATH`, by name ("" for a lone unnamed draft)."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        if name in out:
            raise SystemExit(f"--draft {spec}: the name {name!r} is given twice")
        out[name] = Path(path)
    if len(out) > 1 and "" in out:
        raise SystemExit("--draft: several drafts, so name each one, NAME=PATH")
    return out


def lookup_window(spec: str) -> tuple[int, int]:
    """`--prompt-lookup` values, `MIN:MAX` (the shortest and longest context suffix vLLM's n-gram matches)."""
    lo, sep, hi = spec.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r}: expected MIN:MAX, e.g. 1:3")
    return int(lo), int(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspace", type=Path, default=ROOT / "runs" / "scaling", help="its held-out chat prompts")
    ap.add_argument("--draft", nargs="+", required=True,
                    help="the draft(s): a speculators or SGLang export folder, or NAME=FOLDER for each of several")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4], help="draft tokens per verify round")
    ap.add_argument("--ngram-ks", type=int, nargs="*", default=[3],
                    help="vLLM's n-gram method's draft tokens, each a config (none or 0: no n-gram)")
    ap.add_argument("--prompt-lookup", type=lookup_window, nargs="+", default=[(1, 3)],
                    help="the n-gram's prompt-lookup windows MIN:MAX, each a config at every --ngram-ks")
    ap.add_argument("--passes", type=int, default=1,
                    help="run the whole sweep this many times, one after another (speeds on a CPU drift by ~8%%: "
                         "each pass is reported, and their mean)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--offline", action="store_true", help="measure the offline evaluator here at every k")
    ap.add_argument("--compile", action="store_true", help="without --enforce-eager: torch.compile, as vLLM serves by "
                    "default (the first start compiles for minutes, later ones read vLLM's compile cache)")
    args = ap.parse_args()

    from serving.bench.engines import (VllmEngine, pass_order, plot_engine_benchmark, run_engine_benchmark,
                                       vllm_sweep_configs)
    from serving.bench.verdict import agreement, agreement_line, draft_of, mean_over_passes, verdict_lines
    from serving.vllm.extract_server import VllmEngineArgs, intel_openmp_preload
    from storage.lineage import LineageStore
    from tasks.evaluate.offline import prompts_for_benchmark
    from tasks.evaluate.heldout import heldout_set
    from tasks.model.target import load_configured_target, load_configured_target_files

    given = named_drafts(args.draft)
    files = load_configured_target_files(None, None, dtype=args.dtype)
    model, tokenizer, identity = load_configured_target(None, None, dtype="float32", device="cpu")
    held = heldout_set(LineageStore(args.workspace / "lineage.duckdb").discover.heldout_prompts())
    if held is None:
        raise SystemExit(f"{args.workspace}: no held-out chat prompts (run discover there first)")
    prompts = [p.input_ids for p in prompts_for_benchmark(tokenizer, identity.chat_template, [held], args.prompts)]
    drafts = {name: speculators_folder(path, files.folder) for name, path in given.items()}
    offline: dict[str, dict[int, float]] = {}
    for name, path in given.items():
        for k in args.ks:
            value = offline_from_study(path, k, args.max_new, len(prompts))
            if value is None and args.offline:
                value = measure_offline(model, tokenizer, identity.chat_template, drafts[name], held, len(prompts), k,
                                        args.max_new)
            if value is not None:
                offline.setdefault(name, {})[k] = value
    context = max(len(p) for p in prompts) + args.max_new + 16  # the longest prompt, its answer, k drafts
    engine_args = VllmEngineArgs(model=files.folder, dtype=args.dtype, max_model_len=context,
                                 max_num_seqs=max(args.concurrency), enforce_eager=not args.compile)
    engine = VllmEngine(engine_args)
    configs = vllm_sweep_configs(drafts, args.ks, [k for k in args.ngram_ks if k > 0], args.prompt_lookup)
    # each EAGLE-3 row's draft name, from the labels the sweep gave its configs
    draft_name = {draft_of(c.label): c.speculation.name for c in configs if c.drafter == "eagle3"}
    mode = "compiled" if args.compile else "eager"

    def of(row: dict) -> str | None:
        return draft_name.get(draft_of(row["config"])) if row["drafter"] == "eagle3" else None
    print(f"vLLM ({args.dtype}, {mode}) on {files.folder}: "
          f"{', '.join(c.label for c in configs)}; {len(prompts)} held-out "
          f"chat prompts x {args.max_new} new tokens, concurrency {args.concurrency}, {args.passes} pass(es); "
          f"load {load()}", flush=True)
    started = time.monotonic()

    def progress(report, result) -> None:
        for lv in result.levels:
            print(f"  {report.label} at concurrency {lv.concurrency}: {lv.output_tok_s:.1f} tok/s, acceptance "
                  f"{lv.accept_length_token_weighted}, started in {report.startup_s or 0:.0f} s", flush=True)

    logs = ROOT / "runs" / "vllm-serving-logs"
    by_pass = []
    for i in range(args.passes):
        print(f"pass {i + 1} of {args.passes}", flush=True)
        bench = run_engine_benchmark(engine, prompts, configs=pass_order(configs, i), concurrency=args.concurrency,
                                     max_new_tokens=args.max_new, log_dir=logs, on_config=progress)
        by_pass.append(bench.rows())
        if args.passes > 1:
            for line in bench.verdict():
                print(f"  pass {i + 1}: {line}", flush=True)
    rows = mean_over_passes(by_pass)
    speeds = "tok/s" if args.passes == 1 else "tok/s (mean)"
    table(f"vLLM {rows[0]['server_build']} ({args.dtype}), greedy, {len(prompts)} held-out chat prompts x "
          f"{args.max_new} new tokens, {args.passes} pass(es); load {load()}",
          ["config", "c", speeds, "by pass", "vs baseline", "accept", "offline", "by position", "ms/round",
           "break-even", "lossless"],
          [[r["config"], r["concurrency"], r["output_tok_s"], "/".join(f"{x:.1f}" for x in r["output_tok_s_by_pass"]),
            f"{r['speedup_vs_baseline']:.3f}x", r["acceptance"] or "-", offline.get(of(r), {}).get(r["k"], "-"),
            "/".join(f"{x:.2f}" for x in r["accept_rate_by_position"] or []) or "-",
            r["ms_per_verify_round"] or "-", r["accept_needed"] or "-", r["lossless"] or "-"] for r in rows])
    lines = verdict_lines(rows)
    for name, by_k in offline.items():
        mine = [r for r in rows if r["drafter"] != "eagle3" or of(r) == name]
        lines += [agreement_line(agreement(mine, k, v), k, f" ({name})" if name else "") for k, v in by_k.items()]
    for line in lines:
        print(line)
    png = RESULTS.parent / f"vllm-serving-{dt.date.today().isoformat()}.png"
    plot_engine_benchmark(rows, png, offline=next(iter(offline.values()), None) if len(drafts) == 1 else None,
                          title=f"vLLM {rows[0]['server_build']} ({args.dtype}, {mode})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps({"recorded_at": dt.datetime.now(dt.timezone.utc).isoformat(),
                            "drafts": {name: str(p) for name, p in given.items()},
                            "dtype": args.dtype, "compiled": args.compile, "prompts": len(prompts),
                            "ld_preload": intel_openmp_preload(engine_args.python, os.environ.get("LD_PRELOAD", "")),
                            "max_new_tokens": args.max_new, "passes": args.passes,
                            "offline": offline, "rows": rows, "rows_by_pass": by_pass, "verdict": lines,
                            "wall_s": round(time.monotonic() - started, 1)}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    print(f"\n{RESULTS}\n{png}")


def measure_offline(model, tokenizer, template, draft: Path, held, n: int, k: int, max_new: int) -> float | None:
    """The offline evaluator's token-weighted acceptance of `draft` on the first `n` held-out prompts at k."""
    from tasks.evaluate.offline import offline_acceptance
    from serving.vllm.export import load_speculators

    loaded = load_speculators(draft, embed_tokens=model.get_input_embeddings().weight.detach()).eval()
    report = offline_acceptance(model, tokenizer, loaded, chat_template=template, sets=[held], limit=n, k=k,
                                max_new_tokens=max_new, baselines=False)
    return next((a.acceptance_length_token_weighted for a in report.aggregates if a.domain == "all"), None)


if __name__ == "__main__":
    main()
