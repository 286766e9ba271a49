"""llama.cpp's side of the serving contract: what its converter reads from a draft folder, what its
loader reads from the converted GGUF, and what `llama-server` does with its launch command.

Owns `CONTRACT` (registered in serving/doctor/run.py); the launch-command checks are
serving/llamacpp/doctor_launch.py, the shared folder checks serving/contract.py. The draft is either the SGLang export that
`convert_hf_to_gguf.py` reads (the shared folder checks, read as the converter reads them) or the
converted `.gguf` (or a folder holding exactly one), which has checks of its own. Promises: the facts
are those of the pinned tree (llama-cpp-python 0.3.36, llama.cpp@0c1e570), file:line in comments;
llama.cpp captures layer *inputs*, so a layer trained on "output of layer i" must be named i+1, and
each way of getting that wrong (ids missing, off by one, count or range) is its own check; a GGUF is
repaired only by re-converting its own SGLang export (checked to be its source), never edited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from serving.contract import folder_checks
from serving.doctor.core import Check, Context, DoctorReport, EngineContract, TargetInfo, make_context
from serving.draft_folder import PROJECT_KEY, Folder, as_int, int_list, read_folder
from serving.llamacpp.doctor_launch import launch_checks
from serving.llamacpp.export import (GGUF_ARCHITECTURE, REQUIRED_TENSORS, GGUFDraftInfo, export_gguf, find_gguf,
                                     not_converted_from, read_gguf_draft)
from serving.llamacpp.layers import default_ids, llamacpp_capture_layers, wanted_ids

CONVERTER = "convert_hf_to_gguf.py"
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
IDS_CHECKS = ("aux_ids_missing", "aux_ids_off_by_one", "aux_layers")
# architectures[0] the converter hands to LlamaModel, the only class that detects EAGLE-3 (conversion/llama.py:17-53).
CONVERTER_ARCHITECTURES = frozenset((
    "LLaMAForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "VLlama3ForCausalLM",
    "LlavaForConditionalGeneration", "VoxtralForConditionalGeneration", "LlamaForCausalLMEagle3",
    "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel", "IQuestCoderForCausalLM", "LlamaModel"))
# tasks/model/draft.py: the residual is the raw hidden state and fc reads the states un-normed.
TRAINED_NORMS = ("norm_before_residual", "norm_before_fc")
OUTTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}


# ---------------------------------------------------------------- the folder the converter reads


def written_ids(config: Mapping[str, Any]) -> list[int] | None:
    """The converter reads a non-empty top-level list only; SGLang's eagle_config is not read (llama.py:77)."""
    return int_list(config.get(IDS_KEY)) or None


def captured(ctx: Context) -> dict[str, list[int | None]]:
    layers = ctx.target.num_layers
    return {"llama.cpp": llamacpp_capture_layers(written_ids(ctx.folder.config) or default_ids(layers), layers)}


def ids_to_write(ctx: Context) -> list[int] | None:
    return None if ctx.expected_conflict else wanted_ids(ctx.expected, ctx.target.num_layers)


def write_ids(ctx: Context, config: dict[str, Any], ids: list[int]) -> str:
    config[IDS_KEY] = ids
    return (f"top-level {IDS_KEY} = {ids} (llama.cpp captures the inputs of those layers: the outputs of the trained "
            f"layers {ctx.expected})")


def check_architecture(ctx: Context) -> Check:
    config = ctx.folder.config
    archs = config.get("architectures")
    merged = {**config, **ctx.layer}  # the converter merges transformer_layer_config in (llama.py:211-213)
    problems = []
    if not (isinstance(archs, list) and archs and archs[0] in CONVERTER_ARCHITECTURES):
        problems.append(f"architectures is {archs!r}: {CONVERTER} detects EAGLE-3 drafts only in its LlamaModel class "
                        "(e.g. LlamaForCausalLMEagle3, Eagle3Speculator); another class is refused or converts "
                        "something else")
    if "draft_vocab_size" not in merged or merged.get("num_hidden_layers") != 1:
        problems.append(f"the converter takes a folder for an EAGLE-3 draft only with draft_vocab_size and "
                        f"num_hidden_layers == 1 (here {merged.get('draft_vocab_size')!r} and "
                        f"{merged.get('num_hidden_layers')!r}); otherwise it writes a plain llama GGUF, which "
                        "--spec-type draft-eagle3 does not run")
    if problems:
        return Check("architecture", False, "; ".join(problems) + ". Export with serving.sglang.export.export_sglang.")
    return Check("architecture", True, f"{archs[0]}, converted as an EAGLE-3 draft")


