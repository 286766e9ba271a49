"""The serving-contract check ("doctor"): refuses a draft that SGLang or vLLM would serve wrong without an error.

Owns `run_doctor` (a draft folder and its target, optionally the launch command, against one engine),
`DoctorReport`, the `fix=True` repair and `expected_aux_layer_ids_from_lineage`. Promises: each silent
failure of CONTRACTS.md a folder or command can show (1-6), and a draft built for another target, is a
named check whose message says what is wrong and how to fix it, one cause per check where causes can be
told apart; what cannot be verified (trained layers unknown, a non-local --model-path) passes as a
warning, never silently; only safetensors are read; `fix=True` never touches the draft: it writes a
corrected copy only when every failing folder check is mechanical, and re-checks the copy.
"""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from serving.launch import engine_arguments, flag_values, sglang_speculative_problems
from tasks.export import (
    CONFIG_FILE,
    PROJECT_KEY,
    SGLANG_ARCHITECTURE,
    SGLANG_VERSIONS,
    SPECULATORS_ARCHITECTURE,
    WEIGHTS_FILE,
    SGLangVersion,
    sglang_capture_layers,
    sglang_layer_ids,
    sglang_load_report,
    speculators_header_problems,
    vllm_capture_layers,
    vllm_layer_ids,
)

Engine = Literal["sglang", "vllm"]
ENGINES: tuple[Engine, ...] = ("sglang", "vllm")

# The tensors of an EAGLE-3 draft, by their project (and SGLang) names.
MIDLAYER_KEYS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
REQUIRED = ("fc.weight", *(f"midlayer.{k}" for k in MIDLAYER_KEYS), "norm.weight", "lm_head.weight", "d2t", "t2d")
KNOWN = frozenset((*REQUIRED, "embed_tokens.weight"))
_PREFIXES = ("draft_model.", "model.")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_LAYER_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps")
_FOLDER_CHECKS_FIXABLE = ("weight_keys", "vocab_mapping", "eagle_config", "use_aux_hidden_state",
                          "tie_word_embeddings", "norm_before_residual", "aux_layers")


# ---------------------------------------------------------------- report

@dataclass(frozen=True)
class Check:
    """One named check. `message` says what is wrong and how to fix it (or what was verified)."""

    name: str
    ok: bool
    message: str
    warning: bool = False  # passed, but could not be fully verified: the message says what is missing
    fixable: bool = False  # failed, and `fix=True` repairs it mechanically


@dataclass
class DoctorReport:
    """The checks of one draft folder for one engine.

    `passed` is about the folder (and launch command) as given; with `fix=True`, `fixed_dir` is the
    corrected copy (None when nothing could be fixed mechanically) and `fixed` its own report.
    """

    draft_dir: Path
    engine: Engine
    checks: list[Check] = field(default_factory=list)
    architecture: str | None = None
    captured_layers: dict[str, list[int | None]] | None = None  # engine (version) -> layers it captures
    draft_vocab_size: int | None = None
    target_vocab_size: int | None = None
    hidden_size: int | None = None
    fixed_dir: Path | None = None
    fixed: DoctorReport | None = None
    fixes: list[str] = field(default_factory=list)  # what the corrected copy changed
    not_fixed: list[str] = field(default_factory=list)  # why a failing check was left alone

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.ok and c.warning]

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def summary_line(self) -> str:
        """One line: PASS with engine, architecture, captured layers, draft vocab, hidden size; else FAIL and the failed names."""
        if not self.passed:
            return (f"FAIL {self.engine}: {self.draft_dir}: {len(self.failed)} failed check(s): "
                    f"{', '.join(c.name for c in self.failed)}")
        layers = "unknown"
        if self.captured_layers:
            distinct = {tuple(v) for v in self.captured_layers.values()}
            layers = str(list(next(iter(distinct)))) if len(distinct) == 1 else str(self.captured_layers)
        vocab = f"{self.draft_vocab_size}" + (f" of {self.target_vocab_size}" if self.target_vocab_size else "")
        warn = f"; {len(self.warnings)} warning(s): {', '.join(c.name for c in self.warnings)}" if self.warnings else ""
        return (f"PASS {self.engine}: {self.architecture}, captures target layers {layers} (output of layer i, "
                f"0-based), draft vocab {vocab}, hidden {self.hidden_size}{warn}")

    def failure_lines(self) -> list[str]:
        """One line per failed check: `name: what is wrong; how to fix it`."""
        return [f"{c.name}: {c.message}" for c in self.failed]

    def warning_lines(self) -> list[str]:
        return [f"{c.name} (warning): {c.message}" for c in self.warnings]


# ---------------------------------------------------------------- target and folder

