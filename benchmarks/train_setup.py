"""The training benchmark's data (benchmarks/train.py): one real batch of SmolLM2 states and the draft's setup,
made once, saved, and loaded again by each memory-measuring child process; and the medians of its runs.

Promises: the batch is the first epoch batch at least 90% full of real tokens, extracted as the flow
extracts (final_hidden teacher), so every variant trains on the same tensors.
"""

from __future__ import annotations

import gc
import hashlib
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import tasks.model.draft as dm
from benchmarks.report import Clock
from tasks.model.draft import DraftConfig
from tasks.train.steps import Item, epoch_batches
from tasks.train.ttt import Batch, collate

SEED = 0
MIN_FILL = 0.9       # the batch: the first epoch batch with at least this share of real tokens
BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden", "lengths", "final_hidden")


@dataclass
class Runs:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, w: float, c: float) -> None:
        self.wall.append(w)
        self.cpu.append(c)

    @property
    def w(self) -> float:
        return statistics.median(self.wall)

    @property
    def c(self) -> float:
        return statistics.median(self.cpu)


def sha12(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


# ---------------------------------------------------------------- data

@dataclass
class Setup:
    batch: Batch
    dcfg: DraftConfig
    embed: torch.Tensor      # the target's input embeddings (bf16)
    head: torch.Tensor       # the target's lm_head weight (bf16; the embeddings when tied)
    d2t: torch.Tensor
    t2d: torch.Tensor
    info: dict


def prepare(args) -> Setup:
    from tasks.extract.chat import Sample, render_and_mask
    from tasks.extract.hf_backend import ExtractSettings, HFExtractor, default_aux_layer_ids
    from tasks.discover.prompts import Prompt, normalise_record
    from tasks.discover.sources import read_file, sharegpt_package_path
    from tasks.model.target import gguf_chat_template, load_target, smollm2_gguf_path
    from tasks.extract.vocab import build_draft_vocab, count_tokens

    clock = Clock(lambda: None)
    model, tokenizer = load_target()
    template = gguf_chat_template(smollm2_gguf_path())
    records, _ = read_file(sharegpt_package_path(), "sharegpt")
    samples, skipped = [], Counter()
    for r in records[:args.pool]:
        p = normalise_record(r.data, keep_final_answer=True)
        if not isinstance(p, Prompt) or p.messages[-1]["role"] != "assistant":
            skipped["not a conversation ending with an answer"] += 1
            continue
        s = render_and_mask(tokenizer, p.messages, args.max_length, "truncate", chat_template=template)
        if isinstance(s, Sample):
            samples.append(s)
        else:
            skipped[s.reason.split(" within")[0]] += 1
    vsize = model.config.vocab_size
    counts = count_tokens([(s.input_ids, s.loss_mask) for s in samples], vsize)
    vocab = build_draft_vocab(counts, args.draft_vocab)
    items = [Item("pool", i, s.num_tokens) for i, s in enumerate(samples)]
    batches = epoch_batches(items, SEED, 0, 0, args.batch_tokens)
    fill = [sum(it.tokens for it in b) / args.batch_tokens for b in batches]
    pick = next((i for i, f in enumerate(fill) if f >= MIN_FILL), max(range(len(batches)), key=fill.__getitem__))
    chosen = [samples[it.slot] for it in batches[pick]]
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ext = HFExtractor(model, ExtractSettings(aux_layer_ids=aux_ids), max_batch_tokens=8192, pad_token_id=pad)
    recs = ext.extract([(s.input_ids, s.loss_mask) for s in chosen])
    bad = [r for r in recs if not hasattr(r, "aux_hidden")]
    if bad:
        raise RuntimeError(f"extraction quarantined {len(bad)} sample(s): {bad[:2]}")
    batch = collate(recs, 0)  # pad 0, as flows/train.py collates
    dcfg = DraftConfig.from_target_config(model.config, vocab.draft_vocab_size, aux_ids)
    embed = model.get_input_embeddings().weight.detach().clone()
    head = dm.target_head_weight(model).clone()
    info = {
        "pool": len(samples), "skipped": dict(skipped), "coverage": vocab.coverage, "n_filled": vocab.n_filled,
        "batches": len(batches), "pick": pick, "lengths": [s.num_tokens for s in chosen],
        "masked": sum(s.num_masked for s in chosen), "tied": bool(getattr(model.config, "tie_word_embeddings", False)),
        "seconds": clock.read()[0],
    }
    del model, ext
    gc.collect()
    return Setup(batch, dcfg, embed, head, torch.from_numpy(vocab.d2t), torch.from_numpy(vocab.t2d), info)


def save_setup(s: Setup, folder: Path) -> None:
    tensors = {f"batch.{k}": getattr(s.batch, k).contiguous() for k in BATCH_KEYS}
    tensors.update({"embed": s.embed.contiguous(), "head": s.head.clone().contiguous(), "d2t": s.d2t, "t2d": s.t2d})
    save_file(tensors, folder / "setup.safetensors")
    (folder / "setup.json").write_text(json.dumps({"dcfg": s.dcfg.to_dict(), "info": s.info}))


def load_setup(folder: Path) -> Setup:
    t = load_file(folder / "setup.safetensors")
    meta = json.loads((folder / "setup.json").read_text())
    batch = Batch(**{k: t[f"batch.{k}"] for k in BATCH_KEYS}, teacher="final_hidden")
    return Setup(batch, DraftConfig.from_dict(meta["dcfg"]), t["embed"], t["head"], t["d2t"], t["t2d"], meta["info"])
