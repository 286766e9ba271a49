"""The engine registry and `run_doctor`, which dispatches through it.

Owns `CONTRACTS` (engine name -> its EngineContract: the one place an engine is registered),
`ENGINES` and `run_doctor`. Promises: the checks are reported in one fixed order for every engine
(files, the folder checks and aux-layer checks of serving/contract.py, then the launch command's; an
engine's own converted file, llama.cpp's GGUF, has its checks in its package), and nothing here
branches on an engine's name.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from serving.contract import check_folder
from serving.doctor.core import Check, DoctorReport, Engine, EngineContract, TargetInfo, load_target_info
from serving.doctor.fix import fix as fix_copy
from serving.draft_folder import CONFIG_FILE, WEIGHTS_FILE, read_folder
from serving.launch import engine_arguments
from serving.llamacpp import doctor as llamacpp
from serving.sglang import doctor as sglang
from serving.sglang.layers import SGLANG_VERSIONS, SGLangVersion
from serving.vllm import doctor as vllm

# A new engine: its module's CONTRACT here, and its name in core.Engine.
CONTRACTS: dict[Engine, EngineContract] = {c.name: c for c in (sglang.CONTRACT, vllm.CONTRACT, llamacpp.CONTRACT)}
ENGINES: tuple[Engine, ...] = tuple(CONTRACTS)


def _launch_checks(launch: str | Sequence[str], engine: Engine, draft: Path, target: TargetInfo) -> list[Check]:
    argv = shlex.split(launch) if isinstance(launch, str) else list(launch)
    args = engine_arguments(argv, engine)
    if args is None:
        other = next((e for e in ENGINES if e != engine and engine_arguments(argv, e) is not None), None)
        hint = f" (it starts {other}: check with engine={other!r})" if other else ""
        expected = CONTRACTS[engine].launch_usage
        return [Check("launch_command", False, f"the command does not start {engine}{hint}; expected `{expected}`")]
    checks = [Check("launch_command", True, f"starts {engine}")]
    return checks + CONTRACTS[engine].launch_checks(argv, args, draft, target)


def run_doctor(draft_dir: str | Path, target: str | Path | Mapping[str, Any], engine: Engine = "sglang",
               launch: str | Sequence[str] | None = None, expected_aux_layer_ids: Sequence[int] | None = None,
               sglang_version: SGLangVersion | None = None, fix: bool = False,
               fix_dir: str | Path | None = None, live: bool = False) -> DoctorReport:
    """Check `draft_dir` against the serving contract of `engine` for `target` (and `launch`, when given).

    draft_dir: the exported folder; for llamacpp also the converted .gguf (or a folder holding one).

    target: the target's config as a dict, its config.json, or its model folder (a hub id is not
    read). expected_aux_layer_ids: the layers the draft was trained on (project convention), from
    lineage (`expected_aux_layer_ids_from_lineage`); else the folder's own record is used.
    sglang_version: the SGLang the server runs; None checks both before and since PR #25454.
    fix: write a corrected copy to `fix_dir` (default `<draft_dir>-fixed`) when every failing
    folder check is mechanical, and check the copy (`report.fixed`); a GGUF is re-converted from
    its own SGLang export instead.
    live: also start the engine on the draft (and `target`, which must then be the model folder) and check
    what the engine itself says it loaded (vllm: aux layers, embeddings, lm_head), failing folder checks
    or not: the engine's own word on what a wrong folder does (say, ids shifted by one) names the damage.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if sglang_version is not None and sglang_version not in SGLANG_VERSIONS:
        raise ValueError(f"sglang_version must be one of {SGLANG_VERSIONS} or None, got {sglang_version!r}")
    draft = Path(draft_dir).expanduser()
    info = load_target_info(target)
    contract = CONTRACTS[engine]
    if live and contract.live_checks is None:
        raise ValueError(f"no live check for engine {engine!r}: {', '.join(e for e in ENGINES if CONTRACTS[e].live_checks)} "
                         "only")
    # An engine's own converted file (llama.cpp's GGUF) has checks of its own; a folder goes on below.
    own = contract.check_file(draft, info, expected_aux_layer_ids, fix, None if fix_dir is None else Path(fix_dir)) \
        if contract.check_file is not None else None
    if own is not None:
        if launch is not None:
            own.checks += _launch_checks(launch, engine, draft, info)
        return own
    report = DoctorReport(draft_dir=draft, engine=engine, target_vocab_size=info.vocab_size)
    folder, problem = read_folder(draft)
    if folder is None:
        report.checks.append(Check("files", False, problem or "unreadable draft folder"))
        if launch is not None:
            report.checks += _launch_checks(launch, engine, draft, info)
        return report
    report.checks.append(Check("files", True, f"{CONFIG_FILE} and {WEIGHTS_FILE}"))
    ctx, checks, captured = check_folder(folder, contract, info, expected_aux_layer_ids, sglang_version)
    archs = folder.config.get("architectures")
    report.architecture = archs[0] if isinstance(archs, list) and len(archs) == 1 else str(archs)
    report.hidden_size, report.draft_vocab_size = ctx.hidden, ctx.n_draft
    report.captured_layers = captured
    report.checks += checks
    if live:
        report.checks += contract.live_checks(draft, target, ctx)
    if launch is not None:
        report.checks += _launch_checks(launch, engine, draft, info)
    if fix:
        fix_copy(report, ctx, fix_dir,
                 lambda out: run_doctor(out, target, engine, None, expected_aux_layer_ids, sglang_version))
    return report
