"""Our EAGLE-3 draft served by vLLM's own EAGLE-3, against vLLM without speculation and vLLM's n-gram method.

One run, one server at a time, on the same held-out chat prompts (a workspace's `heldout_chat`, rendered
with the serving chat template, sent as token ids), greedy: vLLM alone, our draft at each k of
`--ks`, vLLM's n-gram (prompt lookup) at `--ngram-k`; each at every concurrency of `--concurrency`;
then vLLM alone again (a warning if the machine's speed changed meanwhile). Every output is checked
against the baseline's ids (lossless), acceptance and acceptance by position come from vLLM's own
per-request counters, and the break-even acceptance per k is measured from each config's verify
round cost. The offline evaluator's acceptance for the same draft, prompts and k is read from the
scaling or selection study's results when the draft is one of their points, else measured here (`--offline`).

The draft: a speculators export, or an SGLang export (the scaling study writes those), converted here
once into `<draft>-speculators` through the project's own export (serving/vllm/export.py).

Run (after `make install vllm`):
    .venv/bin/python -m benchmarks.vllm_serving --workspace runs/scaling --draft PATH [--ks 1 2 3 4]
        [--concurrency 1 4] [--prompts 32] [--max-new 64] [--dtype bfloat16] [--offline]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspace", type=Path, default=ROOT / "runs" / "scaling", help="its held-out chat prompts")
    ap.add_argument("--draft", type=Path, required=True, help="the draft: a speculators or SGLang export folder")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4], help="draft tokens per verify round")
    ap.add_argument("--ngram-k", type=int, default=3, help="vLLM's n-gram method's draft tokens (0: none)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--offline", action="store_true", help="measure the offline evaluator here at every k")
    ap.add_argument("--compile", action="store_true", help="without --enforce-eager (torch.compile; slow starts)")
    args = ap.parse_args()

    from serving.bench.engines import VllmEngine, agreement, agreement_line, plot_engine_benchmark, run_engine_benchmark
    from serving.vllm.extract_server import VllmEngineArgs
    from storage.lineage import LineageStore
    from tasks.evaluate.offline import prompts_for_benchmark
    from tasks.evaluate.heldout import heldout_set
    from tasks.model.target import load_configured_target, load_configured_target_files

    files = load_configured_target_files(None, None, dtype=args.dtype)
    model, tokenizer, identity = load_configured_target(None, None, dtype="float32", device="cpu")
    held = heldout_set(LineageStore(args.workspace / "lineage.duckdb").discover.heldout_prompts())
    if held is None:
        raise SystemExit(f"{args.workspace}: no held-out chat prompts (run discover there first)")
    prompts = [p.input_ids for p in prompts_for_benchmark(tokenizer, identity.chat_template, [held], args.prompts)]
    draft = speculators_folder(args.draft, files.folder)
    offline: dict[int, float] = {}
    for k in args.ks:
        value = offline_from_study(args.draft, k, args.max_new, len(prompts))
        if value is None and args.offline:
            value = measure_offline(model, tokenizer, identity.chat_template, draft, held, len(prompts), k, args.max_new)
        if value is not None:
            offline[k] = value
    context = max(len(p) for p in prompts) + args.max_new + 16  # the longest prompt, its answer, k drafts
    engine = VllmEngine(VllmEngineArgs(model=files.folder, dtype=args.dtype, max_model_len=context,
                                       max_num_seqs=max(args.concurrency), enforce_eager=not args.compile))
    print(f"vLLM ({args.dtype}) on {files.folder}: baseline, {draft} at k={args.ks}, n-gram k={args.ngram_k}; "
          f"{len(prompts)} held-out chat prompts x {args.max_new} new tokens, concurrency {args.concurrency}; "
          f"load {load()}", flush=True)
    started = time.monotonic()

    def progress(report, result) -> None:
        for lv in result.levels:
            print(f"  {report.label} at concurrency {lv.concurrency}: {lv.output_tok_s:.1f} tok/s, acceptance "
                  f"{lv.accept_length_token_weighted}, started in {report.startup_s or 0:.0f} s", flush=True)

    logs = ROOT / "runs" / "vllm-serving-logs"
    bench = run_engine_benchmark(engine, prompts, draft=draft, draft_tokens=args.ks, ngram=args.ngram_k > 0,
                                 ngram_k=max(args.ngram_k, 1), concurrency=args.concurrency,
                                 max_new_tokens=args.max_new, log_dir=logs, on_config=progress)
    rows = bench.rows()
    table(f"vLLM {rows[0]['server_build']} ({args.dtype}), greedy, {len(prompts)} held-out chat prompts x "
          f"{args.max_new} new tokens; load {load()}",
          ["config", "c", "tok/s", "vs baseline", "accept", "offline", "by position", "ms/round", "break-even",
           "lossless"],
          [[r["config"], r["concurrency"], r["output_tok_s"], f"{r['speedup_vs_baseline']:.3f}x",
            r["acceptance"] or "-", offline.get(r["k"], "-") if r["drafter"] == "eagle3" else "-",
            "/".join(f"{x:.2f}" for x in r["accept_rate_by_position"] or []) or "-",
            r["ms_per_verify_round"] or "-", r["accept_needed"] or "-", r["lossless"] or "-"] for r in rows])
    lines = bench.verdict() + [agreement_line(agreement(rows, k, offline.get(k)), k) for k in args.ks if k in offline]
    for line in lines:
        print(line)
    png = RESULTS.parent / f"vllm-serving-{dt.date.today().isoformat()}.png"
    plot_engine_benchmark(rows, png, offline=offline or None, title=f"vLLM {rows[0]['server_build']} ({args.dtype})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps({"recorded_at": dt.datetime.now(dt.timezone.utc).isoformat(), "draft": str(args.draft),
                            "dtype": args.dtype, "compiled": args.compile, "prompts": len(prompts),
                            "max_new_tokens": args.max_new,
                            "offline": offline, "rows": rows, "verdict": lines,
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
