"""The target's greedy paths kept on disk, so a study measuring drafts in several processes decodes each prompt once.

Owns `save_paths` / `load_paths`: one safetensors file of `GreedyPath`s (tokens, finish reason and the hidden
layers the caller keeps), written atomically. The paths are the lossless reference every drafter's output is
checked against, so they are kept bit for bit (float32 stays float32) and only under a key the caller derives
from everything that decides them (target, dtype, prompts, max_new_tokens, stop ids). Layers not kept are
placeholders that refuse any use by name: a drafter that reads one fails, never measures on zeros.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from tasks.evaluate.decoding import GreedyPath

FORMAT = "eagle3-greedy-paths/1"


class LayerNotKept:
    """A hidden layer the cache did not keep: slicing keeps the placeholder, any torch use raises."""

    def __init__(self, layer: int, source: str) -> None:
        self.layer, self.source = layer, source

    def __getitem__(self, _index: Any) -> LayerNotKept:
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        found = next(a for a in _flatten(args, kwargs) if isinstance(a, LayerNotKept))
        raise LookupError(f"hidden layer {found.layer} of the greedy path was not kept in {found.source}; "
                          f"decode the paths again with it kept")


def _flatten(args: Iterable, kwargs: dict | None) -> Iterable:
    for a in [*args, *(kwargs or {}).values()]:
        if isinstance(a, (list, tuple)):
            yield from _flatten(a, None)
        else:
            yield a


def paths_key(**decided_by: Any) -> str:
    """A short content key of everything that decides the paths (json-serialisable values)."""
    blob = json.dumps(decided_by, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def save_paths(file: Path, paths: dict[str, GreedyPath], layers: Sequence[int]) -> None:
    """Write `paths` (item id -> path) keeping hidden `layers` (indices into transformers' tuple; negative ones
    count from the end); atomic: a crash leaves the old file or none."""
    from safetensors.torch import save_file

    from storage.datasets import atomic_path

    if not paths:
        raise ValueError("no greedy paths to save")
    n_hidden = {len(p.hidden_states) for p in paths.values()}
    if len(n_hidden) != 1:
        raise ValueError(f"greedy paths with different layer counts: {sorted(n_hidden)}")
    n = n_hidden.pop()
    kept = sorted({i % n for i in layers})
    tensors: dict[str, torch.Tensor] = {}
    index = {}
    for j, (item_id, p) in enumerate(paths.items()):
        tensors[f"{j}.tokens"] = p.tokens.detach().cpu().contiguous()
        for i in kept:
            tensors[f"{j}.h{i}"] = p.hidden_states[i].detach().cpu().contiguous()
        index[item_id] = {"slot": j, "prompt_tokens": p.prompt_tokens, "finish_reason": p.finish_reason}
    with atomic_path(file) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "n_hidden": str(n), "layers": json.dumps(kept),
                                                 "paths": json.dumps(index)})


def load_paths(file: Path, device: torch.device | str = "cpu") -> dict[str, GreedyPath]:
    """The paths `save_paths` wrote (item id -> path), its unkept layers `LayerNotKept`; {} if there is no file."""
    from safetensors import safe_open

    if not file.exists():
        return {}
    out: dict[str, GreedyPath] = {}
    with safe_open(str(file), "pt", device=str(device)) as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{file}: not a greedy-path file (format {meta.get('format')!r}, expected {FORMAT})")
        n, kept = int(meta["n_hidden"]), set(json.loads(meta["layers"]))
        for item_id, e in json.loads(meta["paths"]).items():
            j = e["slot"]
            hidden = tuple(f.get_tensor(f"{j}.h{i}") if i in kept else LayerNotKept(i, str(file)) for i in range(n))
            out[item_id] = GreedyPath(e["prompt_tokens"], f.get_tensor(f"{j}.tokens"), hidden, e["finish_reason"])
    return out