def check_ids_missing(ctx: Context) -> Check:
    """aux_ids_missing: without the top-level ids the converter writes its default layers without a word."""
    config, layers = ctx.folder.config, ctx.target.num_layers
    want = ids_to_write(ctx)
    fix = (f" Fix: write the top-level {IDS_KEY} = {want} (`eagle3 doctor --engine llamacpp --fix` does; "
           "serving.llamacpp.export.export_gguf writes them when it converts)." if want is not None else
           " Give the trained layers (lineage / expected_aux_layer_ids) and use --fix, or convert with "
           "serving.llamacpp.export.export_gguf, which writes them from the project record.")
    raw, written = config.get(IDS_KEY), written_ids(config)
    if raw and written is None:
        return Check("aux_ids_missing", False, f"top-level {IDS_KEY} is {raw!r}, not a list of whole numbers: the "
                                               "converter writes it as it is." + fix, fixable=want is not None)
    if written is not None:
        return Check("aux_ids_missing", True, f"top-level {IDS_KEY} = {written} (written as eagle3.target_layers)")
    default = default_ids(layers)
    gets = llamacpp_capture_layers(default, layers)
    eagle = config.get("eagle_config")
    nested = eagle.get(IDS_KEY) if isinstance(eagle, Mapping) else None
    what = (f"no top-level {IDS_KEY}" + (f" (the eagle_config ids {nested} are SGLang's: the converter does not read "
                                         "them)" if nested is not None else "") +
            f": {CONVERTER} falls back to its default target_layers {default} without a word, capturing the outputs "
            f"of layers {gets}")
    if ctx.expected is not None and not ctx.expected_conflict and gets == ctx.expected:
        return Check("aux_ids_missing", True, what + f", which by luck are the trained layers {ctx.expected} "
                                                     f"({ctx.expected_source}); write them anyway." + fix, warning=True)
    trained = (f", but the draft was trained on {ctx.expected} ({ctx.expected_source})" if ctx.expected is not None
               else "; nothing says which layers the draft was trained on")
    return Check("aux_ids_missing", False, what + trained + "." + fix, fixable=want is not None)


def _range_problems(written: list[int], num_layers: int, where: str) -> list[str]:
    """What llama.cpp refuses in the ids themselves: a count other than 3, ids past the target's layers."""
    problems = [] if len(written) == 3 else [
        f"{where} = {written}: llama.cpp's EAGLE-3 takes exactly 3 ids (the loader refuses the draft: 'EAGLE3 "
        "requires exactly 3 entries')"]
    for k in written:
        if k > num_layers:
            problems.append(f"id {k} exceeds the target's {num_layers} layers (the server aborts: 'EAGLE3: target "
                            "layer id exceeds target n_layer')")
        elif k == num_layers:
            problems.append(f"id {k} selects the target's nextn state, which llama-style targets do not produce (the "
                            "output of the last layer has no id)")
        elif k < 0:
            problems.append(f"id {k} is no layer")
    return problems


