"""vLLM's draft folder, the speculators format (`Eagle3Speculator`): the writer, the check on read-back and the loader.

Owns `speculators_config` (config.json as vLLM reads it: the speculators header, the draft layer in
`transformer_layer_config`, top-level layer ids converted by serving/vllm/layers.py,
`norm_before_residual` false), `export_speculators`, `check_speculators` and `load_speculators`.
Promises: keys are `layers.0.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`; an
exported folder passes the same checks `load_speculators` makes, which are the doctor's
(serving/contract.py, docs/contracts.md); export -> load gives identical logits (in the exported dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from serving.contract import folder_problems
from serving.draft_folder import PROJECT_KEY, SPECULATORS_ARCHITECTURE, int_list
from serving.vllm.doctor import CONTRACT
from serving.vllm.layers import vllm_capture_layers, vllm_layer_ids
from tasks.export import checkpoint as draft_io
from tasks.model.draft import DraftConfig, Eagle3Draft


def speculators_config(config: DraftConfig, verifier_name_or_path: str,
                       verifier_architectures: Sequence[str] = ("LlamaForCausalLM",),
                       speculative_tokens: int = 3, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json in the speculators format vLLM reads (Eagle3Speculator)."""
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    if not verifier_name_or_path:
        raise ValueError("verifier_name_or_path is required: vLLM refuses a speculators config without it")
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": draft_io.layer_config(config),
        "draft_vocab_size": config.draft_vocab_size,
        # vLLM defaults this to true when absent, which moves hidden_norm before the residual: not
        # the layer we trained.
        "norm_before_residual": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "torch_dtype": draft_io.dtype_name(dtype),
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(config.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_name_or_path), "architectures": list(verifier_architectures)},
        },
        # Eagle 3.1 (speculators' names, top level as vLLM reads them); absent when off, as every older folder
        **{name: True for name in config.eagle31_norms},
        PROJECT_KEY: draft_io.project_record(config),
    }


def export_speculators(draft: Eagle3Draft, folder: str | Path, verifier_name_or_path: str, *,
                       verifier_architectures: Sequence[str] = ("LlamaForCausalLM",), speculative_tokens: int = 3,
                       include_embeddings: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `draft` in the vLLM/speculators format (keys layers.0.*, fc, norm, lm_head, d2t, t2d)."""
    draft_io.check_exportable(draft)
    config = speculators_config(draft.config, verifier_name_or_path, verifier_architectures, speculative_tokens, dtype)
    tensors = draft_io.draft_tensors(draft, "layers.0.", include_embeddings, dtype)
    trained = list(draft.config.aux_layer_ids)
    return draft_io.write_draft_folder(folder, config, tensors,
                              lambda written: check_speculators(written, expected_aux_layer_ids=trained))


def check_speculators(folder: str | Path, *, expected_aux_layer_ids: Sequence[int] | None = None,
                      target_num_layers: int | None = None) -> list[str]:
    """Every reason vLLM would serve this speculators folder wrongly, one line per failed check; empty if it passes."""
    return folder_problems(folder, CONTRACT, expected=expected_aux_layer_ids, target_num_layers=target_num_layers)


def load_speculators(folder: str | Path, *, embed_tokens: torch.Tensor | None = None,
                     expected_aux_layer_ids: Sequence[int] | None = None,
                     target_num_layers: int | None = None) -> Eagle3Draft:
    """The draft in a speculators folder, after `check_speculators` passes (else `CheckpointError`)."""
    folder = Path(folder)
    loaded = draft_io.read_checked(folder, check_speculators(folder, expected_aux_layer_ids=expected_aux_layer_ids,
                                                             target_num_layers=target_num_layers))
    config: dict[str, Any] = loaded.config
    layers = int(target_num_layers or (config.get(PROJECT_KEY) or {})["target_num_layers"])
    written = int_list(config["eagle_aux_hidden_state_layer_ids"])
    aux = draft_io.trained_layers(config, written, expected_aux_layer_ids,
                                  lambda w: vllm_capture_layers(w, layers), folder)
    layer = config["transformer_layer_config"]
    draft_config = draft_io.draft_config_from_layer(layer, config["draft_vocab_size"], aux, layers,
                                                    norm_before_fc=config.get("norm_before_fc") is True,
                                                    norm_output=config.get("norm_output") is True)
    # vLLM renames midlayer. to layers.0. itself, so a speculators file may hold either spelling.
    key_map = {k: "midlayer." + k.removeprefix("layers.0.").removeprefix("midlayer.")
               if k.startswith(("layers.0.", "midlayer.")) else k for k in loaded.shapes}
    return draft_io.build_draft(folder, loaded.weights, key_map, draft_config, embed_tokens)
