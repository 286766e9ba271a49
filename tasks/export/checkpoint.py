"""Draft checkpoints in the formats servers load: SGLang and vLLM/speculators.

Owns the conversion of an `Eagle3Draft` into each engine's folder (config.json + model.safetensors),
the engines' aux-layer id conventions, a model of SGLang's weight loader, and loading such a
folder back (safetensors only, never pickle). Promises:
- Layer ids are converted from the project convention (output of decoder layer i, 0-based) by
  pure functions that model each engine's capture rule; SGLang ids are written so that SGLang
  before and since PR #25454 capture the trained layers, and a layer set no single file can
  serve to both is refused unless the caller names the SGLang version (CONTRACTS.md, failure 4).
- An exported folder passes the same checks `load_sglang` / `load_speculators` make, and those
  checks refuse each silent failure of CONTRACTS.md (2: `layers.0.*` keys SGLang skips, 3: missing
  `eagle_config`, 4: layer ids that capture other layers, 5: absolute or missing `d2t`, 6: `fc`
  input != 3H or no `lm_head`) with one line per problem, before any weight is used.
- Export -> load gives a draft with identical logits (in the exported dtype).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from tasks.model.draft import DraftConfig, Eagle3Draft, load_target_embeddings

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PROJECT_KEY = "eagle3_pipeline"  # our record inside config.json; engines ignore unknown fields
FORMAT = "eagle3-draft/1"

# SGLang changed how it reads eagle_aux_hidden_state_layer_ids in PR #25454 (see sglang_capture_layers).
SGLangVersion = Literal["before-pr25454", "since-pr25454"]
SGLANG_VERSIONS: tuple[SGLangVersion, ...] = ("before-pr25454", "since-pr25454")


class CheckpointError(ValueError):
    """A draft folder a server would load wrongly or not at all; one problem per line."""

    def __init__(self, folder: Path, problems: Sequence[str]) -> None:
        self.folder = folder
        self.problems = list(problems)
        super().__init__(f"{folder}: refusing this draft checkpoint:\n" + "\n".join(f"- {p}" for p in problems))


# ---------------------------------------------------------------- layer id conventions

def sglang_capture_layers(written_ids: Sequence[int], num_layers: int, version: SGLangVersion) -> list[int | None]:
    """The layers SGLang captures for `written_ids`, in project convention (None: not a layer output).

    SGLang captures the hidden state entering layer j (the output of layer j-1). Before PR #25454
    it set j = id + 1 for every id; since, it does so only when the first id is 1 (ids starting
    at 2 are read as "captured before layer j" as they are). j = 0 would be the embeddings and
    j >= num_layers is never reached by the capture loop.
    """
    if version not in SGLANG_VERSIONS:
        raise ValueError(f"unknown SGLang version {version!r}; one of {SGLANG_VERSIONS}")
    ids = [int(i) for i in written_ids]
    shift = version == "before-pr25454" or (bool(ids) and ids[0] == 1)
    before = [i + 1 if shift else i for i in ids]
    return [j - 1 if 1 <= j < num_layers else None for j in before]


def sglang_layer_ids(aux_layer_ids: Sequence[int], num_layers: int, version: SGLangVersion | None = None) -> list[int]:
    """The ids to write in `eagle_config` so SGLang captures `aux_layer_ids` (project convention).

    With `version=None` the ids must serve both SGLang versions; that is possible exactly when the
    first layer is 1 (the EAGLE-3 default), and otherwise refused: name the version the draft
    will be served by.
    """
    ids = [int(i) for i in aux_layer_ids]
    candidates = {"before-pr25454": ids, "since-pr25454": ids if ids[:1] == [1] else [i + 1 for i in ids]}
    versions = SGLANG_VERSIONS if version is None else (version,)
    written = {tuple(candidates[v]) for v in versions}
    ok = [w for w in written if all(sglang_capture_layers(w, num_layers, v) == ids for v in versions)]
    if ok:
        return list(ok[0])
    if version is None:
        raise ValueError(
            f"aux layers {ids} cannot be written so that SGLang before and since PR #25454 both capture them: "
            f"before that PR SGLang adds 1 to every id, since then only when the first id is 1. Train with a first "
            f"aux layer of 1, or export for one version (sglang_version='before-pr25454' writes "
            f"{candidates['before-pr25454']}, "
            f"'since-pr25454' writes {candidates['since-pr25454']})")
    raise ValueError(f"SGLang {version} cannot capture aux layers {ids}: the output of layer 0 is only reachable by "
                     "writing 1 first, which that version shifts by one")


def vllm_capture_layers(written_ids: Sequence[int], num_layers: int) -> list[int | None]:
    """vLLM captures the state entering layer j for each written id j: project id j-1."""
    return [int(j) - 1 if 1 <= int(j) < num_layers else None for j in written_ids]


def vllm_layer_ids(aux_layer_ids: Sequence[int]) -> list[int]:
    """Top-level `eagle_aux_hidden_state_layer_ids` for vLLM/speculators ("captured before layer j")."""
    return [int(i) + 1 for i in aux_layer_ids]


# ---------------------------------------------------------------- SGLang's weight loader, as a model

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


# ---------------------------------------------------------------- export

def _layer_config(config: DraftConfig) -> dict[str, Any]:
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


def _project_record(config: DraftConfig, **extra: Any) -> dict[str, Any]:
    return {"format": FORMAT, "aux_layer_ids": list(config.aux_layer_ids),
            "target_num_layers": config.target_num_layers, **extra}


def _weights(draft: Eagle3Draft, midlayer_prefix: str, include_embeddings: bool,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in draft.state_dict().items():
        if name in ("d2t", "t2d") or (name.startswith("embed_tokens.") and not include_embeddings):
            continue
        key = midlayer_prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        out[key] = tensor.detach().to("cpu", dtype).contiguous()
    out["d2t"] = draft.d2t.detach().to("cpu", torch.int64).contiguous()
    out["t2d"] = draft.t2d.detach().to("cpu", torch.bool).contiguous()
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_exportable(draft: Eagle3Draft) -> None:
    from tasks.extract.vocab import validate_vocab

    c = draft.config
    problems = validate_vocab(draft.d2t.cpu().numpy(), draft.t2d.cpu().numpy(), c.target_vocab_size, c.draft_vocab_size)
    if problems:
        raise ValueError("refusing to export a draft without a valid vocab (call set_vocab):\n" + "\n".join(problems))


def _write(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
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

    if not write_folder_atomically(folder, write):
        raise FileExistsError(f"{folder} was created by someone else during the export")
    return folder


def sglang_config(config: DraftConfig, sglang_version: SGLangVersion | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json for SGLang's LlamaForCausalLMEagle3 (layer ids converted by `sglang_layer_ids`)."""
    written = sglang_layer_ids(config.aux_layer_ids, config.target_num_layers, sglang_version)
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **_layer_config(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "torch_dtype": _dtype_name(dtype),
        # SGLang reads the ids only from here; a missing block falls back to default layers silently.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": written, "use_aux_hidden_state": True},
        PROJECT_KEY: _project_record(config, sglang_version=sglang_version),
    }