def _layer_checks(written: list[int] | None, num_layers: int, expected: list[int] | None, source: str | None,
                  conflict: str | None, record_layers: int | None, where: str, fix: str, fixable: bool) -> list[Check]:
    """aux_ids_off_by_one and aux_layers for the ids llama.cpp reads (`written`; None: absent)."""
    problems = [conflict] if conflict else []
    if record_layers not in (None, num_layers):
        problems.insert(0, f"the draft was trained on a {record_layers}-layer target, this one has {num_layers} layers")
    off = Check("aux_ids_off_by_one", True, f"{where} are not the trained layers as written (i instead of i+1)"
                if expected is not None else "cannot verify: the trained layers are unknown (see aux_layers)")
    cap = llamacpp_capture_layers(written or [], num_layers)
    if written is None and where.startswith("top-level"):  # aux_ids_missing names it
        off = replace(off, message=f"no {where} to compare")
    elif written is None:
        problems.append(f"{where} is missing: llama.cpp's loader refuses the draft ('requires extract_layers')")
    else:
        problems += _range_problems(written, num_layers, where)
        want = wanted_ids(expected, num_layers)
        if not problems and expected is not None and written == list(expected) != want:
            off = Check("aux_ids_off_by_one", False, (
                f"{where} = {written} are the trained layers in the 'output of layer i' convention, but llama.cpp "
                f"reads id k as the INPUT of layer k (output of layer k-1): it captures {cap}, each one layer too "
                "early, and acceptance drops without an error." + fix), fixable=fixable)
        elif not problems and expected is not None and written != want:
            twice = ", shifted twice?" if want is not None and written == [k + 1 for k in want] else ""
            problems.append(f"{where} = {written}{twice}: llama.cpp captures the outputs of layers {cap}, but the "
                            f"draft was trained on {expected} ({source}; output of layer i, 0-based)")
    if problems:
        ok_fix = fixable and record_layers in (None, num_layers) and not conflict
        return [off, Check("aux_layers", False, "; ".join(problems) + "." + (fix if ok_fix else ""), fixable=ok_fix)]
    if written is None:
        message, warning = f"no {where}: see aux_ids_missing", False
    elif expected is None:
        message, warning = (f"cannot verify: nothing says which layers the draft was trained on; llama.cpp captures "
                            f"the outputs of {cap}. Pass the lineage store or expected_aux_layer_ids to verify."), True
    elif not off.ok:
        message, warning = f"3 ids below the target's {num_layers} layers (which: see aux_ids_off_by_one)", False
    else:
        message, warning = f"llama.cpp captures the trained layers {expected} ({source})", False
    return [off, Check("aux_layers", True, message, warning=warning)]


def aux_checks(ctx: Context) -> tuple[list[Check], dict[str, list[int | None]]]:
    want = ids_to_write(ctx)
    fix = f" Fix: write the top-level {IDS_KEY} = {want} (`eagle3 doctor --engine llamacpp --fix` does)." \
        if want else ""
    checks = _layer_checks(written_ids(ctx.folder.config), ctx.target.num_layers, ctx.expected, ctx.expected_source,
                           ctx.expected_conflict, as_int(ctx.record.get("target_num_layers")), f"top-level {IDS_KEY}",
                           fix, want is not None)
    return checks, captured(ctx)


def _norms_check(values: Mapping[str, Any], ours: bool, where: str, fix: str, has_input_norm: bool) -> Check:
    """norms: what llama.cpp will apply (absent = false) against how this project's drafts are trained (both false)."""
    on = {k: values.get(k) for k in TRAINED_NORMS if values.get(k) not in (None, False)}
    if not on:
        return Check("norms", True, "norm_before_residual and norm_before_fc are false, as tasks/model/draft.py trains")
    does = {"norm_before_residual": "takes the normed hidden state as the residual",
            "norm_before_fc": "normalises the fused target states before fc"}
    what = (f"{where} {', '.join(f'{k} = {v!r}' for k, v in on.items())}: llama.cpp then "
            f"{' and '.join(does[k] for k in on)}, a different layer than the one trained")
    missing = on.get("norm_before_fc") and not has_input_norm
    if missing:
        what += " (and there is no input_norm / enc.output_norm weight for it: the loader refuses the draft)"
    if ours or missing:
        return Check("norms", False, what + ("; this project's drafts are trained with both false." + fix if ours else
                                             ". Re-export the draft as it was trained."), fixable=ours and bool(fix))
    return Check("norms", True, what + "; not this project's export: make sure the draft was trained with it",
                 warning=True)


def check_norms(ctx: Context) -> Check:
    return _norms_check(ctx.folder.config, bool(ctx.record), "the converter writes", " Fix: `eagle3 doctor --engine "
                        "llamacpp --fix` sets both to false.", ctx.folder.shape("input_norm.weight") is not None)


def repair_norms(config: dict[str, Any]) -> str:
    config.update(dict.fromkeys(TRAINED_NORMS, False))
    return "norm_before_residual = false, norm_before_fc = false (as tasks/model/draft.py trains)"


# ---------------------------------------------------------------- the converted GGUF


