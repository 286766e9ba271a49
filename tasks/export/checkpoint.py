"""The draft as the exports write it and the loaders read it back: the engine-neutral part of a draft folder.

Owns the draft layer's Llama fields in the spelling every engine reads (`layer_config`), the
project's record inside config.json (`project_record`), the draft's tensors as saved
(`draft_tensors`), writing a folder atomically after it passed its own checks
(`write_draft_folder`), reading a checked folder back (`read_checked`), building an `Eagle3Draft`
from its tensors (`build_draft`, `draft_config_from_layer`, `trained_layers`) and `load_draft`,
which loads either format. Each engine's writer and loader is its package's export.py
(serving/sglang/export.py, serving/vllm/export.py; llama.cpp's GGUF is converted from the SGLang
folder by serving/llamacpp/export.py); the checks a folder must pass are serving/contract.py. Promises:
nothing is written that fails the checks its loader makes; a folder appears complete or not at
all; export -> load gives a draft with identical logits (in the exported dtype).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from serving.draft_folder import (
    CONFIG_FILE,
    FORMAT,
    PROJECT_KEY,
    SPECULATORS_ARCHITECTURE,
    WEIGHTS_FILE,
    CheckpointError,
    Folder,
    int_list,
    load_tensor,
    read_folder,
)
from tasks.model.draft import DraftConfig, Eagle3Draft, load_target_embeddings

# ---------------------------------------------------------------- writing

def layer_config(config: DraftConfig) -> dict[str, Any]:
    """Llama fields of the draft layer, in the transformers 4.x spelling every engine reads."""
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        # SGLang ties lm_head to the (target-vocab) embeddings when this is true and then drops
        # our lm_head.weight without a word; say false explicitly.
        "tie_word_embeddings": False,
        "vocab_size": config.target_vocab_size,
    }


def project_record(config: DraftConfig, **extra: Any) -> dict[str, Any]:
    """Our record inside config.json: the trained aux layers and the target's layer count (engines ignore it)."""
    return {"format": FORMAT, "aux_layer_ids": list(config.aux_layer_ids),
            "target_num_layers": config.target_num_layers, **extra}


