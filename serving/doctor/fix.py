"""The `fix=True` repair: a corrected copy of a draft folder whose failing checks are all mechanical.

Owns `fix` (decide, repair, write, re-check). Promises: the draft itself is never touched; a copy is
written only when every failing folder check is one this engine's contract lists as fixable and
the check said so; pickles are never copied; the copy is written atomically and checked on its own.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serving.contract import offsets_from_absolute
from serving.doctor.core import Context, DoctorReport
from serving.draft_folder import CONFIG_FILE, PICKLE_SUFFIXES, PROJECT_KEY, WEIGHTS_FILE, canonical_key


def fix(report: DoctorReport, ctx: Context, fix_dir: str | Path | None,
        recheck: Callable[[Path], DoctorReport]) -> None:
    """Write the corrected copy when every failing folder check is fixable; `recheck` checks it (no launch command)."""
    failing = [c for c in report.failed if not c.name.startswith("launch_")]
    if not failing:
        report.not_fixed.append("nothing to fix: every folder check passes")
        return
    refused = [c for c in failing if not (c.fixable and c.name in ctx.contract.fixable_checks)]
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
    report.fixed = recheck(out)


def _repair(ctx: Context, failing: set[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    from safetensors.torch import load_file

    contract = ctx.contract
    config = copy.deepcopy(ctx.folder.config)
    tensors = load_file(str(ctx.folder.weights))
    fixes: list[str] = []
    if "weight_keys" in failing:
        renamed = {k: contract.spell_key(canonical_key(k)) for k in tensors}
        changed = sum(1 for k, v in renamed.items() if k != v)
        tensors = {renamed[k]: v for k, v in tensors.items()}
        fixes.append(f"renamed {changed} keys to the engine's spelling (prefixes stripped{contract.rename_note})")
    if "vocab_mapping" in failing:
        import torch

        d2t, t2d = tensors["d2t"].numpy(), tensors["t2d"].numpy()
        offsets = offsets_from_absolute(d2t, t2d, ctx.target.vocab_size, len(d2t))
        assert offsets is not None  # the check said fixable
        tensors["d2t"] = torch.from_numpy(offsets)
        fixes.append("d2t rewritten from absolute target ids to offsets (d2t[i] = target_id(i) - i)")
    if set(contract.ids_checks) & failing:
        ids = contract.ids_to_write(ctx)
        assert ids is not None  # the checks said fixable
        fixes.append(contract.write_ids(ctx, config, ids))
    if "use_aux_hidden_state" in failing:
        if isinstance(config.get("eagle_config"), dict):
            config["eagle_config"]["use_aux_hidden_state"] = True
        if contract.top_level_use_aux and "use_aux_hidden_state" in config:
            config["use_aux_hidden_state"] = True
        fixes.append("use_aux_hidden_state = true")
    if "tie_word_embeddings" in failing:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("transformer_layer_config"), dict):
            config["transformer_layer_config"]["tie_word_embeddings"] = False
        fixes.append("tie_word_embeddings = false (lm_head.weight is in the file)")
    for name, repair in contract.extra_repairs.items():
        if name in failing:
            fixes.append(repair(config))
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
            if p.is_file() and p.name not in (CONFIG_FILE, WEIGHTS_FILE) and p.suffix not in PICKLE_SUFFIXES:
                shutil.copy2(p, tmp / p.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    if not write_folder_atomically(out, write):
        raise FileExistsError(f"{out} was created by someone else during the fix")