def _source(path: Path, info: GGUFDraftInfo) -> tuple[Folder | None, str]:
    """The SGLang export the pipeline converted this GGUF from (export/gguf-step-N <- export/sglang-step-N), checked."""
    if not path.parent.name.startswith("gguf-"):
        return None, "no SGLang export of it is known (the pipeline keeps it beside the GGUF, export/sglang-step-N)"
    sibling = path.parent.with_name("sglang-" + path.parent.name.removeprefix("gguf-"))
    folder, problem = read_folder(sibling)
    if folder is None:
        return None, f"its SGLang export {sibling} is unusable ({problem})"
    mismatch = not_converted_from(path, info, folder)
    return (None, f"{sibling} is not what it was converted from ({mismatch})") if mismatch else (folder, "")


def _reconvert_problem(source: Folder | None, why: str, target: TargetInfo, expected: list[int] | None) -> str | None:
    """Why re-converting the source would not repair the GGUF (None: it would)."""
    if source is None:
        return why
    if target.folder is None:
        return "the target was given as a config, not its model folder (the converter needs its tokenizer)"
    ctx = make_context(source, CONTRACT, target, expected, None)
    bad = [c.name for c in folder_checks(ctx) if not c.ok and c.name != "aux_ids_missing"]
    if ids_to_write(ctx) is None or as_int(ctx.record.get("target_num_layers")) not in (None, target.num_layers):
        bad.append("aux_layers")
    return f"its SGLang export {source.path} fails {bad} itself: check and fix it first" if bad else None


def _gguf_checks(info: GGUFDraftInfo, target: TargetInfo, source: Folder | None) -> list[Check]:
    """The GGUF's own checks but the layer ids (architecture is eagle3)."""
    h, v, shapes = target.hidden_size, target.vocab_size, info.tensor_shapes
    missing = [t for t in (*REQUIRED_TENSORS, *(["enc.output_norm.weight"] if info.norm_before_fc else []))
               if t not in shapes]
    fc, ths = shapes.get("fc.weight"), info.target_hidden_size
    fc_problem = (f"fc.weight takes {fc[-1]} inputs, 3 x target hidden = {3 * h}: built for another target. Check "
                  "--target." if fc is not None and (len(fc) != 2 or fc[1] != 3 * h) else
                  f"fc.weight has {fc[0]} outputs, the draft's hidden size is {info.hidden_size}."
                  if fc is not None and fc[0] != info.hidden_size else None)
    vocab = "; ".join(f"{name} is {got}, the target's vocab is {v}" for name, got in (
        ("eagle3.vocab_size", info.vocab_size), ("the tokenizer's token count", info.tokenizer_tokens),
        ("token_embd rows", shapes.get("token_embd.weight", (v,))[0])) if got != v)
    values = {"norm_before_residual": info.norm_before_residual, "norm_before_fc": info.norm_before_fc}
    return [
        Check("required_tensors", not missing, f"tensors missing: {missing} (llama.cpp's eagle3 loader needs them)"
              if missing else "every tensor the loader needs"),
        Check("hidden_size", info.hidden_size == h, f"eagle3.embedding_length {h} is the target's"
              if info.hidden_size == h else f"eagle3.embedding_length is {info.hidden_size}, the target's hidden size "
                                            f"is {h}: this draft was built for another target. Check --target."),
        Check("target_hidden_size", ths == h, f"eagle3.target_hidden_size {h}" if ths == h else
              f"eagle3.target_hidden_size is {ths}, the target's hidden size is {h}: llama.cpp sizes fc's input "
              f"3 x {ths} and refuses the draft (or the target's rows, 'embd row width does not match')."),
        Check("fc_shape", fc_problem is None, fc_problem or f"fc takes 3 x {h} inputs"),
        Check("target_vocab", not vocab, vocab + ": the GGUF's vocabulary belongs to another target (llama.cpp "
              "scatters the draft logits into the draft GGUF's own vocab). Convert with --target-model-dir of this "
              "target." if vocab else f"target vocab {v} matches"),
        _d2t_check(info, target, source),
        _norms_check(values, source is not None and bool(source.config.get(PROJECT_KEY)), "the GGUF says", "",
                     "enc.output_norm.weight" in shapes)]


