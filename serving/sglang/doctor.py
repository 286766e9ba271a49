"""SGLang's side of the serving contract: what it reads from a draft folder and from its launch command.

Owns `CONTRACT` (registered in serving/doctor/run.py): the folder checks that are SGLang's own and its
launch-command checks; the shared folder checks are serving/contract.py. Promises: the facts are SGLang's as docs/contracts.md records
them: architecture `LlamaForCausalLMEagle3`, `midlayer.*` keys (other names skipped without an
error), aux layer ids read from `eagle_config` only and captured differently before and since
PR #25454 (both are checked unless the version is named), and `--speculative-algorithm EAGLE3`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from serving.contract import ids_fix_hint, layer_complete
from serving.doctor.command import normalise_flags, one, same_folder, target_check
from serving.doctor.core import Check, Context, EngineContract, TargetInfo, default_capture
from serving.draft_folder import PROJECT_KEY, SGLANG_ARCHITECTURE, SPECULATORS_ARCHITECTURE, int_list, strip_prefixes
from serving.launch import flag_values
from serving.sglang.layers import sglang_capture_layers, sglang_layer_ids
from serving.sglang.loader import sglang_load_report
from serving.sglang.server import sglang_speculative_problems

# ---------------------------------------------------------------- folder


def written_ids(config: Mapping[str, Any]) -> list[int] | None:
    """SGLang reads the aux layer ids from eagle_config only (a top-level list is ignored)."""
    eagle = config.get("eagle_config")
    return int_list(eagle.get("eagle_aux_hidden_state_layer_ids")) if isinstance(eagle, Mapping) else None


def captured(ctx: Context) -> dict[str, list[int | None]]:
    """The layers (project convention) SGLang captures, per SGLang version."""
    written, layers = written_ids(ctx.folder.config), ctx.target.num_layers
    return {f"SGLang {v}": sglang_capture_layers(written, layers, v) if written is not None else default_capture(layers)
            for v in ctx.versions}


def ids_to_write(ctx: Context) -> list[int] | None:
    """Ids that make every checked SGLang version capture the trained layers (None when no one list does)."""
    if ctx.expected is None or ctx.expected_conflict:
        return None
    try:
        return sglang_layer_ids(ctx.expected, ctx.target.num_layers, ctx.versions[0] if len(ctx.versions) == 1 else None)
    except ValueError:
        return None


def write_ids(ctx: Context, config: dict[str, Any], ids: list[int]) -> str:
    moved = config.pop("eagle_aux_hidden_state_layer_ids", None)
    eagle = dict(config.get("eagle_config") or {})
    eagle["eagle_aux_hidden_state_layer_ids"] = ids
    eagle.setdefault("use_aux_hidden_state", True)
    config["eagle_config"] = eagle
    record = dict(config.get(PROJECT_KEY) or {})
    if record:  # the ids now hold for this version only (or both, when none was named)
        record["sglang_version"] = ctx.versions[0] if len(ctx.versions) == 1 else None
        config[PROJECT_KEY] = record
    return (f"eagle_config.eagle_aux_hidden_state_layer_ids = {ids} (capture layers {ctx.expected} in "
            f"{', '.join('SGLang ' + v for v in ctx.versions)})"
            + (f"; removed the ignored top-level ids {moved}" if moved is not None else ""))


def unwritable_ids_hint(ctx: Context) -> str:
    return (f" No single id list makes SGLang before and since PR #25454 capture {ctx.expected}: name the "
            "SGLang version the server runs (sglang_version), then --fix.")


def check_architecture(ctx: Context) -> Check:
    archs = ctx.folder.config.get("architectures")
    if archs == [SGLANG_ARCHITECTURE]:
        return Check("architecture", True, f"{SGLANG_ARCHITECTURE}")
    hint = (" This is the vLLM/speculators format: check it with engine='vllm', or export with export_sglang."
            if archs == [SPECULATORS_ARCHITECTURE] else
            f" Export with serving.sglang.export.export_sglang, which writes [{SGLANG_ARCHITECTURE!r}].")
    return Check("architecture", False, f"architectures is {archs!r}; SGLang's EAGLE-3 draft class is "
                                        f"[{SGLANG_ARCHITECTURE!r}] and another class loads other weights.{hint}")


def check_eagle_config(ctx: Context) -> Check:
    config = ctx.folder.config
    written = written_ids(config)
    if written is not None:
        return Check("eagle_config", True, f"eagle_config.eagle_aux_hidden_state_layer_ids = {written}")
    fixable, fix = ids_fix_hint(ctx)
    eagle = config.get("eagle_config")
    if isinstance(eagle, Mapping) and "eagle_aux_hidden_state_layer_ids" in eagle:
        what = f"eagle_config.eagle_aux_hidden_state_layer_ids is {eagle['eagle_aux_hidden_state_layer_ids']!r}, not a list of ints"
    elif "eagle_aux_hidden_state_layer_ids" in config:
        what = ("the layer ids are only at the top level (eagle_aux_hidden_state_layer_ids = "
                f"{config['eagle_aux_hidden_state_layer_ids']!r}), which SGLang ignores")
    else:
        what = "eagle_config (with eagle_aux_hidden_state_layer_ids) is missing"
    return Check("eagle_config", False, f"{what}: SGLang falls back to its default layers "
                                        f"{default_capture(ctx.target.num_layers)} without a word." + fix,
                 fixable=fixable)


def misspelled_keys(keys: Sequence[str]) -> tuple[list[str], str | None]:
    """SGLang loads midlayer.*: a layers.0.* key is skipped without an error."""
    layers0 = [k for k in keys if strip_prefixes(k).startswith("layers.0.")]
    if not layers0:
        return [], None
    return layers0, (f"{len(layers0)} keys are layers.0.* (e.g. {layers0[0]}): SGLang loads midlayer.* and skips "
                     "the others without an error, serving a randomly initialised decoder layer")


def loader_skips(ctx: Context, explained: set[str]) -> str | None:
    """SGLang's loader, replayed: any further key it would drop without a word."""
    if not layer_complete(ctx):
        return None
    report = sglang_load_report(ctx.folder.shapes, {**ctx.layer, "tie_word_embeddings": False})
    others = [k for k in report.skipped if k not in explained]
    return f"SGLang's loader skips {others[:3]} without an error" if others else None