@dataclass(frozen=True)
class TargetInfo:
    """What the draft must agree with: the target's text model shape."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    folder: Path | None  # the local model folder, when the target was given as a path


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # Multimodal wrappers (e.g. Kimi-K2.5) keep the language model's shape in text_config.
    text = config.get("text_config")
    if config.get("hidden_size") is None and isinstance(text, Mapping):
        return text
    return config


def load_target_info(target: str | Path | Mapping[str, Any]) -> TargetInfo:
    """The target's hidden size, vocab size and layer count from a config dict, a config.json, or a model folder."""
    folder: Path | None = None
    if isinstance(target, Mapping):
        config: Mapping[str, Any] = target
    else:
        path = Path(target).expanduser()
        if path.is_dir():
            folder, path = path.resolve(), path / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"target {target}: no config.json there; give the target model folder, its "
                                    "config.json, or the config as a dict (a hub id is not read)")
        folder = folder or path.resolve().parent
        config = json.loads(path.read_text())
    text = _text_config(config)
    missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if not isinstance(text.get(k), int)]
    if missing:
        raise ValueError(f"target config has no {', '.join(missing)}")
    return TargetInfo(int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"]), folder)


def _strip_prefixes(key: str) -> str:
    while key.startswith(_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def canonical_key(key: str) -> str:
    """The project name of a checkpoint key: prefixes stripped, `layers.0.` spelled `midlayer.`."""
    key = _strip_prefixes(key)
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


@dataclass
class _Folder:
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
        from safetensors import safe_open

        key = next((k for k in self.shapes if canonical_key(k) == name), None)
        if key is None:
            return None
        with safe_open(str(self.weights), framework="pt") as f:
            return f.get_tensor(key)


def _read_folder(folder: Path) -> tuple[_Folder | None, str | None]:
    from safetensors import safe_open

    if not folder.is_dir():
        return None, f"{folder} is not a folder; give the exported draft folder (config.json + {WEIGHTS_FILE})"
    cfg = folder / CONFIG_FILE
    if not cfg.is_file():
        return None, f"no {CONFIG_FILE} in {folder}; export the draft with tasks.export (export_sglang / export_speculators)"
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        return None, f"{CONFIG_FILE} is not valid JSON ({e}); re-export the draft"
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        hint = f" (found {pickles}: pickle checkpoints are never loaded)" if pickles else ""
        return None, f"no {WEIGHTS_FILE}{hint}; re-export the draft as safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict
    except Exception as e:  # noqa: BLE001 - any unreadable header means the file is not a usable safetensors file
        return None, f"{WEIGHTS_FILE} is not a readable safetensors file ({e}); re-export the draft"
    if not isinstance(config, dict):
        return None, f"{CONFIG_FILE} is not a JSON object; re-export the draft"
    return _Folder(folder, config, shapes, weights), None


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [int(v) for v in value]
    return None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


# ---------------------------------------------------------------- the checks on the folder

@dataclass
class _Context:
    """Everything the checks share, computed once."""

    folder: _Folder
    engine: Engine
    target: TargetInfo
    layer: Mapping[str, Any]  # the draft layer's Llama fields (speculators: transformer_layer_config)
    hidden: int | None
    n_draft: int | None
    expected: list[int] | None
    expected_source: str | None
    expected_conflict: str | None
    versions: tuple[SGLangVersion, ...]
    record: Mapping[str, Any]


def _written_ids(ctx: _Context) -> list[int] | None:
    """The aux layer ids the engine reads: SGLang from eagle_config only, vLLM from the top level only."""
    config = ctx.folder.config
    if ctx.engine == "sglang":
        eagle = config.get("eagle_config")
        return _int_list(eagle.get("eagle_aux_hidden_state_layer_ids")) if isinstance(eagle, Mapping) else None
    return _int_list(config.get("eagle_aux_hidden_state_layer_ids"))


def _default_capture(num_layers: int) -> list[int]:
    """What both engines capture with no ids: states entering layers [2, L//2, L-3], i.e. outputs [1, L//2-1, L-4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def _captured(ctx: _Context) -> dict[str, list[int | None]]:
    """The layers (project convention) the engine captures, per SGLang version (one entry for vLLM)."""
    written, layers = _written_ids(ctx), ctx.target.num_layers
    if ctx.engine == "vllm":
        return {"vllm": vllm_capture_layers(written, layers) if written is not None else _default_capture(layers)}
    return {f"SGLang {v}": sglang_capture_layers(written, layers, v) if written is not None else _default_capture(layers)
            for v in ctx.versions}


def _ids_to_write(ctx: _Context) -> list[int] | None:
    """The ids that make the engine capture the trained layers, or None when they are unknown or unwritable."""
    if ctx.expected is None or ctx.expected_conflict:
        return None
    if ctx.engine == "vllm":
        return vllm_layer_ids(ctx.expected)
    try:
        return sglang_layer_ids(ctx.expected, ctx.target.num_layers, ctx.versions[0] if len(ctx.versions) == 1 else None)
    except ValueError:
        return None


def _check_architecture(ctx: _Context) -> Check:
    config, archs = ctx.folder.config, ctx.folder.config.get("architectures")
    if ctx.engine == "sglang":
        if archs == [SGLANG_ARCHITECTURE]:
            return Check("architecture", True, f"{SGLANG_ARCHITECTURE}")
        hint = (" This is the vLLM/speculators format: check it with engine='vllm', or export with export_sglang."
                if archs == [SPECULATORS_ARCHITECTURE] else
                f" Export with tasks.export.export_sglang, which writes [{SGLANG_ARCHITECTURE!r}].")
        return Check("architecture", False, f"architectures is {archs!r}; SGLang's EAGLE-3 draft class is "
                                            f"[{SGLANG_ARCHITECTURE!r}] and another class loads other weights.{hint}")
    problems = speculators_header_problems(config)
    if problems:
        return Check("architecture", False, "; ".join(problems) + ". Export with tasks.export.export_speculators "
                                                                  "(SGLang folders are not vLLM's format).")
    return Check("architecture", True, SPECULATORS_ARCHITECTURE)


def _check_config_fields(ctx: _Context) -> Check:
    where = "transformer_layer_config" if ctx.engine == "vllm" else CONFIG_FILE
    missing = [k for k in _LAYER_FIELDS if ctx.layer.get(k) is None]
    problems = [f"{where} has no {', '.join(missing)}"] if missing else []
    if ctx.layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"num_hidden_layers is {ctx.layer.get('num_hidden_layers')}; an EAGLE-3 draft has one "
                        "decoder layer (the engine would build and randomly fill the others)")
    if problems:
        return Check("config_fields", False, "; ".join(problems) + ". Re-export the draft (tasks.export).")
    return Check("config_fields", True, "the draft layer's Llama fields are present")


def _check_weight_keys(ctx: _Context) -> Check:
    keys = list(ctx.folder.shapes)
    prefixed = [k for k in keys if k.startswith(_PREFIXES)]
    layers0 = [k for k in keys if _strip_prefixes(k).startswith("layers.0.")] if ctx.engine == "sglang" else []
    unknown = [k for k in keys if canonical_key(k) not in KNOWN]
    by_name: dict[str, list[str]] = {}
    for k in keys:
        by_name.setdefault(canonical_key(k), []).append(k)
    duplicates = [ks for ks in by_name.values() if len(ks) > 1]
    problems = []
    if layers0:
        problems.append(f"{len(layers0)} keys are layers.0.* (e.g. {layers0[0]}): SGLang loads midlayer.* and skips "
                        "the others without an error, serving a randomly initialised decoder layer")
    if prefixed:
        problems.append(f"{len(prefixed)} keys carry a {prefixed[0].split('.', 1)[0]}. prefix (e.g. {prefixed[0]}): the "
                        "contract is unprefixed keys; SGLang skips some prefixed keys (e.g. model.lm_head.weight) "
                        "silently and vLLM's loader adds its own prefix")
    if unknown:
        problems.append(f"{len(unknown)} keys are no EAGLE-3 draft tensor (e.g. {unknown[0]}): "
                        f"{'SGLang skips them without an error' if ctx.engine == 'sglang' else 'vLLM has no parameter for them'}")
    if duplicates:
        problems.append(f"{len(duplicates)} tensors are stored twice under different names (e.g. {duplicates[0]}): "
                        "which one the engine keeps depends on the order of the file")
    if ctx.engine == "sglang" and _layer_complete(ctx):
        # SGLang's loader, replayed: any further key it would drop without a word.
        report = sglang_load_report(ctx.folder.shapes, {**ctx.layer, "tie_word_embeddings": False})
        explained = set(prefixed) | set(layers0) | set(unknown)
        others = [k for k in report.skipped if k not in explained]
        if others:
            problems.append(f"SGLang's loader skips {others[:3]} without an error")
    if not problems:
        return Check("weight_keys", True, "every key is a tensor the engine loads by that name")
    fixable = not unknown and not duplicates
    fix = (" Fix: `eagle3 doctor --fix` renames them (layers.0.* -> midlayer.*, prefixes stripped)." if fixable else
           " Remove the unknown or duplicate tensors and re-export with tasks.export.")
    return Check("weight_keys", False, "; ".join(problems) + "." + fix, fixable=fixable)


_REQUIRED_WHY = {
    "fc.weight": "fc fuses the three aux states (without it the draft reads garbage)",
    "lm_head.weight": "lm_head proposes the tokens (the engine would serve an uninitialised head)",
    "norm.weight": "the final norm (the engine would serve random weights)",
    "d2t": "d2t maps draft ids to target ids (without it draft ids are proposed as target ids)",
    "t2d": "t2d marks the target ids in the draft vocab",
}


def _check_required(ctx: _Context) -> Check:
    have = set(ctx.folder.canonical.values())
    missing = [k for k in REQUIRED if k not in have]
    if not missing:
        return Check("required_tensors", True, "fc, midlayer, norm, lm_head, d2t and t2d are present")
    lines = [f"{k} is missing: {_REQUIRED_WHY[k]}" for k in missing if k in _REQUIRED_WHY]
    mid = [k for k in missing if k.startswith("midlayer.")]
    if mid:
        lines.append(f"{len(mid)} decoder-layer tensors are missing (e.g. {mid[0]}): the engine would serve them "
                     "randomly initialised")
    return Check("required_tensors", False, "; ".join(lines) + ". Not repairable: re-export the trained draft "
                                                               "(tasks.export) from its training checkpoint.")


def _layer_complete(ctx: _Context) -> bool:
    return ctx.hidden is not None and not any(ctx.layer.get(f) is None for f in _LAYER_FIELDS)


def _check_weight_shapes(ctx: _Context) -> Check | None:
    if not _layer_complete(ctx):
        return None
    h = ctx.hidden
    canonical = {}
    for k, s in ctx.folder.shapes.items():
        canonical.setdefault(canonical_key(k), s)
    # fc, q/k/v inputs, lm_head and the embeddings have checks of their own, named after the cause.
    shapes = {k: s for k, s in canonical.items()
              if k not in ("fc.weight", "lm_head.weight", "embed_tokens.weight")
              and not (k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and len(s) == 2 and s[1] != 2 * h)}
    report = sglang_load_report(shapes, {**ctx.layer, "tie_word_embeddings": False})
    if report.shape_errors:
        return Check("weight_shapes", False, "; ".join(report.shape_errors) + ". The config does not describe these "
                                                                              "weights: re-export the draft.")
    return Check("weight_shapes", True, "decoder-layer shapes match the config")


def _check_hidden(ctx: _Context) -> Check | None:
    if ctx.hidden is None:
        return None
    if ctx.hidden != ctx.target.hidden_size:
        return Check("hidden_size", False, f"the draft's hidden_size is {ctx.hidden}, the target's is "
                                           f"{ctx.target.hidden_size}: this draft was built for another target (the "
                                           "server feeds it the target's embeddings and states). Check --target, or "
                                           "train a draft for this target (DraftConfig.from_target_config).")
    return Check("hidden_size", True, f"hidden size {ctx.hidden} matches the target")


def _check_fc(ctx: _Context) -> Check | None:
    fc = ctx.folder.shape("fc.weight")
    if fc is None or ctx.hidden is None:
        return None
    h_t = ctx.target.hidden_size
    problems = []
    if len(fc) != 2 or fc[1] != 3 * h_t:
        problems.append(f"fc.weight has shape {list(fc)}: its input must be 3 x target hidden = {3 * h_t} (three aux "
                        "states); SGLang skips fc when the state it gets already has the embedding width, so a wrong "
                        "fc drafts garbage without an error")
    elif fc[0] != ctx.hidden:
        problems.append(f"fc.weight has {fc[0]} outputs, the draft layer's hidden size is {ctx.hidden}")
    declared = ctx.layer.get("target_hidden_size", ctx.folder.config.get("target_hidden_size"))
    if declared is not None and declared != h_t:
        problems.append(f"config target_hidden_size is {declared}, the target's hidden size is {h_t} (SGLang sizes fc "
                        "from it)")
    if problems:
        return Check("fc_shape", False, "; ".join(problems) + ". Not repairable: train/export a draft for this target.")
    return Check("fc_shape", True, f"fc takes 3 x {h_t} inputs")


def _check_q_proj(ctx: _Context) -> Check | None:
    if ctx.hidden is None:
        return None
    bad = []
    for p in ("q_proj", "k_proj", "v_proj"):
        s = ctx.folder.shape(f"midlayer.self_attn.{p}.weight")
        if s is not None and (len(s) != 2 or s[1] != 2 * ctx.hidden):
            bad.append(f"{p} takes {s[1] if len(s) == 2 else list(s)} inputs")
    if bad:
        return Check("q_proj_input", False, f"{'; '.join(bad)}: an EAGLE-3 midlayer reads [embeddings, hidden], "
                                            f"2 x hidden = {2 * ctx.hidden} inputs (an EAGLE-1/2 layer reads H). "
                                            "Not repairable: this is not an EAGLE-3 draft layer.")
    return Check("q_proj_input", True, f"q/k/v take 2 x {ctx.hidden} inputs")


def _check_lm_head(ctx: _Context) -> Check | None:
    head = ctx.folder.shape("lm_head.weight")
    if ctx.n_draft is None:
        return Check("lm_head_rows", False, "config has no draft_vocab_size: SGLang sizes lm_head to the full target "
                                            "vocab, not this draft's. Re-export the draft (tasks.export writes it).")
    if head is None:
        return None  # required_tensors names the missing head
    problems = []
    if head[0] != ctx.n_draft:
        problems.append(f"lm_head.weight has {head[0]} rows, draft_vocab_size is {ctx.n_draft}")
    if ctx.hidden is not None and len(head) == 2 and head[1] != ctx.hidden:
        problems.append(f"lm_head.weight takes {head[1]} inputs, hidden size is {ctx.hidden}")
    if problems:
        return Check("lm_head_rows", False, "; ".join(problems) + ": the engine's lm_head would not match. Re-export "
                                                                  "the draft with its own draft_vocab_size.")
    return Check("lm_head_rows", True, f"lm_head has draft_vocab_size = {ctx.n_draft} rows")


def _check_target_vocab(ctx: _Context) -> Check | None:
    v = ctx.target.vocab_size
    problems = []
    vocab = _int(ctx.layer.get("vocab_size"))
    if vocab is not None and vocab != v:
        problems.append(f"the draft config's vocab_size is {vocab}, the target's is {v}")
    embed = ctx.folder.shape("embed_tokens.weight")
    if embed is not None and embed[0] != v:
        problems.append(f"the saved embed_tokens.weight has {embed[0]} rows, the target vocab has {v}")
    t2d = ctx.folder.shape("t2d")
    if t2d is not None and tuple(t2d) != (v,):
        problems.append(f"t2d has shape {list(t2d)}, it must mark the target vocab ({v},)")
    if problems:
        return Check("target_vocab", False, "; ".join(problems) + ": this draft's vocabulary was built for another "
                                                                  "target. Check --target, or train for this target.")
    return Check("target_vocab", True, f"target vocab {v} matches")


def _offsets_from_absolute(d2t: np.ndarray, t2d: np.ndarray | None, vocab: int, n: int) -> np.ndarray | None:
    """`d2t` as offsets when it holds strictly increasing absolute target ids (and then passes validate_vocab)."""
    from tasks.vocab import validate_vocab

    if d2t.ndim != 1 or d2t.dtype.kind not in "iu" or len(d2t) != n:
        return None
    ids = d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab or (n > 1 and not np.all(np.diff(ids) > 0)):
        return None
    offsets = ids - np.arange(n, dtype=np.int64)
    return offsets if not validate_vocab(offsets, t2d, vocab, n) else None


def _check_vocab_mapping(ctx: _Context) -> Check | None:
    from tasks.vocab import validate_vocab

    d2t_t, t2d_t = ctx.folder.tensor("d2t"), ctx.folder.tensor("t2d")
    if d2t_t is None and t2d_t is None:
        return None  # required_tensors names them
    d2t = None if d2t_t is None else d2t_t.numpy()
    t2d = None if t2d_t is None else t2d_t.numpy()
    n = ctx.n_draft or (len(d2t) if d2t is not None and d2t.ndim == 1 else 0)
    lines = validate_vocab(d2t, t2d, ctx.target.vocab_size, n)
    # Missing tensors and a t2d sized for another vocab are other checks' causes.
    lines = [p for p in lines if not p.startswith(("d2t is missing", "t2d is missing", "t2d has shape"))]
    if not lines:
        return Check("vocab_mapping", True, "d2t holds offsets to strictly increasing target ids that t2d marks")
    fixable = d2t is not None and _offsets_from_absolute(d2t, t2d, ctx.target.vocab_size, n) is not None
    fix = (" Fix: `eagle3 doctor --fix` rewrites d2t as offsets (d2t[i] = target_id(i) - i)." if fixable else
           " Not repairable mechanically: rebuild the vocab (tasks.vocab.build_draft_vocab) and re-export.")
    return Check("vocab_mapping", False, "; ".join(lines) + "; SGLang proposes target id d2t[i] + i for draft id i, "
                                                           "so the draft would propose wrong tokens." + fix,
                 fixable=fixable)


def _check_eagle_config(ctx: _Context) -> Check:
    config = ctx.folder.config
    written = _written_ids(ctx)
    fixable = _ids_to_write(ctx) is not None
    fix = (" Fix: `eagle3 doctor --fix` writes them from the trained layers." if fixable else
           " Re-export with tasks.export, or give the trained layers (lineage / expected_aux_layer_ids) and use --fix.")
    default = _default_capture(ctx.target.num_layers)
    if ctx.engine == "sglang":
        if written is not None:
            return Check("eagle_config", True, f"eagle_config.eagle_aux_hidden_state_layer_ids = {written}")
        eagle = config.get("eagle_config")
        if isinstance(eagle, Mapping) and "eagle_aux_hidden_state_layer_ids" in eagle:
            what = f"eagle_config.eagle_aux_hidden_state_layer_ids is {eagle['eagle_aux_hidden_state_layer_ids']!r}, not a list of ints"
        elif "eagle_aux_hidden_state_layer_ids" in config:
            what = ("the layer ids are only at the top level (eagle_aux_hidden_state_layer_ids = "
                    f"{config['eagle_aux_hidden_state_layer_ids']!r}), which SGLang ignores")
        else:
            what = "eagle_config (with eagle_aux_hidden_state_layer_ids) is missing"
        return Check("eagle_config", False, f"{what}: SGLang falls back to its default layers {default} without a word."
                                            + fix, fixable=fixable)
    if written is not None:
        return Check("eagle_config", True, f"eagle_aux_hidden_state_layer_ids = {written}")
    eagle = config.get("eagle_config")
    where = (" (they are only inside eagle_config, which this format does not read)"
             if isinstance(eagle, Mapping) and "eagle_aux_hidden_state_layer_ids" in eagle else "")
    return Check("eagle_config", False, f"top-level eagle_aux_hidden_state_layer_ids is missing{where}: vLLM captures "
                                        f"its default layers {default} without a word." + fix, fixable=fixable)


def _check_use_aux(ctx: _Context) -> Check | None:
    config = ctx.folder.config
    eagle = config.get("eagle_config")
    values = {"eagle_config.use_aux_hidden_state": eagle.get("use_aux_hidden_state")} if isinstance(eagle, Mapping) else {}
    if ctx.engine == "vllm":
        values["use_aux_hidden_state"] = config.get("use_aux_hidden_state")
    wrong = {k: v for k, v in values.items() if v is not None and v is not True}
    if wrong:
        return Check("use_aux_hidden_state", False, f"{', '.join(f'{k} = {v!r}' for k, v in wrong.items())}: the engine "
                                                    "would give this EAGLE-3 draft no aux states (fc never used). Fix: "
                                                    "`eagle3 doctor --fix` sets it to true.", fixable=True)
    if ctx.engine == "sglang" and not isinstance(eagle, Mapping):
        return None  # eagle_config names the missing block
    return Check("use_aux_hidden_state", True, "aux hidden states are used")


def _check_tie(ctx: _Context) -> Check:
    config = ctx.folder.config
    tied = [k for k, v in (("tie_word_embeddings", config.get("tie_word_embeddings")),
                           ("transformer_layer_config.tie_word_embeddings",
                            ctx.layer.get("tie_word_embeddings") if ctx.layer is not config else None)) if v is True]
    if not tied:
        return Check("tie_word_embeddings", True, "lm_head is not tied to the embeddings")
    has_head = ctx.folder.shape("lm_head.weight") is not None
    fix = (" Fix: `eagle3 doctor --fix` sets it to false (lm_head.weight is in the file)." if has_head else
           " There is no lm_head.weight to untie to: re-export the trained draft.")
    return Check("tie_word_embeddings", False, f"{' and '.join(tied)} is true: the engine uses the target-vocab "
                                               "embeddings as lm_head and drops this draft's lm_head.weight without an "
                                               "error." + fix, fixable=has_head)


def _check_norm_before_residual(ctx: _Context) -> Check | None:
    if ctx.engine != "vllm":
        return None
    value = ctx.folder.config.get("norm_before_residual")
    if value is False:
        return Check("norm_before_residual", True, "norm_before_residual is false, as the draft was trained")
    fixable = value is None and bool(ctx.record)
    fix = (" Fix: `eagle3 doctor --fix` sets it to false (this project's drafts apply hidden_norm after taking the "
           "raw residual)." if fixable else
           " Only set it if you know how the draft was trained; this project's drafts need false.")
    return Check("norm_before_residual", False, f"norm_before_residual is {value!r}: vLLM then treats it as true and "
                                                "normalises the hidden state before the residual, a different layer "
                                                "than the one trained." + fix, fixable=fixable)


def _check_aux_layers(ctx: _Context) -> tuple[Check, dict[str, list[int | None]]]:
    captured = _captured(ctx)
    written = _written_ids(ctx)
    layers = ctx.target.num_layers
    problems: list[str] = []
    record_layers = _int(ctx.record.get("target_num_layers"))
    if record_layers is not None and record_layers != layers:
        problems.append(f"the draft was trained on a {record_layers}-layer target, this target has {layers} layers")
    if ctx.expected_conflict:
        problems.append(ctx.expected_conflict)
    if written is not None and len(written) != 3:
        problems.append(f"{len(written)} aux layer ids {written}; fc fuses exactly 3 states")
    unreachable = {k: v for k, v in captured.items() if None in v}
    for k, v in unreachable.items():
        problems.append(f"ids {written} are outside what {k} can capture on a {layers}-layer target (got {v})")
    write = _ids_to_write(ctx)
    fix = ""
    if ctx.expected is not None:
        wrong: dict[tuple[int | None, ...], list[str]] = {}
        for k, v in captured.items():
            if v != ctx.expected and k not in unreachable:
                wrong.setdefault(tuple(v), []).append(k)
        for v, engines in wrong.items():
            problems.append(f"{' and '.join(engines)} capture(s) layers {list(v)} but the draft was trained on "
                            f"{ctx.expected} ({ctx.expected_source}; project convention: output of layer i, 0-based)")
        if write is not None:
            where = "eagle_config.eagle_aux_hidden_state_layer_ids" if ctx.engine == "sglang" else \
                "top-level eagle_aux_hidden_state_layer_ids"
            fix = f" Fix: write {where} = {write} (`eagle3 doctor --fix` does)."
        elif ctx.engine == "sglang" and not ctx.expected_conflict:
            fix = (f" No single id list makes SGLang before and since PR #25454 capture {ctx.expected}: name the "
                   "SGLang version the server runs (sglang_version), then --fix.")
    elif not problems and len({tuple(v) for v in captured.values()}) > 1:
        problems.append(f"ids {written} capture different layers in the two SGLang versions ({captured}) and nothing "
                        "says which the draft was trained on; name the SGLang version (sglang_version) and give the "
                        "trained layers (lineage or expected_aux_layer_ids)")
    if problems:
        # Rewriting the ids repairs every problem above except a draft trained on another target.
        fixable = write is not None and record_layers in (None, layers)
        return Check("aux_layers", False, "; ".join(problems) + "." + fix, fixable=fixable), captured
    if ctx.expected is None:
        layers_seen = next(iter(captured.values()))
        return Check("aux_layers", True, f"cannot verify: neither lineage nor the folder's {PROJECT_KEY} record says "
                                         f"which layers the draft was trained on; {', '.join(captured)} would capture "
                                         f"{layers_seen}. Pass the lineage store or expected_aux_layer_ids to verify.",
                     warning=True), captured
    return Check("aux_layers", True, f"{', '.join(captured)} capture(s) the trained layers {ctx.expected} "
                                     f"({ctx.expected_source})"), captured


# ---------------------------------------------------------------- launch command

_SGLANG_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model-revision",
                 "--speculative-draft-load-format", "--speculative-num-steps", "--speculative-eagle-topk",
                 "--speculative-num-draft-tokens", "--speculative-accept-threshold-single",
                 "--speculative-accept-threshold-acc", "--speculative-token-map", "--speculative-attention-mode",
                 "--model-path", "--page-size", "--attention-backend")
_SGLANG_ALIASES = {"--speculative-draft-model": "--speculative-draft-model-path", "--speculative-algo":
                   "--speculative-algorithm", "--model": "--model-path"}


def _normalise_flags(args: Sequence[str], known: Sequence[str], aliases: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Flags spelled as argparse accepts them (aliases, `_` for `-`, unique prefixes) -> full names; ambiguous ones."""
    out, ambiguous = [], []
    for token in args:
        if not token.startswith("--"):
            out.append(token)
            continue
        name, eq, value = token.partition("=")
        name = name.replace("_", "-")
        if name in aliases:
            name = aliases[name]
        elif name not in known:
            matches = [k for k in known if k.startswith(name)]
            if len(matches) == 1:
                name = matches[0]
            elif len(matches) > 1 and name.startswith("--speculative"):
                ambiguous.append(token)
        out.append(name + eq + value)
    return out, ambiguous


def _same_folder(value: str, folder: Path) -> bool:
    path = Path(value).expanduser()
    return path.exists() and path.resolve() == folder.resolve()


def _one(values: list[str | None]) -> tuple[str | None, str | None]:
    """(the value, a problem) for a flag that must be given once with a value."""
    if not values:
        return None, None
    if len(values) > 1:
        return values[-1], f"given {len(values)} times ({values}); give it once"
    if values[0] is None:
        return None, "given without a value"
    return values[0], None


def _target_check(model: str | None, target: TargetInfo, flag: str) -> Check:
    if model is None:
        return Check("launch_target", False, f"no target model in the command: give {flag} with the target folder")
    if target.folder is not None and _same_folder(model, target.folder):
        return Check("launch_target", True, f"{flag} is the target folder")
    config = Path(model).expanduser() / CONFIG_FILE
    if not config.is_file():
        return Check("launch_target", True, f"cannot verify: {model!r} is not a local folder with a config.json; make "
                                            "sure it is the target the draft was trained for", warning=True)
    try:
        other = load_target_info(Path(model))
    except (ValueError, json.JSONDecodeError) as e:
        return Check("launch_target", False, f"{flag} {model}: its config.json is unusable ({e})")
    diffs = [f"{k} {getattr(other, k)} vs {getattr(target, k)}" for k in ("hidden_size", "vocab_size", "num_layers")
             if getattr(other, k) != getattr(target, k)]
    if diffs:
        return Check("launch_target", False, f"{flag} {model} is not this draft's target ({'; '.join(diffs)} in the "
                                             "target config): point it at the target the draft was trained for")
    return Check("launch_target", True, f"{flag} {model} has the target's shape (another folder: make sure it is the "
                                        "same model)", warning=True)


def _sglang_launch_checks(args: list[str], draft: Path, target: TargetInfo) -> list[Check]:
    args, ambiguous = _normalise_flags(args, _SGLANG_FLAGS, _SGLANG_ALIASES)
    checks: list[Check] = []
    if ambiguous:  # argparse refuses these in current SGLang; older ones may read them as another flag
        checks.append(Check("launch_flags", False, f"ambiguous abbreviated flags {ambiguous}: spell them out"))
    algo, problem = _one(flag_values(args, ["--speculative-algorithm"]))
    if algo is None:
        checks.append(Check("launch_algorithm", False, f"--speculative-algorithm {problem or 'is missing'}: the server "
                                                       "would not speculate at all. Add --speculative-algorithm EAGLE3."))
    elif problem or algo.upper() != "EAGLE3":
        why = {"EAGLE": "with EAGLE, SGLang captures no aux states, the draft gets H-dim final states, fc is skipped "
                        "and acceptance is ~1.0 with no error anywhere",
               "NEXTN": "SGLang turns NEXTN into EAGLE (an MTP layer path), which captures no aux states"}
        checks.append(Check("launch_algorithm", False, f"--speculative-algorithm {algo}"
                                                       f"{' (' + problem + ')' if problem else ''}: this EAGLE-3 draft "
                                                       f"needs EAGLE3; {why.get(algo.upper(), 'that is not the EAGLE-3 path')}. "
                                                       "Use --speculative-algorithm EAGLE3."))
    else:
        checks.append(Check("launch_algorithm", True, "--speculative-algorithm EAGLE3"))
    path, problem = _one(flag_values(args, ["--speculative-draft-model-path"]))
    if path is None or problem:
        checks.append(Check("launch_draft_path", False, f"--speculative-draft-model-path {problem or 'is missing'}; "
                                                        f"give --speculative-draft-model-path {draft.resolve()}"))
    elif not _same_folder(path, draft):
        checks.append(Check("launch_draft_path", False, f"--speculative-draft-model-path {path} is not this draft "
                                                        f"({draft.resolve()}); the server would load another "
                                                        "checkpoint than the one checked"))
    else:
        checks.append(Check("launch_draft_path", True, f"--speculative-draft-model-path is {draft.resolve()}"))
    values: dict[str, Any] = {}
    problems: list[str] = []
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                 "--page-size", "--attention-backend"):
        value, problem = _one(flag_values(args, [flag]))
        if problem:
            problems.append(f"{flag} {problem}")
        if value is not None and flag != "--attention-backend":
            try:
                value = int(value)
            except ValueError:
                problems.append(f"{flag} {value!r} is not a whole number")
        values[flag] = value
    problems += sglang_speculative_problems(values["--speculative-num-steps"], values["--speculative-eagle-topk"],
                                            values["--speculative-num-draft-tokens"], page_size=values["--page-size"],
                                            attention_backend=values["--attention-backend"])
    if problems:
        checks.append(Check("launch_speculative_params", False, "; ".join(problems)))
    else:
        checks.append(Check("launch_speculative_params", True,
                            f"steps {values['--speculative-num-steps']}, topk {values['--speculative-eagle-topk']}, "
                            f"draft tokens {values['--speculative-num-draft-tokens']}"))
    model, problem = _one(flag_values(args, ["--model-path"]))
    checks.append(Check("launch_target", False, f"--model-path {problem}") if problem else
                  _target_check(model, target, "--model-path"))
    return checks


def _vllm_launch_checks(argv: list[str], args: list[str], draft: Path, target: TargetInfo) -> list[Check]:
    checks: list[Check] = []
    legacy = sorted({t.split("=", 1)[0] for t in args if t.split("=", 1)[0].replace("_", "-") in
                     ("--speculative-model", "--num-speculative-tokens", "--speculative-draft-tensor-parallel-size")})
    raw, problem = _one(flag_values(args, ["--speculative-config"]))
    spec: Any = None
    if raw is not None:
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as e:
            problem = f"is not valid JSON ({e})"
    if not isinstance(spec, Mapping):
        hint = f" (old-style flags {legacy} are not read by current vLLM)" if legacy else ""
        msg = (f"--speculative-config {problem or 'is missing or not a JSON object'}{hint}: give --speculative-config "
               f"'{{\"method\": \"eagle3\", \"model\": \"{draft.resolve()}\", \"num_speculative_tokens\": 3}}'")
        checks.append(Check("launch_algorithm", False, msg))
    else:
        method = spec.get("method")
        if method == "eagle3":
            checks.append(Check("launch_algorithm", True, "speculative method eagle3"))
        elif method is None:
            checks.append(Check("launch_algorithm", False, "the speculative config has no \"method\": vLLM guesses it "
                                                           "from the draft's path ('eagle3' in the name -> eagle3, "
                                                           "'eagle-' -> eagle, else another method); set \"method\": "
                                                           "\"eagle3\""))
        else:
            checks.append(Check("launch_algorithm", False, f"speculative method {method!r}: this EAGLE-3 draft needs "
                                                           "\"eagle3\" (with \"eagle\" no aux states are captured and "
                                                           "acceptance is ~1.0 without an error)"))
        model = spec.get("model")
        if not isinstance(model, str):
            checks.append(Check("launch_draft_path", False, f"the speculative config has no \"model\"; set it to "
                                                            f"{draft.resolve()}"))
        elif not _same_folder(model, draft):
            checks.append(Check("launch_draft_path", False, f"the speculative config's model {model} is not this "
                                                            f"draft ({draft.resolve()})"))
        else:
            checks.append(Check("launch_draft_path", True, f"speculative model is {draft.resolve()}"))
        k = spec.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            checks.append(Check("launch_speculative_params", False, f"num_speculative_tokens is {k!r}: give a positive "
                                                                    "whole number (the draft steps per verify)"))
        else:
            checks.append(Check("launch_speculative_params", True, f"num_speculative_tokens {k}"))
    models = [v for v in flag_values(args, ["--model"]) if v]
    ok_serve = args and not args[0].startswith("-") and len(argv) > len(args) and argv[-len(args) - 1] == "serve"
    if ok_serve:
        models.insert(0, args[0])
    checks.append(_target_check(models[0] if models else None, target, "the `vllm serve` MODEL"))
    return checks


def _launch_checks(launch: str | Sequence[str], engine: Engine, draft: Path, target: TargetInfo) -> list[Check]:
    argv = shlex.split(launch) if isinstance(launch, str) else list(launch)
    args = engine_arguments(argv, engine)
    if args is None:
        other = next((e for e in ENGINES if e != engine and engine_arguments(argv, e) is not None), None)
        hint = f" (it starts {other}: check with engine={other!r})" if other else ""
        expected = "python -m sglang.launch_server ..." if engine == "sglang" else "vllm serve MODEL ..."
        return [Check("launch_command", False, f"the command does not start {engine}{hint}; expected `{expected}`")]
    checks = [Check("launch_command", True, f"starts {engine}")]
    if engine == "sglang":
        return checks + _sglang_launch_checks(args, draft, target)
    return checks + _vllm_launch_checks(argv, args, draft, target)


# ---------------------------------------------------------------- run

def run_doctor(draft_dir: str | Path, target: str | Path | Mapping[str, Any], engine: Engine = "sglang",
               launch: str | Sequence[str] | None = None, expected_aux_layer_ids: Sequence[int] | None = None,
               sglang_version: SGLangVersion | None = None, fix: bool = False,
               fix_dir: str | Path | None = None) -> DoctorReport:
    """Check `draft_dir` against the serving contract of `engine` for `target` (and `launch`, when given).

    target: the target's config as a dict, its config.json, or its model folder (a hub id is not
    read). expected_aux_layer_ids: the layers the draft was trained on (project convention), from
    lineage (`expected_aux_layer_ids_from_lineage`); else the folder's own record is used.
    sglang_version: the SGLang the server runs; None checks both before and since PR #25454.
    fix: write a corrected copy to `fix_dir` (default `<draft_dir>-fixed`) when every failing
    folder check is mechanical, and check the copy (`report.fixed`).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if sglang_version is not None and sglang_version not in SGLANG_VERSIONS:
        raise ValueError(f"sglang_version must be one of {SGLANG_VERSIONS} or None, got {sglang_version!r}")
    draft = Path(draft_dir).expanduser()
    info = load_target_info(target)
    report = DoctorReport(draft_dir=draft, engine=engine, target_vocab_size=info.vocab_size)
    folder, problem = _read_folder(draft)
    if folder is None:
        report.checks.append(Check("files", False, problem or "unreadable draft folder"))
        if launch is not None:
            report.checks += _launch_checks(launch, engine, draft, info)
        return report
    report.checks.append(Check("files", True, f"{CONFIG_FILE} and {WEIGHTS_FILE}"))
    ctx = _context(folder, engine, info, expected_aux_layer_ids, sglang_version)
    archs = folder.config.get("architectures")
    report.architecture = archs[0] if isinstance(archs, list) and len(archs) == 1 else str(archs)
    report.hidden_size, report.draft_vocab_size = ctx.hidden, ctx.n_draft
    aux, captured = _check_aux_layers(ctx)
    report.captured_layers = captured
    for check in (_check_architecture(ctx), _check_config_fields(ctx), _check_weight_keys(ctx), _check_required(ctx),
                  _check_weight_shapes(ctx), _check_hidden(ctx), _check_fc(ctx), _check_q_proj(ctx),
                  _check_lm_head(ctx), _check_target_vocab(ctx), _check_vocab_mapping(ctx), _check_eagle_config(ctx),
                  _check_use_aux(ctx), _check_tie(ctx), _check_norm_before_residual(ctx), aux):
        if check is not None:
            report.checks.append(check)
    if launch is not None:
        report.checks += _launch_checks(launch, engine, draft, info)
    if fix:
        _fix(report, ctx, target, expected_aux_layer_ids, sglang_version, fix_dir)
    return report


def _context(folder: _Folder, engine: Engine, target: TargetInfo, expected: Sequence[int] | None,
             sglang_version: SGLangVersion | None) -> _Context:
    config = folder.config
    layer = config.get("transformer_layer_config") if engine == "vllm" else config
    if not isinstance(layer, Mapping):
        layer = config
    record = config.get(PROJECT_KEY) if isinstance(config.get(PROJECT_KEY), Mapping) else {}
    recorded = _int_list(record.get("aux_layer_ids"))
    conflict = None
    if expected is not None:
        expected_list, source = [int(i) for i in expected], "from lineage / the caller"
        if recorded is not None and recorded != expected_list:
            conflict = (f"the folder's {PROJECT_KEY} record says the draft was trained on layers {recorded}, lineage / "
                        f"the caller says {expected_list}: this folder may not be the checkpoint you think")
    elif recorded is not None:
        expected_list, source = recorded, f"from the folder's {PROJECT_KEY} record"
    else:
        expected_list, source = None, None
    versions = (sglang_version,) if sglang_version else SGLANG_VERSIONS
    return _Context(folder=folder, engine=engine, target=target, layer=layer, hidden=_int(layer.get("hidden_size")),
                    n_draft=_int(config.get("draft_vocab_size")), expected=expected_list, expected_source=source,
                    expected_conflict=conflict, versions=versions, record=record)


# ---------------------------------------------------------------- fix

def _fix(report: DoctorReport, ctx: _Context, target: str | Path | Mapping[str, Any],
         expected: Sequence[int] | None, sglang_version: SGLangVersion | None, fix_dir: str | Path | None) -> None:
    failing = [c for c in report.failed if not c.name.startswith("launch_")]
    if not failing:
        report.not_fixed.append("nothing to fix: every folder check passes")
        return
    refused = [c for c in failing if not (c.fixable and c.name in _FOLDER_CHECKS_FIXABLE)]
    if refused:
        report.not_fixed += [f"{c.name}: not a mechanical repair ({c.message})" for c in refused]
        report.not_fixed.append("no corrected copy written: fix the problems above first (a copy that still fails "
                                "would only move the problem)")
        return
    out = Path(fix_dir).expanduser() if fix_dir is not None else \
        ctx.folder.path.resolve().with_name(ctx.folder.path.resolve().name + "-fixed")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; remove it or give another fix_dir")
    config, tensors, fixes = _repair(ctx, {c.name for c in failing})
    _write_copy(ctx.folder.path, out, config, tensors)
    report.fixed_dir, report.fixes = out, fixes
    # The launch command names the original folder, so the copy is checked on its own.
    report.fixed = run_doctor(out, target, ctx.engine, None, expected, sglang_version)


def _repair(ctx: _Context, failing: set[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    import copy

    from safetensors.torch import load_file

    config = copy.deepcopy(ctx.folder.config)
    tensors = load_file(str(ctx.folder.weights))
    fixes: list[str] = []
    if "weight_keys" in failing:
        spell = (lambda n: "layers.0." + n.removeprefix("midlayer.") if n.startswith("midlayer.") else n) \
            if ctx.engine == "vllm" else (lambda n: n)
        renamed = {k: spell(canonical_key(k)) for k in tensors}
        changed = sum(1 for k, v in renamed.items() if k != v)
        tensors = {renamed[k]: v for k, v in tensors.items()}
        fixes.append(f"renamed {changed} keys to the engine's spelling (prefixes stripped"
                     f"{', layers.0.* -> midlayer.*' if ctx.engine == 'sglang' else ''})")
    if "vocab_mapping" in failing:
        import torch

        d2t, t2d = tensors["d2t"].numpy(), tensors["t2d"].numpy()
        offsets = _offsets_from_absolute(d2t, t2d, ctx.target.vocab_size, len(d2t))
        assert offsets is not None  # the check said fixable
        tensors["d2t"] = torch.from_numpy(offsets)
        fixes.append("d2t rewritten from absolute target ids to offsets (d2t[i] = target_id(i) - i)")
    if {"eagle_config", "aux_layers"} & failing:
        ids = _ids_to_write(ctx)
        assert ids is not None  # the checks said fixable
        if ctx.engine == "sglang":
            moved = config.pop("eagle_aux_hidden_state_layer_ids", None)
            eagle = dict(config.get("eagle_config") or {})
            eagle["eagle_aux_hidden_state_layer_ids"] = ids
            eagle.setdefault("use_aux_hidden_state", True)
            config["eagle_config"] = eagle
            record = dict(config.get(PROJECT_KEY) or {})
            if record:
                record["sglang_version"] = ctx.versions[0] if len(ctx.versions) == 1 else None
                config[PROJECT_KEY] = record
            fixes.append(f"eagle_config.eagle_aux_hidden_state_layer_ids = {ids} (capture layers {ctx.expected} in "
                         f"{', '.join('SGLang ' + v for v in ctx.versions)})"
                         + (f"; removed the ignored top-level ids {moved}" if moved is not None else ""))
        else:
            config["eagle_aux_hidden_state_layer_ids"] = ids
            fixes.append(f"eagle_aux_hidden_state_layer_ids = {ids} (vLLM captures layers {ctx.expected})")
    if "use_aux_hidden_state" in failing:
        if isinstance(config.get("eagle_config"), dict):
            config["eagle_config"]["use_aux_hidden_state"] = True
        if ctx.engine == "vllm" and "use_aux_hidden_state" in config:
            config["use_aux_hidden_state"] = True
        fixes.append("use_aux_hidden_state = true")
    if "tie_word_embeddings" in failing:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("transformer_layer_config"), dict):
            config["transformer_layer_config"]["tie_word_embeddings"] = False
        fixes.append("tie_word_embeddings = false (lm_head.weight is in the file)")
    if "norm_before_residual" in failing:
        config["norm_before_residual"] = False
        fixes.append("norm_before_residual = false")
    record = config.get(PROJECT_KEY)
    if isinstance(record, dict):
        record["doctor"] = {"fixed_from": str(ctx.folder.path.resolve()), "fixes": fixes}
    return config, tensors, fixes


def _write_copy(source: Path, out: Path, config: dict[str, Any], tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    from storage.datasets import write_folder_atomically

    if out.exists():
        out.rmdir()  # empty (checked by the caller)

    def write(tmp: Path) -> None:
        for p in source.iterdir():  # README, tokenizer files...: kept; pickles never copied
            if p.is_file() and p.name not in (CONFIG_FILE, WEIGHTS_FILE) and p.suffix not in _PICKLE_SUFFIXES:
                shutil.copy2(p, tmp / p.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    if not write_folder_atomically(out, write):
        raise FileExistsError(f"{out} was created by someone else during the fix")


# ---------------------------------------------------------------- lineage

def expected_aux_layer_ids_from_lineage(lineage_db_path: str | Path, draft_dir: str | Path) -> list[int] | None:
    """The aux layers the checkpoint at `draft_dir` was trained on, from the lineage store's `checkpoints` table.

    Read-only (LineageStore.query_readonly). Paths are compared resolved (a relative stored path is
    tried against the current directory and the store's folder). None when the store does not exist
    or has no row for this folder; ValueError when rows disagree with each other or with the
    extraction settings they name (the lineage would then not say which layers are right).
    """
    from storage.lineage import LineageStore

    db = Path(lineage_db_path).expanduser()
    if not db.exists():
        return None
    _, rows = LineageStore(db).query_readonly(
        "SELECT c.path, c.aux_layer_ids, e.settings FROM checkpoints c "
        "LEFT JOIN extract_settings e ON e.extract_key = c.extract_key")
    want = Path(draft_dir).expanduser().resolve()
    found: dict[tuple[int, ...], list[str]] = {}
    for path, ids, settings in rows:
        p = Path(path).expanduser()
        candidates = [p] if p.is_absolute() else [Path.cwd() / p, db.parent / p]
        if not any(c.resolve() == want for c in candidates):
            continue
        ids = [int(i) for i in ids]
        extracted = _int_list((json.loads(settings) if isinstance(settings, str) else settings or {})
                              .get("aux_layer_ids")) if settings is not None else None
        if extracted is not None and extracted != ids:
            raise ValueError(f"lineage {db}: checkpoint {path} records aux layers {ids} but its extraction used "
                             f"{extracted}")
        found.setdefault(tuple(ids), []).append(str(path))
    if len(found) > 1:
        raise ValueError(f"lineage {db}: rows for {want} disagree on the aux layers: {found}")
    return list(next(iter(found))) if found else None
