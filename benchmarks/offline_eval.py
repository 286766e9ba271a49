"""The offline evaluator before and after it was made lossless, on the same prompts, drafters and target.

- before: the code of commit 48940e8 (loaded from git): each verify round feeds the newest token
  and the k proposals to the target in one forward and takes their argmaxes; the draft in bf16.
  Its outputs are then compared, untimed, with the target's plain greedy decoding, to count the
  measured texts that were not the target's greedy text.
- after: this tree: one plain greedy decoding per prompt that every drafter's verification
  replays, every output checked equal to it (LossyDecoding otherwise), the draft in float32 on CPU.
Same target (SmolLM2-135M, bf16 by default, the benchmark's dtype), same prompts (ShareGPT chat and
HumanEval, chat-templated), same drafters (an EAGLE-3 draft, the same draft fed only the final
state, prompt lookup), same k and max_new_tokens. Reports wall time, after / before, divergent
outputs, and acceptance.

The draft: `--draft DIR` (an exported SGLang folder, e.g. the demo's), else a randomly initialised
one with the target's embeddings (acceptance ~1, but every round still verifies k+1 tokens at once,
which is where batched verification and one-token decoding part ways).

Run: .venv/bin/python -m benchmarks.offline_eval [--prompts 6] [--k 3] [--max-new-tokens 64] [--draft DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.fixtures import chat_prompts, random_draft  # the tests' random draft and ShareGPT chat prompts
from benchmarks.report import ROOT, load, table
from tasks.evaluate import offline as after_module
from tasks.evaluate.offline import HUMANEVAL, benchmark_sets, first_difference, prompts_for_benchmark, target_greedy
from tasks.model.target import load_target, stop_token_ids

CACHE = Path(tempfile.gettempdir()) / "eagle3-test-targets"  # the tests' conversions, reused
BEFORE_COMMIT = "48940e8"


def before_module():
    """tasks/evaluate/offline.py as of BEFORE_COMMIT, imported under another name."""
    source = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:tasks/evaluate/offline.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="eagle3-before-")) / "evaluate_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("evaluate_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["evaluate_before"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def run(module, draft_dtype: torch.dtype, model, tok, prompts, args) -> tuple[float, int, int, dict]:
    draft = (module.load_draft_for_target(args.draft, model) if args.draft
             else random_draft(model, n_draft=4096, aux=(1, 14, 26))).to(draft_dtype)
    drafters = [module.Eagle3Drafter(draft, "aux"), module.Eagle3Drafter(draft, "final"), module.PromptLookupDrafter()]
    stops = stop_token_ids(model, tok)
    started = time.perf_counter()
    report = module.evaluate_acceptance(model, prompts, drafters, args.k, args.max_new_tokens, stops)
    seconds = time.perf_counter() - started
    ref = {p.item_id: target_greedy(model, p.input_ids, args.max_new_tokens, stops) for p in prompts}
    divergent = sum(first_difference(r.output_ids, ref[r.item_id]) is not None for r in report.requests)
    acceptance = {a.drafter: a.acceptance_length_token_weighted for a in report.aggregates if a.domain == "all"}
    return seconds, divergent, len(report.requests), acceptance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6, help="per domain (chat, HumanEval)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the target's")
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_target(cache_dir=CACHE, dtype=getattr(torch, args.dtype))
    sets = [("chat", chat_prompts(args.prompts)), (HUMANEVAL, benchmark_sets()[0][1][:args.prompts])]
    prompts = prompts_for_benchmark(tok, None, sets)
    load_before = load()
    before = run(before_module(), torch.bfloat16, model, tok, prompts, args)
    after = run(after_module, torch.float32, model, tok, prompts, args)
    rows = []
    for name, (secs, div, n, acc) in ((f"before ({BEFORE_COMMIT}): batched verify", before),
                                      ("after: replayed greedy, checked", after)):
        rows.append([name, f"{secs:.1f}", f"{div} of {n}", ", ".join(f"{k} {v:.3f}" for k, v in acc.items())])
    table(f"offline evaluator, {len(prompts)} prompts x {args.max_new_tokens} tokens, k={args.k}, 3 drafters "
          f"({'draft ' + str(args.draft) if args.draft else 'random draft'}), target {args.dtype}, "
          f"{torch.get_num_threads()} torch threads; load {load_before} -> {load()}; "
          f"after / before wall: {after[0] / before[0]:.2f}x",
          ["evaluator", "wall s", "outputs not the target's greedy", "acceptance (token-weighted)"], rows)


if __name__ == "__main__":
    main()