# ---------------------------------------------------------------- launch command

_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model-revision",
          "--speculative-draft-load-format", "--speculative-num-steps", "--speculative-eagle-topk",
          "--speculative-num-draft-tokens", "--speculative-accept-threshold-single",
          "--speculative-accept-threshold-acc", "--speculative-token-map", "--speculative-attention-mode",
          "--model-path", "--page-size", "--attention-backend")
_ALIASES = {"--speculative-draft-model": "--speculative-draft-model-path", "--speculative-algo":
            "--speculative-algorithm", "--model": "--model-path"}


def launch_checks(argv: list[str], args: list[str], draft: Path, target: TargetInfo) -> list[Check]:
    """The `python -m sglang.launch_server` arguments (`args`) against this draft and target."""
    args, ambiguous = normalise_flags(args, _FLAGS, _ALIASES)
    checks: list[Check] = []
    if ambiguous:  # argparse refuses these in current SGLang; older ones may read them as another flag
        checks.append(Check("launch_flags", False, f"ambiguous abbreviated flags {ambiguous}: spell them out"))
    algo, problem = one(flag_values(args, ["--speculative-algorithm"]))
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
    path, problem = one(flag_values(args, ["--speculative-draft-model-path"]))
    if path is None or problem:
        checks.append(Check("launch_draft_path", False, f"--speculative-draft-model-path {problem or 'is missing'}; "
                                                        f"give --speculative-draft-model-path {draft.resolve()}"))
    elif not same_folder(path, draft):
        checks.append(Check("launch_draft_path", False, f"--speculative-draft-model-path {path} is not this draft "
                                                        f"({draft.resolve()}); the server would load another "
                                                        "checkpoint than the one checked"))
    else:
        checks.append(Check("launch_draft_path", True, f"--speculative-draft-model-path is {draft.resolve()}"))
    values: dict[str, Any] = {}
    problems: list[str] = []
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                 "--page-size", "--attention-backend"):
        value, problem = one(flag_values(args, [flag]))
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
    model, problem = one(flag_values(args, ["--model-path"]))
    checks.append(Check("launch_target", False, f"--model-path {problem}") if problem else
                  target_check(model, target, "--model-path"))
    return checks


CONTRACT = EngineContract(
    name="sglang",
    layer_config_key=None,
    top_level_use_aux=False,
    ids_location="eagle_config.eagle_aux_hidden_state_layer_ids",
    written_ids=written_ids,
    captured=captured,
    ids_to_write=ids_to_write,
    write_ids=write_ids,
    check_architecture=check_architecture,
    check_eagle_config=check_eagle_config,
    unknown_keys_fate="SGLang skips them without an error",
    launch_usage="python -m sglang.launch_server ...",
    launch_checks=launch_checks,
    unwritable_ids_hint=unwritable_ids_hint,
    misspelled_keys=misspelled_keys,
    loader_skips=loader_skips,
    rename_note=", layers.0.* -> midlayer.*",
)
