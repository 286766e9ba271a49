"""llama.cpp's launch-command checks: what `llama-server` does with the flags that start it on an EAGLE-3 draft.

Owns `launch_checks` (part of llama.cpp's `CONTRACT`, serving/llamacpp/doctor.py): removed flags,
`--spec-type draft-eagle3`, `-md` being this draft (the GGUF, or this folder converted with the
trained layers), `-m` being a target of the draft's shape whose graph exposes layer inputs, and
`--spec-draft-p-min`. Promises: the facts are those of the pinned tree (llama.cpp@0c1e570,
file:line in comments); what cannot be verified (a remote model or draft, another file of the same
shape) passes as a warning, never silently (docs/contracts.md).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serving.doctor.command import one
from serving.doctor.core import Check, TargetInfo
from serving.draft_folder import PROJECT_KEY, int_list, read_folder
from serving.launch import flag_values
from serving.llamacpp.export import GGUF_ARCHITECTURE, find_gguf, not_converted_from, read_gguf_draft
from serving.llamacpp.layers import wanted_ids

# GGUF architectures whose graph exposes layer inputs (`t_layer_inp`, src/models/*.cpp): the targets EAGLE-3 can read.
LAYER_INPUT_ARCHS = frozenset((
    "llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "qwen4exp", "gemma4", "muse-glimmer",
    "deepseek4", "nemotron_h", "bailingmoe3", "hunyuan_vl", "gpt-oss", "lfm2", "minimax-01", "minimax-m2", "mimo2",
    "nanbeige"))
SPEC_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple",
              "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")  # common/speculative.cpp:33-45
# Removed flags (common/arg.cpp:4387-4399): llama-server exits with "the argument has been removed".
REMOVED_FLAGS = {**dict.fromkeys(("--draft", "--draft-n", "--draft-max"), "--spec-draft-n-max"),
                 **dict.fromkeys(("--draft-min", "--draft-n-min"), "--spec-draft-n-min")}
DRAFT_FLAGS = ("--spec-draft-model", "-md", "--model-draft")
REMOTE_DRAFT_FLAGS = ("--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft")
MODEL_FLAGS = ("-m", "--model")
REMOTE_MODEL_FLAGS = ("-hf", "-hfr", "--hf-repo", "-mu", "--model-url")
P_MIN_FLAGS = ("--spec-draft-p-min", "--draft-p-min")


@functools.lru_cache(maxsize=8)
def _model_shape(path: str, mtime_ns: int, size: int) -> tuple[str | None, Any, Any, Any]:
    """(architecture, layers, hidden size, vocab) of a model GGUF (cached per file version: reading takes seconds)."""
    info = read_gguf_draft(path)
    arch, meta = info.architecture, info.metadata
    vocab = meta.get(f"{arch}.vocab_size") or info.tokenizer_tokens
    return arch, meta.get(f"{arch}.block_count"), meta.get(f"{arch}.embedding_length"), vocab


def _target_check(args: list[str], target: TargetInfo) -> Check:
    check = functools.partial(Check, "launch_target")
    value, problem = one(flag_values(args, MODEL_FLAGS))
    remote = [v for v in flag_values(args, REMOTE_MODEL_FLAGS) if v]
    if problem or (value is None and not remote):
        return check(False, f"-m {problem}" if problem else "no -m: give -m with the target's GGUF")
    path = Path(value or "").expanduser()
    if value is None or not path.exists():
        return check(True, f"cannot verify: the target is {remote[0] if value is None else repr(value)}, no local "
                           "file; make sure it is the target the draft was trained for", warning=True)
    if path.is_dir():
        return check(False, f"-m {value} is a folder: llama-server loads a GGUF file of the target")
    try:
        stat = path.stat()
        arch, layers, hidden, vocab = _model_shape(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except Exception as e:  # noqa: BLE001 - llama-server could not load it either
        return check(False, f"-m {value} is not a readable GGUF ({e})")
    if arch == GGUF_ARCHITECTURE:
        return check(False, f"-m {value} is an EAGLE-3 draft GGUF ({layers} layer), not a target model: -m takes the "
                            "target, -md the draft")
    diffs = [f"{name} {got} vs {want}" for name, got, want in (
        ("layers", layers, target.num_layers), ("hidden size", hidden, target.hidden_size),
        ("vocab", vocab, target.vocab_size)) if got != want]
    if diffs:
        return check(False, f"-m {value} ({arch}) is not this draft's target ({'; '.join(diffs)}, the GGUF vs the "
                            "target config): point -m at the target it was trained for")
    if arch not in LAYER_INPUT_ARCHS:
        return check(False, f"-m {value} is a {arch!r} model, whose llama.cpp graph does not expose layer inputs to "
                            "EAGLE-3 (the server asserts 'layer input tensor is null'); llama.cpp's EAGLE-3 reads "
                            f"{', '.join(sorted(LAYER_INPUT_ARCHS))}")
    provenance = None if target.folder is None else target.folder / "eagle3_target.json"  # tasks.model.target.PROVENANCE_FILE
    record = json.loads(provenance.read_text()) if provenance is not None and provenance.is_file() else {}
    source, digest = record.get("gguf"), record.get("sha256")
    # The same file, or the same bytes elsewhere (another checkout's copy of the package): by content.
    if (source and Path(source).expanduser().resolve() == path.resolve()) or (digest and _sha256(path) == digest):
        return check(True, f"-m is the GGUF the target folder was converted from ({arch}, {layers} layers)")
    return check(True, f"-m {value} has the target's shape ({arch}, {layers} layers, hidden {hidden}, vocab {vocab}); "
                       "the weights are not compared: make sure it is the same model", warning=True)


def _sha256(path: Path) -> str:
    from tasks.model.target import gguf_sha256  # cached by size and mtime: a target GGUF is hashed once

    return gguf_sha256(path)


def _draft_check(args: list[str], draft: Path, target: TargetInfo) -> Check:
    check = functools.partial(Check, "launch_draft_path")
    value, problem = one(flag_values(args, DRAFT_FLAGS))
    remote = [v for v in flag_values(args, REMOTE_DRAFT_FLAGS) if v]
    own, _ = find_gguf(draft)
    if value is None and not problem and remote:
        return check(True, f"cannot verify: the draft comes from {remote[0]}", warning=True)
    if value is None or problem:
        return check(False, f"-md {problem or 'is missing'}: give -md {own or 'DRAFT.gguf'}")
    path = Path(value).expanduser()
    if own is not None:
        if path.is_file() and path.resolve() == own.resolve():
            return check(True, f"-md is {own.resolve()}")
        return check(False, f"-md {value} is not this draft ({own.resolve()}): the server would load another draft "
                            "than the one checked")
    if path.is_dir():
        return check(False, f"-md {value} is a folder: llama-server loads a GGUF; convert the draft "
                            "(serving.llamacpp.export.export_gguf) and give -md that file")
    folder, _ = read_folder(draft)
    if not path.is_file() or folder is None:
        return check(True, f"cannot verify: -md {value!r} is no local file or the folder is unreadable", warning=True)
    try:
        info = read_gguf_draft(path)
    except Exception as e:  # noqa: BLE001 - llama-server could not load it either
        return check(False, f"-md {value} is not a readable GGUF ({e})")
    mismatch = not_converted_from(path, info, folder) if info.architecture == GGUF_ARCHITECTURE else "not eagle3"
    if mismatch:
        return check(False, f"-md {value} is not this draft converted ({mismatch}): the server would load another "
                            "draft than the one checked")
    record = folder.config.get(PROJECT_KEY)
    want = wanted_ids(int_list(record.get("aux_layer_ids")) if isinstance(record, Mapping) else None, target.num_layers)
    if want is not None and info.target_layers != want:
        return check(False, f"-md {value} was converted from this folder, but its eagle3.target_layers are "
                            f"{info.target_layers}, not {want}: re-convert it (serving.llamacpp.export.export_gguf)")
    return check(True, f"-md {value} is this folder converted (same final norm and lm_head)")


def _spec_type_check(args: list[str]) -> Check:
    values = flag_values(args, ["--spec-type"])
    types = [t.strip() for v in values if v for t in v.split(",")]
    unknown = [t for t in types if t not in SPEC_TYPES]
    if None in values or unknown:
        return Check("launch_spec_type", False, f"--spec-type {unknown or 'without a value'}: llama-server knows "
                                                f"{', '.join(SPEC_TYPES)}. Use --spec-type draft-eagle3.")
    if "draft-eagle3" in types:
        return Check("launch_spec_type", True, "--spec-type draft-eagle3")
    what = f"--spec-type {','.join(types)} has no draft-eagle3" if types else "no --spec-type"
    if not types and not flag_values(args, DRAFT_FLAGS) and any(flag_values(args, REMOTE_DRAFT_FLAGS)):
        return Check("launch_spec_type", True, f"{what}: llama.cpp infers draft-eagle3 from a draft repo only when it "
                                               "ships an EAGLE-3 sidecar (common/arg.cpp:546-562); give --spec-type "
                                               "draft-eagle3 to be sure", warning=True)
    return Check("launch_spec_type", False, (  # common/speculative.cpp:2270-2305; common/arg.cpp:566-573
        f"{what}: llama.cpp does not recognise an EAGLE-3 GGUF by itself (from a -md file it infers only MTP, DFlash "
        "and DSpark drafts), so this draft is not run as EAGLE-3 and the server does not draft with it, without an "
        "error. Add --spec-type draft-eagle3 (LLAMA_ARG_SPEC_TYPE in its environment, unseen here, does the same)."))


def _p_min_check(args: list[str]) -> Check:
    value, problem = one(flag_values(args, P_MIN_FLAGS))
    try:
        p = 0.0 if value is None else float(value)
    except ValueError:
        problem = f"{value!r} is not a number (llama-server exits)"
    if problem:
        return Check("launch_p_min", False, f"--spec-draft-p-min {problem}")
    if p > 0:
        return Check("launch_p_min", True, (
            f"--spec-draft-p-min {value}: drafting stops early where the draft's top probability is below {value}, so "
            "acceptance is not comparable with runs at 0.0 (which the benchmarks assume); use 0.0 to measure"),
            warning=True)
    return Check("launch_p_min", True, f"--spec-draft-p-min {value or '0.0 (default)'}")


def launch_checks(argv: list[str], args: list[str], draft: Path, target: TargetInfo) -> list[Check]:
    """The `llama-server` arguments (`args`) against this draft (folder or GGUF) and target."""
    removed = sorted({t for t in args if t in REMOVED_FLAGS})
    use = " / ".join(sorted({REMOVED_FLAGS[t] for t in removed}))
    return [Check("launch_removed_flags", False, f"{', '.join(removed)}: removed from llama-server in this llama.cpp, "
                                                 f"which exits ('the argument has been removed'); use {use}")
            if removed else Check("launch_removed_flags", True, "no removed flags"),
            _spec_type_check(args), _draft_check(args, draft, target), _target_check(args, target), _p_min_check(args)]