def _d2t_check(info: GGUFDraftInfo, target: TargetInfo, source: Folder | None) -> Check:
    d2t, v = info.d2t, target.vocab_size
    if d2t is None:
        return Check("d2t", False, "no d2t: llama.cpp then reads the lm_head rows as target ids 0..N-1 (or fails when "
                                   "they are fewer than the target vocab)")
    problems = []
    if info.tensor_types.get("d2t") != "I64":
        problems.append(f"d2t is {info.tensor_types.get('d2t')}, llama.cpp asserts I64")
    rows = info.tensor_shapes.get("output.weight", (None,))[0]
    if rows != d2t.size:
        problems.append(f"d2t has {d2t.size} entries, output.weight {rows} rows")
    if d2t.size and (d2t.min() < 0 or d2t.max() >= v):
        problems.append(f"d2t holds ids outside the target vocab [0, {v})")
    if np.unique(d2t).size != d2t.size:
        sorted_ = d2t.size > 1 and bool(np.all(np.diff(d2t) >= 0))
        problems.append("d2t holds duplicate target ids" + (
            " (non-decreasing: these look like SGLang offsets, not the absolute ids llama.cpp scatters the logits to)"
            if sorted_ else ""))
    if source is not None and not problems:
        offsets = source.tensor("d2t")
        if offsets is not None and not np.array_equal(offsets.numpy().reshape(-1) + np.arange(d2t.size), d2t):
            problems.append(f"d2t is not its SGLang export's offsets + arange ({source.path})")
    if problems:
        return Check("d2t", False, "; ".join(problems) + ": the draft would propose other tokens than it predicts.")
    return Check("d2t", True, f"d2t holds {d2t.size} unique absolute target ids")


def _trained(expected: Sequence[int] | None, source: Folder | None) -> tuple[list[int] | None, str | None, str | None,
                                                                            Mapping[str, Any]]:
    """(the trained layers, where that comes from, a conflict, the source's record): the caller's, else the record's."""
    record = source.config.get(PROJECT_KEY) if source is not None else None
    record = record if isinstance(record, Mapping) else {}
    recorded = int_list(record.get("aux_layer_ids"))
    if expected is None:
        return recorded, None if source is None else f"from the record of {source.path}", None, record
    exp = [int(i) for i in expected]
    conflict = None if recorded in (None, exp) else (
        f"its SGLang export's record says the draft was trained on layers {recorded}, lineage / the caller says {exp}: "
        "this may not be the checkpoint you think")
    return exp, "from lineage / the caller", conflict, record


def check_gguf(draft: Path, target: TargetInfo, expected: Sequence[int] | None, fix: bool,
               fix_dir: Path | None) -> DoctorReport | None:
    """The report for a draft GGUF (None when `draft` is no GGUF: the folder checks run instead)."""
    path, problem = find_gguf(draft)
    if path is None and problem is None:
        return None
    report = DoctorReport(draft_dir=draft, engine="llamacpp", target_vocab_size=target.vocab_size)
    info = None
    try:
        info = read_gguf_draft(path) if path is not None else None
    except Exception as e:  # noqa: BLE001 - any unreadable header means no GGUF llama.cpp could load
        problem = f"{path} is not a readable GGUF ({e}); convert the draft again (serving.llamacpp.export.export_gguf)"
    if path is None or info is None:
        report.checks.append(Check("files", False, problem or ""))
        return report
    report.architecture, report.hidden_size, report.draft_vocab_size = info.architecture, info.hidden_size, \
        info.draft_vocab_size
    blocks = info.metadata.get(f"{info.architecture}.block_count")
    if info.architecture != GGUF_ARCHITECTURE or blocks != 1:
        report.checks += [Check("files", True, f"{path.name} (GGUF)"), Check("architecture", False, (
            f"{path.name} is a {info.architecture!r} GGUF with {blocks} layers, not an EAGLE-3 draft ('eagle3', 1 "
            "layer): the converter did not see an EAGLE-3 draft (draft_vocab_size, num_hidden_layers 1), or this is a "
            "target model"))]
        return report
    source, why = _source(path, info)
    report.checks.append(Check("files", True, f"{path.name} (GGUF)" + (f", converted from {source.path}" if source
                                                                        else f"; {why}")))
    report.checks.append(Check("architecture", True, "eagle3, 1 layer"))
    exp, want_src, conflict, record = _trained(expected, source)
    layers = target.num_layers
    report.captured_layers = {"llama.cpp": llamacpp_capture_layers(info.target_layers or [], layers)}
    reconvert = _reconvert_problem(source, why, target, exp)
    fix_line = (" Fix: `eagle3 doctor --engine llamacpp --fix` re-converts it from its SGLang export." if
                reconvert is None else f" Re-convert its SGLang export (export_gguf); --fix cannot: {reconvert}.")
    checks = [*_gguf_checks(info, target, source),
              *_layer_checks(info.target_layers, layers, exp, want_src, conflict,
                             as_int(record.get("target_num_layers")), "eagle3.target_layers", "", False)]
    # What the draft is (hidden size, fc) no conversion changes; everything else the converter wrote.
    report.checks += [c if c.ok or c.name in ("hidden_size", "fc_shape") else
                      replace(c, message=c.message + fix_line, fixable=reconvert is None) for c in checks]
    if fix:
        _fix_gguf(report, draft, path, info, source, target, fix_dir, exp)
    return report


