"""Small stand-ins the benchmarks and the tests share: a tiny random target with SmolLM2's tokenizer, synthetic
and real ShareGPT conversations, imported generations, a small extraction config, an untrained draft.

Promises: every stand-in is seeded (the same call gives the same target, text, draft), and none needs a
server or a download beyond SmolLM2 itself; the tests' own helpers (tests/helpers.py) import these.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tasks.config import ExtractConfig
    from tasks.model.draft import Eagle3Draft

TARGET_CACHE = Path(tempfile.gettempdir()) / "eagle3-test-targets"  # SmolLM2's conversions, reused by every run
WORDS = ("alpha beta gamma delta river mountain quantum python kernel matrix garden violin copper orbit "
         "lantern harbor meadow cipher saddle falcon ember glacier tundra pixel vector lemon comet").split()


def make_tiny_target(folder: Path, hidden_size: int = 64, heads: int = 4, kv_heads: int = 2) -> Path:
    """An 8-layer random Llama (H=64, confident head) with SmolLM2's tokenizer, saved as safetensors in `folder`.

    vLLM's CPU attention takes head sizes of 32 and up: give hidden_size=128, heads=2 for a target it serves.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.model.target import load_target

    _, tokenizer = load_target(cache_dir=TARGET_CACHE)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden_size, num_hidden_layers=8, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=2 * hidden_size, vocab_size=len(tokenizer), tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # A random head gives near-uniform next-token distributions over all 49K tokens: nothing a
        # draft could learn, and argmaxes outside any draft vocab. Like a trained model, this one
        # is confident and predicts the tokens its data uses (WORDS and digits).
        text = " ".join(WORDS) + " " + " ".join("0123456789") + " q"
        used = torch.tensor(sorted(set(tokenizer(text, add_special_tokens=False)["input_ids"])))
        keep = torch.zeros(len(tokenizer), dtype=torch.bool)
        keep[used] = True
        model.lm_head.weight[~keep] = 0
        model.lm_head.weight[keep] *= 40
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(n))


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Distinct multi-turn chats of varied length (distinct enough to survive near-dedupe)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = []
        for _ in range(rng.choice((1, 1, 2, 3))):
            msgs.append({"role": "user", "content": f"q{i} " + _text(rng, rng.randrange(5, 40))})
            msgs.append({"role": "assistant", "content": _text(rng, rng.randrange(5, 120))})
        out.append({"messages": msgs})
    return out


def import_generations(workspace: Path, tmp_path: Path, convs: list[dict], name: str = "seed") -> int:
    """Import finished conversations as generations (no server); a new batch needs a new `name`."""
    from flows.regenerate import regenerate
    from tasks.config import RegenerateConfig

    path = tmp_path / f"{name}-{len(convs)}.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    cfg = RegenerateConfig(workspace=str(workspace), target_model="tiny", imports=[{"name": name, "path": str(path)}])
    return regenerate(cfg).imported


def extract_config(workspace: Path, target: Path | None, **kw) -> ExtractConfig:
    """A small extraction of `workspace` (max_length 256, 512 draft ids, 200 KB shards) by `target`'s folder
    in float32 on the CPU, or by the configured default target when None; `kw` overrides fields."""
    from tasks.config import ExtractConfig

    base = {"workspace": str(workspace), "max_length": 256, "draft_vocab_size": 512, "shard_bytes": 200_000,
            "disk_budget_bytes": 50_000_000, "max_batch_tokens": 1024}
    if target is not None:
        base["target"] = {"model_path": str(target), "dtype": "float32", "device": "cpu"}
    return ExtractConfig.model_validate({**base, **kw})


def sharegpt_chats(n: int, min_turns: int = 2, max_chars: int = 1500) -> list[list[dict]]:
    """The first `n` real ShareGPT conversations (packaged file) with >= `min_turns` turns, as chat messages."""
    from tasks.discover.sources import read_file, sharegpt_package_path

    records, _ = read_file(sharegpt_package_path(), "sharegpt", "tests")
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for r in records:
        turns = (r.data or {}).get("conversations") or []
        msgs = [{"role": roles.get(t.get("from")), "content": t.get("value", "")} for t in turns]
        if len(msgs) < min_turns or any(m["role"] is None or not m["content"] for m in msgs) \
                or msgs[0]["role"] != "user" or sum(len(m["content"]) for m in msgs) > max_chars:
            continue
        out.append(msgs)
        if len(out) == n:
            break
    return out


def chat_prompts(n: int) -> list[str]:
    """The first user turns of ShareGPT records (the embedded default's chat data)."""
    from tasks.config import SourceConfig
    from tasks.discover.prompts import Prompt, normalise_record
    from tasks.discover.sources import read_source

    records, _ = read_source(SourceConfig(name="sharegpt", kind="sharegpt_package", limit=400))
    out = []
    for rec in records:
        p = normalise_record(rec.data)
        if isinstance(p, Prompt) and p.messages[0]["role"] == "user" and 20 <= len(p.messages[0]["content"]) <= 600:
            out.append(p.messages[0]["content"])
        if len(out) == n:
            return out
    raise AssertionError(f"only {len(out)} short chat prompts in the first records")


def random_draft(target, n_draft: int, aux: tuple[int, ...], seed: int = 1, **shape) -> Eagle3Draft:
    """An untrained EAGLE-3 draft for `target` (a transformers model): seeded random weights and a seeded
    random `n_draft`-token vocabulary, with the target's embeddings; in eval mode. `shape`: DraftConfig
    fields to change (e.g. norm_before_fc=True)."""
    from tasks.model.draft import DraftConfig, Eagle3Draft, load_target_embeddings

    cfg = target.config
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig.from_target_config(cfg, n_draft, aux, **shape))
    ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:n_draft].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(n_draft), t2d)
    load_target_embeddings(draft, target)
    return draft.eval()
