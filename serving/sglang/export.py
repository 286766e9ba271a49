"""SGLang's draft folder: the writer, the check on read-back and the loader (`LlamaForCausalLMEagle3`).

Owns `sglang_config` (config.json as SGLang reads it: layer ids in `eagle_config`, converted by
serving/sglang/layers.py), `export_sglang`, `check_sglang` and `load_sglang`. Promises: keys are
`midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (no prefix), embeddings only
when asked; an exported folder passes the same checks `load_sglang` makes, which are the doctor's
(serving/contract.py), so each silent failure of docs/contracts.md is refused with the doctor's
message before any weight is used; export -> load gives identical logits (in the exported dtype).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from serving.contract import folder_problems
from serving.draft_folder import PROJECT_KEY, SGLANG_ARCHITECTURE, int_list
from serving.sglang.doctor import CONTRACT
from serving.sglang.layers import SGLANG_VERSIONS, SGLangVersion, sglang_capture_layers, sglang_layer_ids
from tasks.export import checkpoint as draft_io
from tasks.model.draft import DraftConfig, Eagle3Draft


def sglang_config(config: DraftConfig, sglang_version: SGLangVersion | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json for SGLang's LlamaForCausalLMEagle3 (layer ids converted by `sglang_layer_ids`)."""
    written = sglang_layer_ids(config.aux_layer_ids, config.target_num_layers, sglang_version)
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **draft_io.layer_config(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "torch_dtype": draft_io.dtype_name(dtype),
        # SGLang reads the ids only from here; a missing block falls back to default layers silently.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": written, "use_aux_hidden_state": True},
        PROJECT_KEY: draft_io.project_record(config, sglang_version=sglang_version),
    }


def export_sglang(draft: Eagle3Draft, folder: str | Path, *, sglang_version: SGLangVersion | None = None,
                  include_embeddings: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `draft` as an SGLang EAGLE-3 draft folder; returns the folder.

    Keys: midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d (no prefix); embeddings only
    with include_embeddings. The written folder is checked as `load_sglang` would check it.
    """
    draft_io.check_exportable(draft)
    if draft.config.eagle31_norms:
        raise ValueError(f"SGLang has no Eagle 3.1 norms ({', '.join(draft.config.eagle31_norms)}): it would serve this "
                         "draft without them. Export it for vLLM (serving.vllm.export.export_speculators).")
    config = sglang_config(draft.config, sglang_version, dtype)
    tensors = draft_io.draft_tensors(draft, "midlayer.", include_embeddings, dtype)
    trained = list(draft.config.aux_layer_ids)
    return draft_io.write_draft_folder(folder, config, tensors, lambda written: check_sglang(
        written, expected_aux_layer_ids=trained, sglang_version=sglang_version))


def _recorded_version(folder: Path) -> SGLangVersion | None:
    """The SGLang version the export was written for, from its record (None: both, or no record)."""
    try:
        record = json.loads((folder / "config.json").read_text()).get(PROJECT_KEY) or {}
    except (OSError, ValueError, AttributeError):
        return None  # the check names the unreadable config
    version = record.get("sglang_version") if isinstance(record, dict) else None
    return version if version in SGLANG_VERSIONS else None


def check_sglang(folder: str | Path, *, expected_aux_layer_ids: Sequence[int] | None = None,
                 target_num_layers: int | None = None, sglang_version: SGLangVersion | None = None) -> list[str]:
    """Every reason SGLang would serve this folder wrongly, one line per failed check; empty when it passes.

    The SGLang version is the one named, else the one the export was written for, else both.
    """
    folder = Path(folder)
    return folder_problems(folder, CONTRACT, expected=expected_aux_layer_ids, target_num_layers=target_num_layers,
                           sglang_version=sglang_version or _recorded_version(folder))


def load_sglang(folder: str | Path, *, embed_tokens: torch.Tensor | None = None,
                expected_aux_layer_ids: Sequence[int] | None = None, target_num_layers: int | None = None,
                sglang_version: SGLangVersion | None = None) -> Eagle3Draft:
    """The draft in an SGLang folder, after `check_sglang` passes (else `CheckpointError`, one line per problem).

    Embeddings come from the file (if exported with them) or `embed_tokens` (the target's input
    embeddings); otherwise they stay zero and must be set with `load_target_embeddings`.
    """
    folder = Path(folder)
    loaded = draft_io.read_checked(folder, check_sglang(folder, expected_aux_layer_ids=expected_aux_layer_ids,
                                                        target_num_layers=target_num_layers,
                                                        sglang_version=sglang_version))
    config: dict[str, Any] = loaded.config
    record = config.get(PROJECT_KEY) or {}
    layers = int(target_num_layers or record["target_num_layers"])
    version = sglang_version or record.get("sglang_version") or SGLANG_VERSIONS[0]
    written = int_list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    aux = draft_io.trained_layers(config, written, expected_aux_layer_ids,
                                  lambda w: sglang_capture_layers(w, layers, version), folder)
    draft_config = draft_io.draft_config_from_layer(config, config["draft_vocab_size"], aux, layers)
    key_map = {k: "midlayer." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k for k in loaded.shapes}
    return draft_io.build_draft(folder, loaded.weights, key_map, draft_config, embed_tokens)
