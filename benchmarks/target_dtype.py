"""The target's compute dtype on this CPU: what `target.dtype: auto` chooses here, and what it saves.

The user's alternative is the old default, bfloat16 everywhere. On a CPU without bf16 instructions
(AVX2 only: no AVX512-BF16, no AMX) torch emulates every bf16 matmul, and `auto` computes in
float32 instead. Both dtypes, in one run, on the same real inputs:

1. Extraction: the flow's extractor (`HFExtractor.extract`, aux layers [1, 14, 26], final_hidden
   teacher) over the first `--samples` ShareGPT samples (rendered with the GGUF's chat template,
   max_length 1024, truncate; benchmarks/extract.py's `render`), batched as the flow batches them.
2. Offline evaluation's target side: greedy decoding (`tasks.evaluate.offline.target_greedy`) of
   `--new-tokens` tokens for the first `--prompts` held-out-chat-like prompts (the same samples'
   user turns).

`--repeats` rounds (default 3), the order of the dtypes alternating each round, after an untimed
warm-up of each; medians reported, as float32 / bf16 speed. Also how far the two dtypes' states
are apart: the relative L2 distance of the aux states (what the draft trains on) and the share of
loss-masked positions where the target's next token (argmax) differs, with float32 as reference.
Torch threads: torch's default (every core), as the flow runs.

Run: `.venv/bin/python -m benchmarks.target_dtype` (about 10 minutes on a 2-core AVX2 host).
A line per run is appended to benchmarks/results/target_dtype.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
from benchmarks.extract import MAX_BATCH_TOKENS, render, sharegpt_records
from benchmarks.report import RESULTS, ROOT, cpu_name, load

from tasks.evaluate.offline import target_greedy
from tasks.extract.hf_backend import Extracted, ExtractSettings, HFExtractor, aux_hidden_float, default_aux_layer_ids
from tasks.model.target import (CPU_BF16_FLAGS, gguf_chat_template, load_target, resolve_target_dtype,
                          smollm2_gguf_path, this_cpu_flags)

DTYPES = ("bfloat16", "float32")
RESULT_FILE = RESULTS / "target_dtype.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8, help="ShareGPT samples extracted (default 8)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts decoded greedily (default 4)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per prompt (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    args = ap.parse_args()

    flags = this_cpu_flags() or frozenset()
    auto = resolve_target_dtype("auto", "cpu")
    print(f"target dtype benchmark  {datetime.date.today()}  {cpu_name()}  cores {os.cpu_count()}  torch "
          f"{torch.__version__} threads {torch.get_num_threads()}  bf16 flags {sorted(flags & CPU_BF16_FLAGS) or 'none'}  "
          f"auto -> {auto}  load average {load()}", flush=True)
    loaded = {d: load_target(dtype=getattr(torch, d)) for d in DTYPES}
    models, tokenizer = {d: m for d, (m, _) in loaded.items()}, loaded["float32"][1]
    template = gguf_chat_template(smollm2_gguf_path())
    records = sharegpt_records(300)
    pool, _ = render(records, tokenizer, template)
    samples = [s for _, s in pool[:args.samples]]
    tokens = sum(s.num_tokens for s in samples)
    prompts = []
    for s in samples[:args.prompts]:
        # the user turn: the ids before the first loss-masked (assistant) token
        first = s.loss_mask.index(1) if 1 in s.loss_mask else len(s.input_ids)
        prompts.append(s.input_ids[:first])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = ExtractSettings(aux_layer_ids=default_aux_layer_ids(models["float32"].config.num_hidden_layers))
    extractors = {d: HFExtractor(m, settings, max_batch_tokens=MAX_BATCH_TOKENS, pad_token_id=pad)
                  for d, m in models.items()}
    inputs = [(s.input_ids, s.loss_mask) for s in samples]
    print(f"{len(samples)} ShareGPT samples, {tokens:,} tokens; {len(prompts)} prompts x {args.new_tokens} new tokens",
          flush=True)

    def extract(d: str) -> list:
        out = extractors[d].extract(inputs)
        bad = [r for r in out if not isinstance(r, Extracted)]
        if bad:
            raise RuntimeError(f"{d}: {len(bad)} sample(s) quarantined, e.g. {bad[0]}")
        return out

    def decode(d: str) -> list[list[int]]:
        return [list(target_greedy(models[d], p, args.new_tokens)) for p in prompts]

    for d in DTYPES:  # untimed warm-up of each code path, cut short
        extractors[d].extract([(ids[:64], mask[:64]) for ids, mask in inputs[:2]])
        target_greedy(models[d], prompts[0], 4)
    times: dict[str, dict[str, list[float]]] = {d: {"extract": [], "decode": []} for d in DTYPES}
    kept: dict[str, tuple[list, list]] = {}
    for r in range(args.repeats):
        for d in (DTYPES if r % 2 == 0 else DTYPES[::-1]):
            t = time.perf_counter()
            ext = extract(d)
            times[d]["extract"].append(time.perf_counter() - t)
            t = time.perf_counter()
            dec = decode(d)
            times[d]["decode"].append(time.perf_counter() - t)
            kept.setdefault(d, (ext, dec))
            print(f"  round {r + 1} {d:<9} extract {times[d]['extract'][-1]:7.2f} s  decode {times[d]['decode'][-1]:7.2f} s",
                  flush=True)

    med = {d: {k: statistics.median(v) for k, v in times[d].items()} for d in DTYPES}
    # How far apart the two dtypes' outputs are, float32 the reference.
    num = den = 0.0
    for a, b in zip(kept["bfloat16"][0], kept["float32"][0]):
        fa, fb = aux_hidden_float(a), aux_hidden_float(b)
        num += float((fa - fb).pow(2).sum())
        den += float(fb.pow(2).sum())
    aux_rel = (num / den) ** 0.5
    same_decode = sum(x == y for x, y in zip(*(kept[d][1] for d in DTYPES)))
    argmax_diff = masked = 0
    with torch.inference_mode():
        for ids, mask in inputs:
            x = torch.tensor([ids])
            am = {d: models[d](x).logits[0].argmax(-1) for d in DTYPES}
            m = torch.tensor(mask, dtype=torch.bool)
            argmax_diff += int((am["bfloat16"] != am["float32"])[m].sum())
            masked += int(m.sum())

    print(f"\n| {cpu_name()}, {os.cpu_count()} cores | bfloat16 | float32 | float32 / bf16 speed |")
    print("|---|---:|---:|---:|")
    for k, what in (("extract", f"extraction, {tokens:,} tokens"),
                    ("decode", f"greedy decoding, {len(prompts)} x {args.new_tokens} tokens")):
        b, f = med["bfloat16"][k], med["float32"][k]
        print(f"| {what} | {b:.2f} s | {f:.2f} s | {b / f:.2f}x |")
    print(f"\nauto chooses {auto} here. aux states: relative L2 distance bf16 vs float32 {aux_rel:.4f}; "
          f"target argmax differs at {argmax_diff}/{masked} loss-masked positions ({argmax_diff / max(masked, 1):.2%}); "
          f"greedy decodes equal {same_decode}/{len(prompts)}")
    line = {"date": str(datetime.date.today()), "cpu": cpu_name(), "cores": os.cpu_count(),
            "bf16_flags": sorted(flags & CPU_BF16_FLAGS), "auto": auto, "samples": len(samples), "tokens": tokens,
            "prompts": len(prompts), "new_tokens": args.new_tokens, "repeats": args.repeats,
            "median_s": med, "aux_rel_l2": aux_rel, "argmax_diff": argmax_diff, "masked": masked,
            "greedy_equal": same_decode}
    RESULT_FILE.parent.mkdir(parents=True, exist_ok=True)
    with RESULT_FILE.open("a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"appended to {RESULT_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