def _fix_gguf(report: DoctorReport, draft: Path, path: Path, info: GGUFDraftInfo, source: Folder | None,
              target: TargetInfo, fix_dir: Path | None, expected: list[int] | None) -> None:
    failing = [c for c in report.failed if not c.name.startswith("launch_")]
    if not failing:
        report.not_fixed.append("nothing to fix: every check of the GGUF passes")
        return
    refused = [c for c in failing if not c.fixable]
    if refused or source is None or target.folder is None:
        report.not_fixed += [*(f"{c.name}: not a mechanical repair ({c.message})" for c in refused), (
            "no corrected GGUF written: a GGUF is repaired only by re-converting its own SGLang export, and the checks "
            "above say why that would not do")]
        return
    folder = fix_dir or (draft.resolve().with_name(draft.resolve().name + "-fixed") if draft.is_dir() else None)
    out_dir = folder if folder is not None else path.with_name(path.stem + "-fixed.gguf")
    out = out_dir / path.name if folder is not None else out_dir
    if out.exists() or (out_dir.is_dir() and any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not empty; remove it or give another fix_dir")
    outtype = OUTTYPES.get(info.tensor_types.get("blk.0.attn_q.weight", ""), "f32")
    try:
        export_gguf(source.path, target.folder, out, outtype=outtype)
    except Exception as e:  # noqa: BLE001 - the converter's failure is reported, the draft left as it is
        report.not_fixed.append(f"re-converting {source.path} failed: {e}")
        return
    report.fixed_dir = out_dir
    report.fixes = [f"re-converted {source.path} with serving.llamacpp.export.export_gguf (outtype {outtype}; "
                    "eagle3.target_layers = the recorded layers + 1)"]
    report.fixed = check_gguf(out_dir, target, expected, False, None)


CONTRACT = EngineContract(
    name="llamacpp",
    layer_config_key="transformer_layer_config",  # merged into the top level by the converter, when present
    top_level_use_aux=False,
    ids_location=f"top-level {IDS_KEY}",
    written_ids=written_ids,
    captured=captured,
    ids_to_write=ids_to_write,
    write_ids=write_ids,
    check_architecture=check_architecture,
    check_eagle_config=check_ids_missing,
    unknown_keys_fate=f"{CONVERTER} refuses them ('Can not map tensor')",
    launch_usage="llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-eagle3 --spec-draft-n-max K",
    launch_checks=launch_checks,
    extra_checks=(check_norms,),
    extra_repairs={"norms": repair_norms},
    ignores=frozenset({"use_aux_hidden_state", "tie_word_embeddings"}),  # the converter reads neither
    d2t_use=("the converter writes d2t[i] + i as the absolute target id of draft id i (llama-server scatters the "
             "draft logits there), so ids that are not offsets are shifted again: refused as out of range or "
             "duplicate, or, where they stay in range, the draft proposes wrong tokens"),
    ids_checks=IDS_CHECKS,
    aux_checks=aux_checks,
    check_file=check_gguf,
)
