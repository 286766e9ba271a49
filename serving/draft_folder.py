"""What a draft folder is, for every engine: its files, the project's record, its tensor names, reading it.

Owns the folder format the exports write and the doctor and loaders read (`config.json` +
`model.safetensors`, the `eagle3_pipeline` record inside config.json, the architectures of the two
folder formats), the tensor names of an EAGLE-3 draft (`canonical_key`: prefixes stripped,
`layers.0.` spelled `midlayer.`), `read_folder` and `CheckpointError`. Promises: only safetensors
are read (a pickle checkpoint is named and refused, never opened); reading a folder reads no tensor
data until a tensor is asked for; a folder that cannot be read is one line saying what to do.
The checks of a folder are serving/contract.py; the contracts themselves docs/contracts.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PROJECT_KEY = "eagle3_pipeline"  # our record inside config.json; engines ignore unknown fields
FORMAT = "eagle3-draft/1"
# The two folder formats the exports write: SGLang's draft class and the speculators format vLLM reads.
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"

# The tensors of an EAGLE-3 draft, by their project (and SGLang) names.
MIDLAYER_KEYS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
REQUIRED = ("fc.weight", *(f"midlayer.{k}" for k in MIDLAYER_KEYS), "norm.weight", "lm_head.weight", "d2t", "t2d")
# The Eagle 3.1 norms' weights (speculators' names): only an engine that serves them may load a folder holding them.
EAGLE31_WEIGHTS = ("input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight")
EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
KNOWN = frozenset((*REQUIRED, "embed_tokens.weight", *EAGLE31_WEIGHTS))
PREFIXES = ("draft_model.", "model.")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# The draft layer's Llama fields without which no engine can build it.
LAYER_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps")


class CheckpointError(ValueError):
    """A draft folder a server would load wrongly or not at all; one problem per line."""

    def __init__(self, folder: Path, problems: Sequence[str]) -> None:
        self.folder = folder
        self.problems = list(problems)
        super().__init__(f"{folder}: refusing this draft checkpoint:\n" + "\n".join(f"- {p}" for p in problems))


def int_list(value: Any) -> list[int] | None:
    """`value` as a list of ints when it is a list or tuple of ints (bools are not ints here); else None."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [int(v) for v in value]
    return None


def as_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def strip_prefixes(key: str) -> str:
    while key.startswith(PREFIXES):
        key = key.split(".", 1)[1]
    return key


def canonical_key(key: str) -> str:
    """The project name of a checkpoint key: prefixes stripped, `layers.0.` spelled `midlayer.`."""
    key = strip_prefixes(key)
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


def load_tensor(weights: Path, key: str) -> Any:
    """One tensor of a safetensors file, by its key in the file."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        return f.get_tensor(key)


@dataclass
class Folder:
    """A draft folder as read: its config, the shape of every tensor (no data read) and the weights file."""

    path: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]  # file key -> shape
    weights: Path

    @property
    def canonical(self) -> dict[str, str]:
        return {k: canonical_key(k) for k in self.shapes}

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of the tensor whose canonical name is `name` (the first such key)."""
        return next((s for k, s in self.shapes.items() if canonical_key(k) == name), None)

    def tensor(self, name: str) -> Any:
        """The tensor whose canonical name is `name` (None when there is none)."""
        key = next((k for k in self.shapes if canonical_key(k) == name), None)
        return None if key is None else load_tensor(self.weights, key)


def read_folder(folder: Path) -> tuple[Folder | None, str | None]:
    """(the folder as read, None), or (None, what is wrong and what to do)."""
    from safetensors import safe_open

    if not folder.is_dir():
        return None, f"{folder} is not a folder; give the exported draft folder (config.json + {WEIGHTS_FILE})"
    cfg = folder / CONFIG_FILE
    if not cfg.is_file():
        return None, (f"no {CONFIG_FILE} in {folder}; export the draft with serving.sglang.export.export_sglang or "
                      "serving.vllm.export.export_speculators")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        return None, f"{CONFIG_FILE} is not valid JSON ({e}); re-export the draft"
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = f" (found {pickles}: pickle checkpoints are never loaded)" if pickles else ""
        return None, f"no {WEIGHTS_FILE}{hint}; re-export the draft as safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict
    except Exception as e:  # noqa: BLE001 - any unreadable header means the file is not a usable safetensors file
        return None, f"{WEIGHTS_FILE} is not a readable safetensors file ({e}); re-export the draft"
    if not isinstance(config, dict):
        return None, f"{CONFIG_FILE} is not a JSON object; re-export the draft"
    return Folder(folder, config, shapes, weights), None
