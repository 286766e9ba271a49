"""A model of SGLang's weight loader for `LlamaForCausalLMEagle3`: what it does with each key of a draft file.

Owns `sglang_parameter_shapes` (SGLang's parameters for a one-layer draft config) and
`sglang_load_report` (SGLang's `load_weights` replayed on key names and shapes, nothing loaded).
Promises: mirrors python/sglang/srt/models/llama_eagle3.py: the keys it skips without a word, the
parameters no key fills (served random), the shapes it would reject, and `hot_token_id` computed
from d2t as SGLang computes it (docs/contracts.md, failures 2, 5 and 6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))


def sglang_parameter_shapes(config: Mapping[str, Any]) -> dict[str, dict[Any, tuple[int, ...]]]:
    """SGLang's LlamaForCausalLMEagle3 parameters for a one-layer draft config: name -> {shard: shape}.

    A plain parameter has the single shard None. With tie_word_embeddings, SGLang makes lm_head
    the embedding module, so there is no separate `lm_head.weight` to load.
    """
    h = int(config["hidden_size"])
    nh = int(config["num_attention_heads"])
    kvh = int(config.get("num_key_value_heads") or nh)
    hd = int(config.get("head_dim") or h // nh)
    inter = int(config["intermediate_size"])
    h_in = int(config.get("target_hidden_size") or h)
    vocab = int(config["vocab_size"])
    n_draft = int(config.get("draft_vocab_size") or vocab)
    p = "model.midlayer."
    shapes: dict[str, dict[Any, tuple[int, ...]]] = {
        "model.embed_tokens.weight": {None: (vocab, h)},
        "model.fc.weight": {None: (h, 3 * h_in)},
        p + "self_attn.qkv_proj.weight": {"q": (nh * hd, 2 * h), "k": (kvh * hd, 2 * h), "v": (kvh * hd, 2 * h)},
        p + "self_attn.o_proj.weight": {None: (h, nh * hd)},
        p + "mlp.gate_up_proj.weight": {0: (inter, h), 1: (inter, h)},
        p + "mlp.down_proj.weight": {None: (h, inter)},
        p + "input_layernorm.weight": {None: (h,)},
        p + "hidden_norm.weight": {None: (h,)},
        p + "post_attention_layernorm.weight": {None: (h,)},
        "model.norm.weight": {None: (h,)},
    }
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = {None: (n_draft, h)}
    return shapes


@dataclass
class SGLangLoadReport:
    """What SGLang's `LlamaForCausalLMEagle3.load_weights` does with a checkpoint's keys."""

    loaded: dict[str, tuple[str, Any]] = field(default_factory=dict)  # file key -> (parameter, shard)
    skipped: list[str] = field(default_factory=list)   # file keys SGLang drops without a word
    unloaded: list[str] = field(default_factory=list)  # parameter shards no key filled (random at serve time)
    shape_errors: list[str] = field(default_factory=list)  # keys whose shape SGLang's loader would reject
    hot_token_id: torch.Tensor | None = None  # d2t + arange(draft_vocab_size), as SGLang computes it

    @property
    def silent_problems(self) -> list[str]:
        """Skipped keys and unfilled parameters, the embeddings excepted (the server copies the target's)."""
        out = [f"{k}: SGLang skips this key without an error" for k in self.skipped]
        out += [f"{p}: no checkpoint key fills this SGLang parameter, it would serve random weights"
                for p in self.unloaded if not p.startswith("model.embed_tokens")]
        return out


def sglang_load_report(shapes: Mapping[str, Sequence[int] | torch.Tensor], config: Mapping[str, Any],
                       d2t: torch.Tensor | None = None) -> SGLangLoadReport:
    """Replay SGLang's loader on checkpoint keys (name -> shape or tensor) without loading anything.

    Mirrors python/sglang/srt/models/llama_eagle3.py: a key containing "d2t" becomes
    hot_token_id = d2t + arange; "t2d" is ignored; q/k/v and gate/up are renamed into the stacked
    qkv_proj / gate_up_proj shards; any name is tried as is, then with a "model." prefix, and a
    key matching no parameter is skipped silently (also after a stacked rename).
    """
    params = sglang_parameter_shapes(config)
    report = SGLangLoadReport()
    filled: set[tuple[str, Any]] = set()
    for key, value in shapes.items():
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value)
        if "d2t" in key:
            if d2t is not None:
                report.hot_token_id = d2t + torch.arange(d2t.shape[0])
            report.loaded[key] = ("hot_token_id", None)
            continue
        if "t2d" in key:
            report.loaded[key] = ("(ignored by SGLang)", None)
            continue
        target: tuple[str, Any] | None = None
        for param, shard_name, shard in _STACKED:
            if shard_name in key:
                name = key.replace(shard_name, param)
                name = name if name in params else f"model.{name}"
                target = (name, shard) if name in params else None
                break
        else:
            name = key if key in params else f"model.{key}"
            target = (name, None) if name in params else None
        if target is None:
            report.skipped.append(key)
            continue
        expected = params[target[0]][target[1]]
        if shape != expected:
            report.shape_errors.append(f"{key} has shape {list(shape)}, SGLang's {target[0]}"
                                       f"{'' if target[1] is None else f' shard {target[1]}'} expects {list(expected)}")
        report.loaded[key] = target
        filled.add(target)
    report.unloaded = [f"{p}{'' if s is None else f' (shard {s})'}" for p, shards in params.items() for s in shards
                       if (p, s) not in filled]
    return report
