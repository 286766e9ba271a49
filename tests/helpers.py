"""Workspaces for stage tests: a tiny random target with SmolLM2's real tokenizer, and imported generations."""

from __future__ import annotations

import json
from pathlib import Path

# The stand-ins the benchmarks use too: one copy, in benchmarks/fixtures.py.
from benchmarks.fixtures import (TARGET_CACHE, WORDS, conversations, extract_config, import_generations,  # noqa: F401
                                 make_tiny_target, sharegpt_chats)


def random_smollm2_export(target: Path, folder: Path, aux: tuple[int, int, int], seed: int = 0, n_draft: int = 256,
                          **export_kwargs) -> Path:
    """A random EAGLE-3 draft for SmolLM2 (small FFN, norms near 1) with a random `n_draft`-token vocab,
    exported for SGLang (bf16); `target` is the target's HF folder (its config.json)."""
    import torch

    from tasks.model.draft import DraftConfig, Eagle3Draft
    from serving.sglang.export import export_sglang

    config = json.loads((target / "config.json").read_text())
    vocab = int(config["vocab_size"])
    draft = Eagle3Draft(DraftConfig.from_target_config(config, n_draft, aux, intermediate_size=256))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.05)
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n_draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(n_draft), t2d)
    return export_sglang(draft, folder, **export_kwargs)


def edit_export(folder: Path, config=None, tensors=None) -> Path:
    """Break an exported folder in place: `config(dict)` / `tensors(dict)` edit what its files hold."""
    from safetensors.torch import load_file, save_file

    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(folder / "model.safetensors"))
        tensors(t)
        save_file(t, str(folder / "model.safetensors"))
    return folder
