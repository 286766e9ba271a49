"""The serving contract of a draft folder, checked in one place: the validator that export and the doctor both call.

Owns `check_folder` (every folder check of one engine's contract, in report order, and the layers the
engine would capture), `folder_problems` (the same checks for export's read-back and the loaders, the
folder's own config standing for the target) and the checks every engine shares (keys, required
tensors, shapes, fc, q_proj, lm_head, vocab, d2t, use_aux_hidden_state, tie_word_embeddings, aux
layers). Promises: one set of messages: each failing check says what is wrong and how to fix it, one
cause per check where causes can be told apart, and `fixable=True` only where the doctor's repair
(serving/doctor/fix.py) mends it mechanically; where engines differ, a check asks `ctx.contract` (the
engine's package, serving/<engine>/doctor.py) and never an engine's name. The contracts themselves:
docs/contracts.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from serving.doctor.core import Check, Context, EngineContract, TargetInfo, make_context
from serving.draft_folder import (
    CONFIG_FILE,
    EAGLE31_FLAGS,
    EAGLE31_WEIGHTS,
    KNOWN,
    LAYER_FIELDS,
    PREFIXES,
    PROJECT_KEY,
    REQUIRED,
    Folder,
    as_int,
    canonical_key,
    read_folder,
)
from serving.sglang.layers import SGLangVersion
from serving.sglang.loader import sglang_load_report


# ---------------------------------------------------------------- the validator

def check_folder(folder: Folder, contract: EngineContract, target: TargetInfo, expected: Sequence[int] | None = None,
                 sglang_version: SGLangVersion | None = None) -> tuple[Context, list[Check], dict[str, list[int | None]]]:
    """Every folder check of `contract` for `target`, in report order, and what the engine captures (per version).

    expected: the layers the draft was trained on (project convention), else the folder's record says.
    """
    ctx = make_context(folder, contract, target, expected, sglang_version)
    if contract.aux_checks is not None:
        aux, captured = contract.aux_checks(ctx)
    else:
        check, captured = check_aux_layers(ctx)
        aux = [check]
    return ctx, [*folder_checks(ctx), *aux], captured


def failure_lines(checks: Sequence[Check]) -> list[str]:
    """One line per failed check: `name: what is wrong; how to fix it` (the doctor prints the same)."""
    return [f"{c.name}: {c.message}" for c in checks if not c.ok]


def folder_problems(path: str | Path, contract: EngineContract, *, expected: Sequence[int] | None = None,
                    target_num_layers: int | None = None, sglang_version: SGLangVersion | None = None) -> list[str]:
    """`check_folder` for a folder on its own (export's read-back, the loaders): empty when it passes.

    The target is what the folder says of itself: its layer's hidden size and vocab, and the layer
    count from `target_num_layers` or the folder's record. A folder that does not say them is
    reported as such (its architecture and Llama fields), the other checks needing them not run.
    """
    folder, problem = read_folder(Path(path))
    if folder is None:
        return [f"files: {problem}"]
    config = folder.config
    layer = config.get(contract.layer_config_key) if contract.layer_config_key else config
    layer = layer if isinstance(layer, Mapping) else config
    record = config.get(PROJECT_KEY) if isinstance(config.get(PROJECT_KEY), Mapping) else {}
    hidden, vocab = as_int(layer.get("hidden_size")), as_int(layer.get("vocab_size"))
    layers = target_num_layers or as_int(record.get("target_num_layers"))
    target = TargetInfo(hidden or 0, vocab or 0, layers or 0, None)
    if hidden is None or vocab is None or layers is None:
        ctx = make_context(folder, contract, target, expected, sglang_version)
        lines = failure_lines([contract.check_architecture(ctx), check_config_fields(ctx)])
        if layers is None:
            lines.append(f"aux_layers: the target's layer count is unknown (no {PROJECT_KEY} record): pass "
                         "target_num_layers")
        return lines
    _, checks, _ = check_folder(folder, contract, target, expected, sglang_version)
    return failure_lines(checks)


# ---------------------------------------------------------------- the checks every engine shares

def folder_checks(ctx: Context) -> list[Check]:
    """The folder checks in report order (aux_layers is separate: it also gives the captured layers)."""
    contract = ctx.contract
    checks = (contract.check_architecture(ctx), check_config_fields(ctx), check_weight_keys(ctx),
              check_required(ctx), check_weight_shapes(ctx), check_hidden(ctx), check_fc(ctx), check_q_proj(ctx),
              check_lm_head(ctx), check_target_vocab(ctx), check_vocab_mapping(ctx), contract.check_eagle_config(ctx),
              check_use_aux(ctx), check_tie(ctx), check_eagle31_norms(ctx), *(c(ctx) for c in contract.extra_checks))
    return [c for c in checks if c is not None and c.name not in contract.ignores]


def ids_fix_hint(ctx: Context) -> tuple[bool, str]:
    """(fixable, fix sentence) for a check whose repair is writing the aux layer ids."""
    fixable = ctx.contract.ids_to_write(ctx) is not None
    return fixable, (" Fix: `eagle3 doctor --fix` writes them from the trained layers." if fixable else
                     " Re-export the draft (serving.sglang.export / serving.vllm.export), or give the trained layers "
                     "(lineage / expected_aux_layer_ids) and use --fix.")


def check_config_fields(ctx: Context) -> Check:
    where = ctx.contract.layer_config_key or CONFIG_FILE
    missing = [k for k in LAYER_FIELDS if ctx.layer.get(k) is None]
    problems = [f"{where} has no {', '.join(missing)}"] if missing else []
    if ctx.layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"num_hidden_layers is {ctx.layer.get('num_hidden_layers')}; an EAGLE-3 draft has one "
                        "decoder layer (the engine would build and randomly fill the others)")
    if problems:
        return Check("config_fields", False, "; ".join(problems) + ". Re-export the draft (serving.sglang.export / "
                                                                 "serving.vllm.export).")
    return Check("config_fields", True, "the draft layer's Llama fields are present")


def check_weight_keys(ctx: Context) -> Check:
    keys = list(ctx.folder.shapes)
    prefixed = [k for k in keys if k.startswith(PREFIXES)]
    misspelled, misspelled_problem = ctx.contract.misspelled_keys(keys)
    unknown = [k for k in keys if canonical_key(k) not in KNOWN]
    by_name: dict[str, list[str]] = {}
    for k in keys:
        by_name.setdefault(canonical_key(k), []).append(k)
    duplicates = [ks for ks in by_name.values() if len(ks) > 1]
    problems = []
    if misspelled_problem:
        problems.append(misspelled_problem)
    if prefixed:
        problems.append(f"{len(prefixed)} keys carry a {prefixed[0].split('.', 1)[0]}. prefix (e.g. {prefixed[0]}): the "
                        "contract is unprefixed keys; SGLang skips some prefixed keys (e.g. model.lm_head.weight) "
                        "silently and vLLM's loader adds its own prefix")
    if unknown:
        problems.append(f"{len(unknown)} keys are no EAGLE-3 draft tensor (e.g. {unknown[0]}): "
                        f"{ctx.contract.unknown_keys_fate}")
    if duplicates:
        problems.append(f"{len(duplicates)} tensors are stored twice under different names (e.g. {duplicates[0]}): "
                        "which one the engine keeps depends on the order of the file")
    skipped = ctx.contract.loader_skips(ctx, set(prefixed) | set(misspelled) | set(unknown))
    if skipped:
        problems.append(skipped)
    if not problems:
        return Check("weight_keys", True, "every key is a tensor the engine loads by that name")
    fixable = not unknown and not duplicates
    fix = (" Fix: `eagle3 doctor --fix` renames them (layers.0.* -> midlayer.*, prefixes stripped)." if fixable else
           " Remove the unknown or duplicate tensors and re-export the draft.")
    return Check("weight_keys", False, "; ".join(problems) + "." + fix, fixable=fixable)


_REQUIRED_WHY = {
    "fc.weight": "fc fuses the three aux states (without it the draft reads garbage)",
    "lm_head.weight": "lm_head proposes the tokens (the engine would serve an uninitialised head)",
    "norm.weight": "the final norm (the engine would serve random weights)",
    "d2t": "d2t maps draft ids to target ids (without it draft ids are proposed as target ids)",
    "t2d": "t2d marks the target ids in the draft vocab",
}


def check_required(ctx: Context) -> Check:
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
                                                               "(serving.sglang.export / serving.vllm.export) from "
                                                               "its training checkpoint.")


def layer_complete(ctx: Context) -> bool:
    return ctx.hidden is not None and not any(ctx.layer.get(f) is None for f in LAYER_FIELDS)


def check_weight_shapes(ctx: Context) -> Check | None:
    if not layer_complete(ctx):
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


def check_hidden(ctx: Context) -> Check | None:
    if ctx.hidden is None:
        return None
    if ctx.hidden != ctx.target.hidden_size:
        return Check("hidden_size", False, f"the draft's hidden_size is {ctx.hidden}, the target's is "
                                           f"{ctx.target.hidden_size}: this draft was built for another target (the "
                                           "server feeds it the target's embeddings and states). Check --target, or "
                                           "train a draft for this target (DraftConfig.from_target_config).")
    return Check("hidden_size", True, f"hidden size {ctx.hidden} matches the target")


def check_fc(ctx: Context) -> Check | None:
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


def check_q_proj(ctx: Context) -> Check | None:
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


def check_lm_head(ctx: Context) -> Check | None:
    head = ctx.folder.shape("lm_head.weight")
    if ctx.n_draft is None:
        return Check("lm_head_rows", False, "config has no draft_vocab_size: SGLang sizes lm_head to the full target "
                                            "vocab, not this draft's. Re-export the draft (the exports write it).")
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


def check_target_vocab(ctx: Context) -> Check | None:
    v = ctx.target.vocab_size
    problems = []
    vocab = as_int(ctx.layer.get("vocab_size"))
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


def offsets_from_absolute(d2t: np.ndarray, t2d: np.ndarray | None, vocab: int, n: int) -> np.ndarray | None:
    """`d2t` as offsets when it holds strictly increasing absolute target ids (and then passes validate_vocab)."""
    from tasks.extract.vocab import validate_vocab

    if d2t.ndim != 1 or d2t.dtype.kind not in "iu" or len(d2t) != n:
        return None
    ids = d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab or (n > 1 and not np.all(np.diff(ids) > 0)):
        return None
    offsets = ids - np.arange(n, dtype=np.int64)
    return offsets if not validate_vocab(offsets, t2d, vocab, n) else None


def check_vocab_mapping(ctx: Context) -> Check | None:
    from tasks.extract.vocab import validate_vocab

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
    fixable = d2t is not None and offsets_from_absolute(d2t, t2d, ctx.target.vocab_size, n) is not None
    fix = (" Fix: `eagle3 doctor --fix` rewrites d2t as offsets (d2t[i] = target_id(i) - i)." if fixable else
           " Not repairable mechanically: rebuild the vocab (tasks.extract.vocab.build_draft_vocab) and re-export.")
    return Check("vocab_mapping", False, "; ".join(lines) + f"; {ctx.contract.d2t_use}." + fix, fixable=fixable)


def check_use_aux(ctx: Context) -> Check | None:
    config = ctx.folder.config
    eagle = config.get("eagle_config")
    values = {"eagle_config.use_aux_hidden_state": eagle.get("use_aux_hidden_state")} if isinstance(eagle, Mapping) else {}
    if ctx.contract.top_level_use_aux:
        values["use_aux_hidden_state"] = config.get("use_aux_hidden_state")
    wrong = {k: v for k, v in values.items() if v is not None and v is not True}
    if wrong:
        return Check("use_aux_hidden_state", False, f"{', '.join(f'{k} = {v!r}' for k, v in wrong.items())}: the engine "
                                                    "would give this EAGLE-3 draft no aux states (fc never used). Fix: "
                                                    "`eagle3 doctor --fix` sets it to true.", fixable=True)
    if not ctx.contract.top_level_use_aux and not isinstance(eagle, Mapping):
        return None  # eagle_config names the missing block
    return Check("use_aux_hidden_state", True, "aux hidden states are used")


def check_eagle31_norms(ctx: Context) -> Check | None:
    """The Eagle 3.1 norms (norm_before_fc, fc_norm, norm_output): refused by an engine without them, and on
    one that serves them, each flag matched by its weights (a flag without them serves uninitialised norms,
    weights without their flag are never applied). None for a draft that uses none."""
    config = ctx.folder.config
    flags = [f for f in EAGLE31_FLAGS if config.get(f) is True]
    have = set(ctx.folder.canonical.values())
    weights = [w for w in EAGLE31_WEIGHTS if w in have]
    if not flags and not weights:
        return None
    if not ctx.contract.serves_eagle31_norms:
        used = ", ".join(flags + [w for w in weights if not flags])
        return Check("eagle31_norms", False, f"the draft was trained with Eagle 3.1 norms ({used}); "
                                             f"{ctx.contract.name} has no such option and would serve it without them: "
                                             "wrong hidden states, acceptance collapses without an error. Serve it "
                                             "with vLLM (the speculators format), or train without the norms.")
    h = ctx.hidden
    shapes = {canonical_key(k): s for k, s in ctx.folder.shapes.items()}
    problems = []
    if (config.get("norm_before_fc") is True) != ("input_norm.weight" in have):
        problems.append("norm_before_fc is set but input_norm.weight is missing (vLLM would serve an uninitialised "
                        "norm)" if "input_norm.weight" not in have else
                        "input_norm.weight is present but norm_before_fc is not true (vLLM would never apply it)")
    fc_norm = [w for w in EAGLE31_WEIGHTS if w.startswith("fc_norm.") and w in have]
    if (config.get("fc_norm") is True) != bool(fc_norm) or (fc_norm and len(fc_norm) != 3):
        problems.append(f"fc_norm is {config.get('fc_norm')!r} but {len(fc_norm)} of its 3 weights are present")
    if config.get("norm_before_fc") is True and config.get("fc_norm") is True:
        problems.append("norm_before_fc and fc_norm are both set: one norm before fc or one per aux state, not both")
    if h and "input_norm.weight" in shapes and list(shapes["input_norm.weight"]) != [3 * h]:
        problems.append(f"input_norm.weight has shape {list(shapes['input_norm.weight'])}, expected [{3 * h}] "
                        "(the three aux states)")
    if problems:
        return Check("eagle31_norms", False, "; ".join(problems) + ". Re-export the draft "
                                                                 "(serving.vllm.export.export_speculators).")
    return Check("eagle31_norms", True, "Eagle 3.1 norms: " + ", ".join(flags) + ", with their weights")


def check_tie(ctx: Context) -> Check:
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


def check_aux_layers(ctx: Context) -> tuple[Check, dict[str, list[int | None]]]:
    """Do the layers the engine captures match the trained ones? Also returns what it captures, per engine (version)."""
    contract = ctx.contract
    captured = contract.captured(ctx)
    written = contract.written_ids(ctx.folder.config)
    layers = ctx.target.num_layers
    problems: list[str] = []
    record_layers = as_int(ctx.record.get("target_num_layers"))
    if record_layers is not None and record_layers != layers:
        problems.append(f"the draft was trained on a {record_layers}-layer target, this target has {layers} layers")
    if ctx.expected_conflict:
        problems.append(ctx.expected_conflict)
    if written is not None and len(written) != 3:
        problems.append(f"{len(written)} aux layer ids {written}; fc fuses exactly 3 states")
    unreachable = {k: v for k, v in captured.items() if None in v}
    for k, v in unreachable.items():
        problems.append(f"ids {written} are outside what {k} can capture on a {layers}-layer target (got {v})")
    write = contract.ids_to_write(ctx)
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
            fix = f" Fix: write {contract.ids_location} = {write} (`eagle3 doctor --fix` does)."
        elif not ctx.expected_conflict:
            fix = contract.unwritable_ids_hint(ctx)
    elif not problems and len({tuple(v) for v in captured.values()}) > 1:
        # Only an engine that reads the ids differently per version reports more than one capture.
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