def export_sglang(draft: Eagle3Draft, folder: str | Path, *, sglang_version: SGLangVersion | None = None,
                  include_embeddings: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `draft` as an SGLang EAGLE-3 draft folder; returns the folder.

    Keys: midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d (no prefix); embeddings only
    with include_embeddings. The written folder is checked as `load_sglang` would check it.
    """
    _check_exportable(draft)
    config = sglang_config(draft.config, sglang_version, dtype)
    tensors = _weights(draft, "midlayer.", include_embeddings, dtype)
    problems = _sglang_problems(config, {k: v.shape for k, v in tensors.items()}, tensors["d2t"], tensors["t2d"],
                                list(draft.config.aux_layer_ids), sglang_version)
    if problems:  # a bug here, not the caller's: never write a folder we would refuse to load
        raise AssertionError("exported SGLang checkpoint fails its own checks:\n" + "\n".join(problems))
    return _write(Path(folder), config, tensors)


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
        "transformer_layer_config": _layer_config(config),
        "draft_vocab_size": config.draft_vocab_size,
        # vLLM defaults this to true when absent, which moves hidden_norm before the residual: not
        # the layer we trained.
        "norm_before_residual": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(config.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_name_or_path), "architectures": list(verifier_architectures)},
        },
        PROJECT_KEY: _project_record(config),
    }


def export_speculators(draft: Eagle3Draft, folder: str | Path, verifier_name_or_path: str, *,
                       verifier_architectures: Sequence[str] = ("LlamaForCausalLM",), speculative_tokens: int = 3,
                       include_embeddings: bool = False, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `draft` in the vLLM/speculators format (keys layers.0.*, fc, norm, lm_head, d2t, t2d)."""
    _check_exportable(draft)
    config = speculators_config(draft.config, verifier_name_or_path, verifier_architectures, speculative_tokens, dtype)
    tensors = _weights(draft, "layers.0.", include_embeddings, dtype)
    problems = _speculators_problems(config, {k: v.shape for k, v in tensors.items()}, tensors["d2t"], tensors["t2d"],
                                     list(draft.config.aux_layer_ids))
    if problems:
        raise AssertionError("exported speculators checkpoint fails its own checks:\n" + "\n".join(problems))
    return _write(Path(folder), config, tensors)


# ---------------------------------------------------------------- checks shared by both formats

def _read_folder(folder: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], Path]:
    """(config, key -> shape, weights file), reading no tensor data. Refuses pickle checkpoints outright."""
    from safetensors import safe_open

    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(folder, [f"no {CONFIG_FILE}"])
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(folder, [f"{CONFIG_FILE} is not valid JSON: {e}"]) from None
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {pickles}: pickle checkpoints are never loaded)" if pickles else ""
        raise CheckpointError(folder, [f"no {WEIGHTS_FILE}{hint}"])
    with safe_open(str(weights), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return config, shapes, weights


def _load_tensor(weights: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        return f.get_tensor(key)


def _vocab_problems(d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab: int, n_draft: int) -> list[str]:
    from tasks.extract.vocab import validate_vocab

    return validate_vocab(None if d2t is None else d2t.numpy(), None if t2d is None else t2d.numpy(), vocab, n_draft)


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _layer_problems(config: Mapping[str, Any], required: Sequence[str]) -> list[str]:
    missing = [k for k in required if config.get(k) is None]
    return [f"config has no {k}" for k in missing]


def _weight_shape_problems(shapes: Mapping[str, tuple[int, ...]], layer: Mapping[str, Any], prefix: str) -> list[str]:
    """fc / lm_head / layer shapes against the config, named the way CONTRACTS names the failure."""
    h = int(layer["hidden_size"])
    problems = []
    fc = shapes.get("fc.weight")
    if fc is None:
        problems.append("fc.weight is missing: the draft cannot fuse the three aux states")
    elif len(fc) != 2 or fc[0] != h or fc[1] != 3 * h:
        problems.append(f"fc.weight has shape {list(fc)}: its input must be 3 x hidden = {3 * h} (three aux "
                        f"states of the target) and its output hidden = {h}")
    if "lm_head.weight" not in shapes:
        problems.append("lm_head.weight is missing: the draft would propose tokens from an uninitialised head")
    q = shapes.get(f"{prefix}self_attn.q_proj.weight")
    if q is not None and len(q) == 2 and q[1] != 2 * h:
        problems.append(f"{prefix}self_attn.q_proj.weight takes {q[1]} inputs, an EAGLE-3 midlayer takes "
                        f"2 x hidden = {2 * h} ([embeddings, hidden])")
    return problems


def _expected_ids(config: Mapping[str, Any], expected: Sequence[int] | None) -> tuple[list[int] | None, list[str]]:
    record = config.get(PROJECT_KEY) or {}
    recorded = _int_list(record.get("aux_layer_ids"))
    if expected is not None and recorded is not None and list(expected) != recorded:
        return list(expected), [f"the checkpoint records aux layers {recorded} but {list(expected)} were expected"]
    return (list(expected) if expected is not None else recorded), []


def _sglang_problems(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], d2t: torch.Tensor | None,
                     t2d: torch.Tensor | None, expected_aux: Sequence[int] | None,
                     sglang_version: SGLangVersion | None, target_num_layers: int | None = None) -> list[str]:
    problems: list[str] = []
    if config.get("architectures") != [SGLANG_ARCHITECTURE]:
        problems.append(f"architectures is {config.get('architectures')!r}, SGLang's EAGLE-3 draft is "
                        f"[{SGLANG_ARCHITECTURE!r}]")
    base = _layer_problems(config, ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                                    "rms_norm_eps"))
    if base:
        return problems + base
    if config.get("num_hidden_layers", 1) != 1:
        problems.append(f"num_hidden_layers is {config.get('num_hidden_layers')}, this project's drafts have one layer")
    if config.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings is true: SGLang would use the target-vocab embeddings as lm_head and "
                        "skip lm_head.weight without an error")
    if config.get("draft_vocab_size") is None:
        problems.append("config has no draft_vocab_size: SGLang would size lm_head to the full target vocab")

    # Silent failure 3: the ids SGLang reads live in eagle_config, nowhere else.
    eagle = config.get("eagle_config")
    written = _int_list(eagle.get("eagle_aux_hidden_state_layer_ids")) if isinstance(eagle, Mapping) else None
    if written is None:
        where = " (a top-level eagle_aux_hidden_state_layer_ids is ignored by SGLang)" \
            if "eagle_aux_hidden_state_layer_ids" in config else ""
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing: SGLang falls back to its default "
                        f"layers without a word{where}")
    elif isinstance(eagle, Mapping) and eagle.get("use_aux_hidden_state", True) is not True:
        problems.append("eagle_config.use_aux_hidden_state is not true: the draft would get no aux states")
    # Silent failure 4: the ids must capture the layers the draft was trained on, in every SGLang
    # the file may meet.
    expected, id_problems = _expected_ids(config, expected_aux)
    problems += id_problems
    record = config.get(PROJECT_KEY) or {}
    layers = target_num_layers or record.get("target_num_layers")
    version = sglang_version or record.get("sglang_version")
    if written is not None:
        if len(written) != 3:
            problems.append(f"eagle_config has {len(written)} aux layer ids {written}; fc takes exactly 3 states")
        elif layers is None:
            problems.append("the target's layer count is unknown (no project record): pass target_num_layers")
        else:
            versions = (version,) if version else SGLANG_VERSIONS
            captured = {v: sglang_capture_layers(written, int(layers), v) for v in versions}
            if expected is not None:
                for v, got in captured.items():
                    if got != expected:
                        problems.append(f"eagle_config ids {written} make SGLang {v} capture layers {got}, the draft "
                                        f"was trained on layers {expected} (project convention: output of layer i)")
            elif len({tuple(c) for c in captured.values()}) > 1:
                problems.append(f"eagle_config ids {written} capture different layers before and since SGLang PR "
                                f"#25454 ({captured}); name the SGLang version")
    # Silent failures 2 and 6: keys SGLang drops, parameters nothing fills, wrong shapes.
    problems += _weight_shape_problems(shapes, config, "midlayer.")
    report = sglang_load_report(shapes, config)
    layers0 = [k for k in report.skipped if k.startswith("layers.0.")]
    if layers0:
        problems.append(f"{len(layers0)} keys are layers.0.* (e.g. {layers0[0]}): SGLang expects midlayer.* and "
                        "skips the others without an error, serving a random decoder layer")
    prefixed = [k for k in report.skipped if k.startswith("draft_model.")]
    if prefixed:
        problems.append(f"{len(prefixed)} keys carry a draft_model. prefix (e.g. {prefixed[0]}): SGLang skips them")
    others = [k for k in report.skipped if k not in layers0 and k not in prefixed]
    problems += [f"{k}: SGLang skips this key without an error" for k in others]
    if not layers0 and not prefixed:  # otherwise the unfilled parameters only repeat the cause
        problems += [f"{p}: no checkpoint key fills this SGLang parameter (it would serve random weights)"
                     for p in report.unloaded if not p.startswith(("model.embed_tokens", "lm_head"))]
    # fc and q_proj shapes were named above in CONTRACTS' words; the rest as SGLang's loader sees them.
    problems += [e for e in report.shape_errors if not e.startswith(("fc.weight", "midlayer.self_attn.q_proj."))]
    # Silent failure 5: d2t offsets, t2d mask.
    n_draft = config.get("draft_vocab_size") or config["vocab_size"]
    problems += _vocab_problems(d2t, t2d, int(config["vocab_size"]), int(n_draft))
    return problems


