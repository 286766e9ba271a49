"""How much acceptance a larger draft vocab can buy at most: the share of the target's own tokens it can produce.

A position whose target token has no draft id is never accepted, whatever the draft learns, so the draft vocab's
coverage of what the target actually says is a ceiling on acceptance at every position. This measures it for
several vocab sizes, each chosen as the pipeline chooses it (`build_draft_vocab`: the most frequent ids, an
unseen remainder filled by ascending id), from two counts: the recipe study's extraction (its loss-masked tokens)
and every answer in the packed answer cache (benchmarks/results/selection-answers.jsonl.gz, the larger corpus a
16K or 32K vocab would be drawn from). The tokens covered are the target's greedy outputs on the recipe study's
prompts (128 held-out chat, 164 HumanEval), read from the study's greedy-path file: the same tokens its
acceptance figures are measured on. No model runs; about a minute.

What a ceiling ratio r means for acceptance length: a draft that predicts the newly covered tokens as well as it
predicts the rest gains a factor r at each position, so a measured arm's acceptance by position P_j becomes
P_j * r^j and its length 1 + sum_j P_j r^j (`--arm`, from benchmarks/results/recipe.jsonl). That is generous: the
newly covered tokens are the rarer ones.

    .venv/bin/python -m benchmarks.studies.vocab_coverage [--workspace runs/selection/recipe-data]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
from pathlib import Path

import numpy as np

from benchmarks.report import RESULTS, ROOT, table
from benchmarks.studies.scaling_results import DOMAINS, append_result

PACK = ROOT / "benchmarks" / "results" / "selection-answers.jsonl.gz"


def answer_text(raw: str) -> str:
    """The completion text of a cached server answer (llama-server's /completion or an OpenAI chat reply)."""
    a = json.loads(raw)
    if "content" in a:
        return a["content"] or ""
    return (a.get("choices") or [{}])[0].get("message", {}).get("content") or ""


def pack_counts(pack: Path, tokenizer, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, np.int64)
    with gzip.open(pack, "rt") as f:
        for line in f:
            ids = tokenizer(answer_text(json.loads(line)["answer"]), add_special_tokens=False)["input_ids"]
            np.add.at(counts, ids, 1)
    return counts


def coverage(counts: np.ndarray, size: int, outputs: dict[str, list[int]]) -> dict[str, float]:
    """Share of each domain's output tokens that the `size` vocab chosen from `counts` can produce."""
    from tasks.extract.vocab import build_draft_vocab

    t2d = build_draft_vocab(counts, size).t2d
    return {dom: float(np.mean(t2d[np.asarray(ids)])) for dom, ids in outputs.items()}


def greedy_outputs(workspace: Path) -> dict[str, list[int]]:
    """Every domain's greedy output tokens from the recipe study's greedy-path file (the newest, if several)."""
    from tasks.evaluate.path_cache import load_paths

    files = sorted((workspace / "reports").glob("greedy-paths-*.safetensors"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"{workspace}/reports: no greedy-path file (run benchmarks.studies.recipe --paths-only)")
    out: dict[str, list[int]] = {dom: [] for dom in DOMAINS}
    for item, path in load_paths(files[-1]).items():
        out.setdefault(item.split("/")[0], []).extend(path.tokens[path.prompt_tokens:].tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspace", type=Path, default=ROOT / "runs" / "selection" / "recipe-data")
    ap.add_argument("--pack", type=Path, default=PACK, help="the packed answer cache: the larger corpus")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--arm", default="cosine-4ep", help="the recipe study's arm whose acceptance by position is scaled")
    args = ap.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from storage.lineage import LineageStore
    from tasks.model.target import load_configured_target_files

    settings = LineageStore(args.workspace / "lineage.duckdb").extraction.settings(None)
    if settings is None:
        raise SystemExit(f"{args.workspace}: no extraction")
    vocab = load_file(str(args.workspace / settings["vocab_file"]))
    extraction, trained_size = vocab["counts"].numpy(), len(vocab["d2t"])
    tokenizer = AutoTokenizer.from_pretrained(load_configured_target_files(None, None).folder)
    sources = {"extraction": extraction, "packed answers": pack_counts(args.pack, tokenizer, len(extraction))}
    outputs = greedy_outputs(args.workspace)
    rows = []
    for name, counts in sources.items():
        for size in args.sizes:
            cov = coverage(counts, size, outputs)
            rows.append({"counts_from": name, "counted_tokens": int(counts.sum()),
                         "distinct_seen": int(np.count_nonzero(counts)), "draft_vocab_size": size, **cov})
    # the ceiling of each vocab against the one the study's drafts were trained with
    reference = {d: coverage(extraction, trained_size, outputs)[d] for d in DOMAINS}
    from benchmarks.studies.recipe import load_points

    arm = load_points(RESULTS / "recipe.jsonl").get(f"{args.arm}/s0")
    if arm is None:
        raise SystemExit(f"{RESULTS / 'recipe.jsonl'}: no point {args.arm}/s0")
    for r in rows:
        for d in DOMAINS:
            pos = arm[f"eagle3_{d}_pos"]
            r[f"{args.arm}_{d}_scaled"] = 1 + sum(p * (r[d] / reference[d]) ** (j + 1) for j, p in enumerate(pos))
    measured = {d: 1 + sum(arm[f"eagle3_{d}_pos"]) for d in DOMAINS}
    tokens = ", ".join(f"{d}: {len(v):,} tokens" for d, v in outputs.items())
    table(f"draft-vocab coverage of the target's greedy outputs ({tokens}); ceiling x: against the trained "
          f"{trained_size:,}-token vocab",
          ["counts from", "counted", "distinct", "vocab", *DOMAINS, *(f"ceiling x, {d}" for d in DOMAINS),
           *(f"{args.arm} scaled, {d}" for d in DOMAINS)],
          [[r["counts_from"], f"{r['counted_tokens']:,}", f"{r['distinct_seen']:,}", r["draft_vocab_size"],
            *(f"{r[d]:.4f}" for d in DOMAINS), *(f"{r[d] / reference[d]:.3f}" for d in DOMAINS),
            *(f"{r[f'{args.arm}_{d}_scaled']:.3f} ({r[f'{args.arm}_{d}_scaled'] / measured[d]:.3f}x)" for d in DOMAINS)]
           for r in rows])
    append_result(RESULTS / "vocab_coverage.jsonl", {"recorded_at": dt.datetime.now(dt.timezone.utc).isoformat(),
                                                     "workspace": str(args.workspace), "arm": args.arm,
                                                     "trained_vocab": trained_size, "rows": rows})


if __name__ == "__main__":
    main()
