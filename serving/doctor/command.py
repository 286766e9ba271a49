"""Launch-command helpers every engine's launch checks share.

Owns reading a flag's single value (`one`), flag spelling as argparse accepts it (`normalise_flags`),
"is this path that folder" (`same_folder`) and the `launch_target` check. Promises: a target that
cannot be verified (a non-local model path, or another folder of the same shape) passes as a
warning, never silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from serving.doctor.core import Check, TargetInfo, load_target_info
from serving.draft_folder import CONFIG_FILE


def normalise_flags(args: Sequence[str], known: Sequence[str], aliases: Mapping[str, str]) -> tuple[list[str], list[str]]:
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


def same_folder(value: str, folder: Path) -> bool:
    path = Path(value).expanduser()
    return path.exists() and path.resolve() == folder.resolve()


def one(values: list[str | None]) -> tuple[str | None, str | None]:
    """(the value, a problem) for a flag that must be given once with a value."""
    if not values:
        return None, None
    if len(values) > 1:
        return values[-1], f"given {len(values)} times ({values}); give it once"
    if values[0] is None:
        return None, "given without a value"
    return values[0], None


def target_check(model: str | None, target: TargetInfo, flag: str) -> Check:
    """launch_target: does the command's target model (given by `flag`) have the shape of the draft's target?"""
    if model is None:
        return Check("launch_target", False, f"no target model in the command: give {flag} with the target folder")
    if target.folder is not None and same_folder(model, target.folder):
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