def draft_tensors(draft: Eagle3Draft, midlayer_prefix: str, include_embeddings: bool,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's tensors as saved: the decoder layer under `midlayer_prefix`, d2t int64, t2d bool."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in draft.state_dict().items():
        if name in ("d2t", "t2d") or (name.startswith("embed_tokens.") and not include_embeddings):
            continue
        key = midlayer_prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        out[key] = tensor.detach().to("cpu", dtype).contiguous()
    out["d2t"] = draft.d2t.detach().to("cpu", torch.int64).contiguous()
    out["t2d"] = draft.t2d.detach().to("cpu", torch.bool).contiguous()
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_exportable(draft: Eagle3Draft) -> None:
    """Refuse a draft without a valid vocab mapping (nothing would serve it right)."""
    from tasks.extract.vocab import validate_vocab

    c = draft.config
    problems = validate_vocab(draft.d2t.cpu().numpy(), draft.t2d.cpu().numpy(), c.target_vocab_size, c.draft_vocab_size)
    if problems:
        raise ValueError("refusing to export a draft without a valid vocab (call set_vocab):\n" + "\n".join(problems))


def write_draft_folder(folder: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                       check: Callable[[Path], list[str]]) -> Path:
    """Write config.json + model.safetensors into a new `folder`, atomically, once `check` passes the written files.

    `check` is the format's loader check (serving/contract.py through the engine's export.py), run on
    the files as written: a folder we would refuse to load is a bug here, never handed out.
    """
    from safetensors.torch import save_file

    from storage.datasets import write_folder_atomically

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty; export into a new folder")
    if folder.exists():
        folder.rmdir()

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        problems = check(tmp)
        if problems:
            raise AssertionError(f"the exported {config.get('architectures')} folder fails its own checks:\n"
                                 + "\n".join(problems))

    if not write_folder_atomically(folder, write):
        raise FileExistsError(f"{folder} was created by someone else during the export")
    return folder


# ---------------------------------------------------------------- reading back

def draft_config_from_layer(layer: Mapping[str, Any], n_draft: int, aux: Sequence[int], layers: int,
                            norm_before_fc: bool = False, norm_output: bool = False) -> DraftConfig:
    """The `DraftConfig` a draft layer's Llama fields (either format's spelling) describe, with the format's
    Eagle 3.1 flags (only the speculators format has them)."""
    h, nh = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    scaling = layer.get("rope_scaling")
    if scaling is None and isinstance(layer.get("rope_parameters"), Mapping):
        scaling = layer["rope_parameters"]
    theta = layer.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0
    return DraftConfig(hidden_size=h, num_attention_heads=nh,
                       num_key_value_heads=int(layer.get("num_key_value_heads") or nh),
                       head_dim=int(layer.get("head_dim") or h // nh),
                       intermediate_size=int(layer["intermediate_size"]),
                       rms_norm_eps=float(layer["rms_norm_eps"]), rope_theta=float(theta), rope_scaling=scaling,
                       max_position_embeddings=int(layer.get("max_position_embeddings") or 4096),
                       hidden_act=layer.get("hidden_act", "silu"), target_vocab_size=int(layer["vocab_size"]),
                       draft_vocab_size=int(n_draft), aux_layer_ids=tuple(aux), target_num_layers=int(layers),
                       norm_before_fc=norm_before_fc, norm_output=norm_output)


def build_draft(folder: Path, weights: Path, key_map: Mapping[str, str], config: DraftConfig,
           embed_tokens: torch.Tensor | None) -> Eagle3Draft:
    """An `Eagle3Draft` filled from `weights`; key_map: file key -> draft state_dict name."""
    draft = Eagle3Draft(config)
    state = {name: load_tensor(weights, key) for key, name in key_map.items() if name not in ("d2t", "t2d")}
    if "embed_tokens.weight" in state and embed_tokens is not None:
        raise CheckpointError(folder, ["the checkpoint holds embed_tokens.weight and embed_tokens was passed too"])
    embed = state.pop("embed_tokens.weight", embed_tokens)
    own = {k: v for k, v in draft.state_dict().items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(folder, [f"weights do not match the draft: missing {missing}, unexpected {unexpected}"])
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].dtype))
    draft.set_vocab(load_tensor(weights, "d2t"), load_tensor(weights, "t2d"))
    if embed is not None:
        load_target_embeddings(draft, embed)
    return draft


def read_checked(folder: Path, problems: list[str]) -> Folder:
    """The folder as read, once its format's check found no `problems` (else `CheckpointError`, one line each)."""
    loaded, _ = read_folder(folder) if not problems else (None, None)
    if loaded is None:
        raise CheckpointError(folder, problems)
    return loaded


def trained_layers(config: Mapping[str, Any], written: list[int] | None, expected: Sequence[int] | None,
                   capture: Callable[[list[int]], list[int | None]], folder: Path) -> list[int]:
    """The layers the draft reads (project convention): the caller's, else the record's, else what the ids capture."""
    record = config.get(PROJECT_KEY) or {}
    ids = [int(i) for i in expected] if expected is not None else int_list(record.get("aux_layer_ids"))
    if ids is not None:
        return ids
    if written is not None:
        captured = capture(written)
        if None not in captured:
            return [int(i) for i in captured if i is not None]
    raise CheckpointError(folder, [("cannot tell which target layers the draft reads: no project record and no "
                                    "usable layer ids; pass expected_aux_layer_ids")])


def load_draft(folder: str | Path, **kwargs: Any) -> Eagle3Draft:
    """Load either format, by its architecture (keyword arguments go to that format's loader)."""
    # The loaders are the engines' (serving/), which build on this module: imported here, not above.
    from serving.sglang.export import load_sglang
    from serving.vllm.export import load_speculators

    config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    if config.get("architectures") == [SPECULATORS_ARCHITECTURE]:
        kwargs.pop("sglang_version", None)
        return load_speculators(folder, **kwargs)
    return load_sglang(folder, **kwargs)
