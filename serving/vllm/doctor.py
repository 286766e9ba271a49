"""vLLM's side of the serving contract: what it reads from a speculators-format draft and from `vllm serve`.

Owns `CONTRACT` (registered in serving/doctor/run.py): the folder checks that are vLLM's own (the
speculators header, `speculators_header_problems`) and its launch-command checks; the shared folder
checks are serving/contract.py. Promises: the facts are vLLM's as docs/contracts.md records them:
the speculators header (`Eagle3Speculator`, `transformer_layer_config`, `speculators_config`), aux
layer ids read from the top level only and used as-is, `norm_before_residual` read as true when
absent, and `--speculative-config` with `"method": "eagle3"`. With `live`, vLLM itself is started on the
draft (serving/vllm/doctor_live.py) and what it says it loaded is checked too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serving.contract import ids_fix_hint
from serving.doctor.command import one, same_folder, target_check
from serving.doctor.core import Check, Context, EngineContract, TargetInfo, default_capture
from serving.draft_folder import SPECULATORS_ARCHITECTURE, int_list
from serving.launch import flag_values
from serving.vllm.doctor_live import live_checks
from serving.vllm.layers import vllm_capture_layers, vllm_layer_ids

# ---------------------------------------------------------------- folder


def written_ids(config: Mapping[str, Any]) -> list[int] | None:
    """vLLM reads the aux layer ids from the top level only (eagle_config is not this format's)."""
    return int_list(config.get("eagle_aux_hidden_state_layer_ids"))


def captured(ctx: Context) -> dict[str, list[int | None]]:
    written, layers = written_ids(ctx.folder.config), ctx.target.num_layers
    return {"vllm": vllm_capture_layers(written, layers) if written is not None else default_capture(layers)}


def ids_to_write(ctx: Context) -> list[int] | None:
    if ctx.expected is None or ctx.expected_conflict:
        return None
    return vllm_layer_ids(ctx.expected)


def write_ids(ctx: Context, config: dict[str, Any], ids: list[int]) -> str:
    config["eagle_aux_hidden_state_layer_ids"] = ids
    return f"eagle_aux_hidden_state_layer_ids = {ids} (vLLM captures layers {ctx.expected})"


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


def check_architecture(ctx: Context) -> Check:
    problems = speculators_header_problems(ctx.folder.config)
    if problems:
        return Check("architecture", False, "; ".join(problems) + ". Export with serving.vllm.export.export_speculators "
                                                                  "(SGLang folders are not vLLM's format).")
    return Check("architecture", True, SPECULATORS_ARCHITECTURE)


def check_eagle_config(ctx: Context) -> Check:
    config = ctx.folder.config
    written = written_ids(config)
    if written is not None:
        return Check("eagle_config", True, f"eagle_aux_hidden_state_layer_ids = {written}")
    fixable, fix = ids_fix_hint(ctx)
    eagle = config.get("eagle_config")
    where = (" (they are only inside eagle_config, which this format does not read)"
             if isinstance(eagle, Mapping) and "eagle_aux_hidden_state_layer_ids" in eagle else "")
    return Check("eagle_config", False, f"top-level eagle_aux_hidden_state_layer_ids is missing{where}: vLLM captures "
                                        f"its default layers {default_capture(ctx.target.num_layers)} without a word."
                                        + fix, fixable=fixable)


def check_norm_before_residual(ctx: Context) -> Check:
    value = ctx.folder.config.get("norm_before_residual")
    if value is False:
        return Check("norm_before_residual", True, "norm_before_residual is false, as the draft was trained")
    # Only a folder this project exported (it has the record) is known to need false.
    fixable = value is None and bool(ctx.record)
    fix = (" Fix: `eagle3 doctor --fix` sets it to false (this project's drafts apply hidden_norm after taking the "
           "raw residual)." if fixable else
           " Only set it if you know how the draft was trained; this project's drafts need false.")
    return Check("norm_before_residual", False, f"norm_before_residual is {value!r}: vLLM then treats it as true and "
                                                "normalises the hidden state before the residual, a different layer "
                                                "than the one trained." + fix, fixable=fixable)


def repair_norm_before_residual(config: dict[str, Any]) -> str:
    config["norm_before_residual"] = False
    return "norm_before_residual = false"


def spell_key(name: str) -> str:
    """vLLM's speculators format spells the decoder layer layers.0.*."""
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


# ---------------------------------------------------------------- launch command


def launch_checks(argv: list[str], args: list[str], draft: Path, target: TargetInfo) -> list[Check]:
    """The `vllm serve` arguments (`args`, `argv` the whole command) against this draft and target."""
    checks: list[Check] = []
    legacy = sorted({t.split("=", 1)[0] for t in args if t.split("=", 1)[0].replace("_", "-") in
                     ("--speculative-model", "--num-speculative-tokens", "--speculative-draft-tensor-parallel-size")})
    raw, problem = one(flag_values(args, ["--speculative-config"]))
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
        elif not same_folder(model, draft):
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
    # `vllm serve MODEL`: the positional right after `serve` is the target.
    ok_serve = args and not args[0].startswith("-") and len(argv) > len(args) and argv[-len(args) - 1] == "serve"
    if ok_serve:
        models.insert(0, args[0])
    checks.append(target_check(models[0] if models else None, target, "the `vllm serve` MODEL"))
    return checks


CONTRACT = EngineContract(
    name="vllm",
    layer_config_key="transformer_layer_config",
    top_level_use_aux=True,
    ids_location="top-level eagle_aux_hidden_state_layer_ids",
    written_ids=written_ids,
    captured=captured,
    ids_to_write=ids_to_write,
    write_ids=write_ids,
    check_architecture=check_architecture,
    check_eagle_config=check_eagle_config,
    unknown_keys_fate="vLLM has no parameter for them",
    launch_usage="vllm serve MODEL ...",
    launch_checks=launch_checks,
    extra_checks=(check_norm_before_residual,),
    serves_eagle31_norms=True,  # vLLM 0.32 reads them from the config's top level (speculators' Eagle 3.1)
    extra_repairs={"norm_before_residual": repair_norm_before_residual},
    spell_key=spell_key,
    live_checks=live_checks,
)