def speculators_header_problems(config: Mapping[str, Any]) -> list[str]:
    """What makes vLLM refuse a speculators config.json, or load it as another model type."""
    problems: list[str] = []
    if config.get("architectures") != [SPECULATORS_ARCHITECTURE]:
        problems.append(f"architectures is {config.get('architectures')!r}, expected [{SPECULATORS_ARCHITECTURE!r}]")
    if config.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {config.get('speculators_model_type')!r}, expected 'eagle3'")
    spec = config.get("speculators_config")
    try:
        _ = spec["proposal_methods"][0]["speculative_tokens"]
        _ = spec["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError):
        problems.append("speculators_config lacks proposal_methods[0].speculative_tokens or verifier.name_or_path "
                        "(vLLM refuses it)")
    return problems


def _speculators_problems(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], d2t: torch.Tensor | None,
                          t2d: torch.Tensor | None, expected_aux: Sequence[int] | None,
                          target_num_layers: int | None = None) -> list[str]:
    problems = speculators_header_problems(config)
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        return problems + ["transformer_layer_config is missing or not a mapping"]
    base = _layer_problems(layer, ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                                   "rms_norm_eps"))
    if base:
        return problems + [f"transformer_layer_config: {p}" for p in base]
    if layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"transformer_layer_config.num_hidden_layers is {layer.get('num_hidden_layers')}, expected 1")
    if config.get("draft_vocab_size") is None:
        problems.append("config has no draft_vocab_size")
    if config.get("norm_before_residual") is not False:
        problems.append(f"norm_before_residual is {config.get('norm_before_residual')!r}: vLLM treats a missing value "
                        "as true (hidden_norm before the residual); this draft was trained with false")
    written = _int_list(config.get("eagle_aux_hidden_state_layer_ids"))
    expected, id_problems = _expected_ids(config, expected_aux)
    problems += id_problems
    layers = target_num_layers or (config.get(PROJECT_KEY) or {}).get("target_num_layers")
    if written is None:
        problems.append("eagle_aux_hidden_state_layer_ids is missing at top level: vLLM would capture its default "
                        "layers without a word")
    elif len(written) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids has {len(written)} ids {written}; fc takes exactly 3")
    elif layers is None:
        problems.append("the target's layer count is unknown (no project record): pass target_num_layers")
    elif expected is not None and vllm_capture_layers(written, int(layers)) != expected:
        problems.append(f"eagle_aux_hidden_state_layer_ids {written} make vLLM capture layers "
                        f"{vllm_capture_layers(written, int(layers))}, the draft was trained on layers {expected}")
    problems += _weight_shape_problems(shapes, layer, "layers.0.")
    known = {f"layers.0.{n}" for n in _MIDLAYER_KEYS} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                                                         "embed_tokens.weight"}
    vllm_names = {k.replace("midlayer.", "layers.0.") for k in shapes}  # vLLM renames midlayer. itself
    unknown = sorted(vllm_names - known)
    if unknown:
        problems.append(f"keys vLLM has no parameter for: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    missing = sorted(k for k in known - vllm_names if k.startswith("layers.0.") or k == "norm.weight")
    if missing:
        problems.append(f"missing decoder weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    n_draft = config.get("draft_vocab_size") or layer["vocab_size"]
    problems += _vocab_problems(d2t, t2d, int(layer["vocab_size"]), int(n_draft))
    return problems


_MIDLAYER_KEYS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


# ---------------------------------------------------------------- load

def _draft_config(layer: Mapping[str, Any], n_draft: int, aux: Sequence[int], layers: int) -> DraftConfig:
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
                       draft_vocab_size=int(n_draft), aux_layer_ids=tuple(aux), target_num_layers=int(layers))


def _build(folder: Path, weights: Path, key_map: Mapping[str, str], config: DraftConfig,
           embed_tokens: torch.Tensor | None) -> Eagle3Draft:
    """An `Eagle3Draft` filled from `weights`; key_map: file key -> draft state_dict name."""
    draft = Eagle3Draft(config)
    state = {name: _load_tensor(weights, key) for key, name in key_map.items() if name not in ("d2t", "t2d")}
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
    draft.set_vocab(_load_tensor(weights, "d2t"), _load_tensor(weights, "t2d"))
    if embed is not None:
        load_target_embeddings(draft, embed)
    return draft


def _key_map(keys: Sequence[str], midlayer_prefix: str) -> dict[str, str]:
    return {k: "midlayer." + k.removeprefix(midlayer_prefix) if k.startswith(midlayer_prefix) else k for k in keys}


def _aux_for_load(config: Mapping[str, Any], written: list[int] | None, expected: Sequence[int] | None,
                  capture: Any, folder: Path) -> list[int]:
    ids, _ = _expected_ids(config, expected)
    if ids is not None:
        return ids
    if written is not None:
        captured = capture(written)
        if None not in captured:
            return captured
    raise CheckpointError(folder, [("cannot tell which target layers the draft reads: no project record and no "
                                    "usable layer ids; pass expected_aux_layer_ids")])


def check_sglang(folder: str | Path, *, expected_aux_layer_ids: Sequence[int] | None = None,
                 target_num_layers: int | None = None, sglang_version: SGLangVersion | None = None) -> list[str]:
    """Every reason SGLang would serve this folder wrongly; an empty list means it passes."""
    folder = Path(folder)
    config, shapes, weights = _read_folder(folder)
    d2t = _load_tensor(weights, "d2t") if "d2t" in shapes else None
    t2d = _load_tensor(weights, "t2d") if "t2d" in shapes else None
    return _sglang_problems(config, shapes, d2t, t2d, expected_aux_layer_ids, sglang_version, target_num_layers)


def load_sglang(folder: str | Path, *, embed_tokens: torch.Tensor | None = None,
                expected_aux_layer_ids: Sequence[int] | None = None, target_num_layers: int | None = None,
                sglang_version: SGLangVersion | None = None) -> Eagle3Draft:
    """The draft in an SGLang folder, after `check_sglang` passes (else `CheckpointError`, one line per problem).

    Embeddings come from the file (if exported with them) or `embed_tokens` (the target's input
    embeddings); otherwise they stay zero and must be set with `load_target_embeddings`.
    """
    folder = Path(folder)
    config, shapes, weights = _read_folder(folder)
    problems = check_sglang(folder, expected_aux_layer_ids=expected_aux_layer_ids,
                            target_num_layers=target_num_layers, sglang_version=sglang_version)
    if problems:
        raise CheckpointError(folder, problems)
    record = config.get(PROJECT_KEY) or {}
    layers = int(target_num_layers or record["target_num_layers"])
    version = sglang_version or record.get("sglang_version") or SGLANG_VERSIONS[0]
    written = _int_list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    aux = _aux_for_load(config, written, expected_aux_layer_ids,
                        lambda w: sglang_capture_layers(w, layers, version), folder)
    draft_config = _draft_config(config, config["draft_vocab_size"], aux, layers)
    return _build(folder, weights, _key_map(list(shapes), "midlayer."), draft_config, embed_tokens)


def check_speculators(folder: str | Path, *, expected_aux_layer_ids: Sequence[int] | None = None,
                      target_num_layers: int | None = None) -> list[str]:
    """Every reason vLLM would serve this speculators folder wrongly; an empty list means it passes."""
    folder = Path(folder)
    config, shapes, weights = _read_folder(folder)
    d2t = _load_tensor(weights, "d2t") if "d2t" in shapes else None
    t2d = _load_tensor(weights, "t2d") if "t2d" in shapes else None
    return _speculators_problems(config, shapes, d2t, t2d, expected_aux_layer_ids, target_num_layers)


def load_speculators(folder: str | Path, *, embed_tokens: torch.Tensor | None = None,
                     expected_aux_layer_ids: Sequence[int] | None = None,
                     target_num_layers: int | None = None) -> Eagle3Draft:
    """The draft in a speculators folder, after `check_speculators` passes (else `CheckpointError`)."""
    folder = Path(folder)
    config, shapes, weights = _read_folder(folder)
    problems = check_speculators(folder, expected_aux_layer_ids=expected_aux_layer_ids,
                                 target_num_layers=target_num_layers)
    if problems:
        raise CheckpointError(folder, problems)
    layers = int(target_num_layers or (config.get(PROJECT_KEY) or {})["target_num_layers"])
    written = _int_list(config["eagle_aux_hidden_state_layer_ids"])
    aux = _aux_for_load(config, written, expected_aux_layer_ids, lambda w: vllm_capture_layers(w, layers), folder)
    layer = config["transformer_layer_config"]
    draft_config = _draft_config(layer, config["draft_vocab_size"], aux, layers)
    # vLLM renames midlayer. to layers.0. itself, so a speculators file may hold either spelling.
    key_map = {k: "midlayer." + k.removeprefix("layers.0.").removeprefix("midlayer.")
               if k.startswith(("layers.0.", "midlayer.")) else k for k in shapes}
    return _build(folder, weights, key_map, draft_config, embed_tokens)


def load_draft(folder: str | Path, **kwargs: Any) -> Eagle3Draft:
    """Load either format, by its architecture."""
    config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    if config.get("architectures") == [SPECULATORS_ARCHITECTURE]:
        kwargs.pop("sglang_version", None)
        return load_speculators(folder, **kwargs)
    return load_sglang(folder, **kwargs)

