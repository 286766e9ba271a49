"""The draft as a llama.cpp GGUF, made by llama.cpp's own `convert_hf_to_gguf.py` from an SGLang export.

Owns running the pinned tree's converter on a staged copy of an SGLang folder, reading a draft GGUF
back (`read_gguf_draft`, pip `gguf`'s generic reader) and telling which GGUF a draft is and whether
it was converted from a given folder (`find_gguf`, `not_converted_from`). Promises: the GGUF names
the layers the draft was trained on (llama.cpp captures layer *inputs*, so "output of layer i" is
written i+1 by serving/llamacpp/layers.py, at the top level the converter reads; the nested SGLang
ids it would silently ignore); a GGUF appears under its name only complete and only after its
metadata was read back and matched (architecture, target layers, target hidden size, d2t as
absolute ids); every failure names the folder, and a converter failure its command and output tail.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serving.draft_folder import CONFIG_FILE, PROJECT_KEY, WEIGHTS_FILE, CheckpointError, Folder
from serving.llamacpp.layers import llamacpp_layer_ids
from serving.sglang.export import check_sglang

GGUF_ARCHITECTURE = "eagle3"
GGUF_FILE = "draft.gguf"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# Tensors llama.cpp's eagle3 loader requires (token_embd and enc.output_norm are optional).
REQUIRED_TENSORS = ("fc.weight", "d2t", "output.weight", "output_norm.weight", "blk.0.attn_norm.weight",
                    "blk.0.attn_norm_2.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
                    "blk.0.attn_output.weight", "blk.0.ffn_norm.weight", "blk.0.ffn_gate.weight",
                    "blk.0.ffn_up.weight", "blk.0.ffn_down.weight")
_TAIL_LINES = 30
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")


class GGUFExportError(RuntimeError):
    """A GGUF conversion that failed or wrote something else than asked; names the folder (and command)."""

    def __init__(self, folder: Path, message: str, command: Sequence[str] | None = None, tail: str = "") -> None:
        self.folder, self.command, self.tail = Path(folder), list(command or []), tail
        text = f"{folder}: {message}"
        if command:
            text += f"\ncommand: {' '.join(str(c) for c in command)}"
        if tail:
            text += f"\nlast lines of the converter's output:\n{tail}"
        super().__init__(text)


# ---------------------------------------------------------------- reading a draft GGUF

@dataclass(frozen=True)
class GGUFDraftInfo:
    """What a draft GGUF says, as llama.cpp's eagle3 loader reads it (None: the key is absent)."""

    path: Path
    architecture: str | None
    target_layers: list[int] | None          # eagle3.target_layers: inputs of these target layers
    target_hidden_size: int | None
    norm_before_residual: bool | None
    norm_before_fc: bool | None
    hidden_size: int | None                  # eagle3.embedding_length
    vocab_size: int | None                   # eagle3.vocab_size (the target's)
    draft_vocab_size: int | None             # rows of d2t, else of output.weight
    d2t: np.ndarray | None                   # absolute target ids (int64), as llama.cpp scatters logits
    tokenizer_model: str | None
    tokenizer_pre: str | None
    tokenizer_tokens: int
    tensor_names: list[str]
    tensor_shapes: dict[str, tuple[int, ...]]  # PyTorch order (out, in), not GGUF's ne order
    tensor_types: dict[str, str]
    metadata: dict[str, Any] = field(repr=False)  # every key but the tokenizer's big arrays


def _field_value(f: Any) -> Any:
    value = f.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


def gguf_reader(path: Path, mode: str = "r") -> Any:
    """pip `gguf`'s GGUFReader (generic: any architecture's keys), on a plain ndarray view of its memory map.

    The reader slices its `data` once per value; on an np.memmap every slice pays the subclass's
    bookkeeping, 2.5x the parse time of a 49K-token vocab. The view keeps the map alive; `mode="r+"`
    maps the file writable (values edited in place; `reader.memmap.flush()` writes them).
    """
    from gguf import GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self.memmap, self._plain = value, value.view(np.ndarray)

    return Reader(path, mode)


def read_gguf_draft(path: str | Path) -> GGUFDraftInfo:
    """The metadata, tensor table and d2t of a draft GGUF (memory-mapped; reads no weight but d2t)."""
    path = Path(path)
    reader = gguf_reader(path)
    fields = reader.fields
    metadata = {k: _field_value(f) for k, f in fields.items() if k not in _BIG_ARRAYS and not k.startswith("GGUF.")}
    arch = metadata.get("general.architecture")

    def key(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    tensors = {t.name: t for t in reader.tensors}
    d2t = np.array(tensors["d2t"].data, dtype=np.int64).reshape(-1) if "d2t" in tensors else None
    shapes = {n: tuple(int(x) for x in reversed(t.shape.tolist())) for n, t in tensors.items()}
    if d2t is not None:
        n_draft: int | None = int(d2t.shape[0])
    elif "output.weight" in shapes:
        n_draft = shapes["output.weight"][0]
    else:
        n_draft = None
    layers = key("target_layers")
    tokens = fields.get("tokenizer.ggml.tokens")
    info = GGUFDraftInfo(
        path=path, architecture=arch, target_layers=None if layers is None else [int(i) for i in layers],
        target_hidden_size=key("target_hidden_size"), norm_before_residual=key("norm_before_residual"),
        norm_before_fc=key("norm_before_fc"), hidden_size=key("embedding_length"), vocab_size=key("vocab_size"),
        draft_vocab_size=n_draft, d2t=d2t, tokenizer_model=metadata.get("tokenizer.ggml.model"),
        tokenizer_pre=metadata.get("tokenizer.ggml.pre"), tokenizer_tokens=0 if tokens is None else len(tokens.data),
        tensor_names=list(tensors), tensor_shapes=shapes,
        tensor_types={n: t.tensor_type.name for n, t in tensors.items()},
        metadata=metadata)
    del reader, tensors  # drop the memory map
    return info


def gguf_draft_problems(info: GGUFDraftInfo, *, target_layers: Sequence[int] | None = None,
                        target_hidden_size: int | None = None, target_vocab_size: int | None = None,
                        d2t_offsets: np.ndarray | None = None, norm_before_residual: bool | None = False,
                        norm_before_fc: bool | None = False) -> list[str]:
    """Every reason llama.cpp would refuse this draft GGUF or serve it other than intended (empty: none).

    The keyword arguments are what was meant; None skips that comparison.
    """
    problems: list[str] = []
    if info.architecture != GGUF_ARCHITECTURE:
        return [f"general.architecture is {info.architecture!r}, not {GGUF_ARCHITECTURE!r}: llama-server "
                "--spec-type draft-eagle3 refuses it"]
    if info.target_layers is None or len(info.target_layers) != 3:
        problems.append(f"eagle3.target_layers is {info.target_layers}: llama.cpp requires exactly 3")
    elif target_layers is not None and info.target_layers != [int(i) for i in target_layers]:
        problems.append(f"eagle3.target_layers is {info.target_layers}, expected {list(target_layers)}: the server "
                        "would capture other layers than the draft was trained on")
    if info.target_hidden_size is None:
        problems.append("eagle3.target_hidden_size is missing (llama.cpp's loader requires it)")
    elif target_hidden_size is not None and info.target_hidden_size != target_hidden_size:
        problems.append(f"eagle3.target_hidden_size is {info.target_hidden_size}, the target's hidden size is "
                        f"{target_hidden_size}")
    for name, got, want in (("norm_before_residual", info.norm_before_residual, norm_before_residual),
                            ("norm_before_fc", info.norm_before_fc, norm_before_fc)):
        if want is not None and bool(got) != want:
            problems.append(f"eagle3.{name} is {got}, the draft was trained with {want}")
    missing = [t for t in REQUIRED_TENSORS if t not in info.tensor_shapes]
    if missing:
        problems.append(f"tensors missing: {missing}")
    if info.d2t is not None:
        out_rows = info.tensor_shapes.get("output.weight", (None,))[0]
        if out_rows is not None and out_rows != info.d2t.shape[0]:
            problems.append(f"d2t has {info.d2t.shape[0]} entries, output.weight {out_rows} rows")
        vocab = target_vocab_size or info.vocab_size
        if vocab is not None and (info.d2t.min(initial=0) < 0 or info.d2t.max(initial=0) >= vocab):
            problems.append(f"d2t holds ids outside the target vocab [0, {vocab})")
        if np.unique(info.d2t).size != info.d2t.size:
            problems.append("d2t holds duplicate target ids")
        if d2t_offsets is not None:
            expected = np.asarray(d2t_offsets, dtype=np.int64).reshape(-1)
            expected = expected + np.arange(expected.size, dtype=np.int64)
            if expected.shape != info.d2t.shape or not np.array_equal(expected, info.d2t):
                problems.append("d2t is not the draft's offsets + arange (llama.cpp needs absolute target ids)")
    if target_vocab_size is not None and info.vocab_size is not None and info.vocab_size < target_vocab_size:
        problems.append(f"eagle3.vocab_size is {info.vocab_size}, below the target vocab {target_vocab_size}")
    return problems


# ---------------------------------------------------------------- which GGUF a draft is

def find_gguf(draft: Path) -> tuple[Path | None, str | None]:
    """(the GGUF, None) for a .gguf or a folder holding exactly one (and no config.json); else (None, why or None)."""
    if draft.is_file():
        return (draft, None) if draft.suffix == ".gguf" else (None, None)
    if not draft.is_dir() or (draft / CONFIG_FILE).exists():
        return None, None
    found = sorted(p.name for p in draft.iterdir() if p.suffix == ".gguf" and p.is_file())
    return (draft / found[0], None) if len(found) == 1 else \
        (None, f"{draft} holds {len(found)} .gguf files {found}; give the one llama-server loads" if found else None)


def _gguf_norm(path: Path) -> np.ndarray | None:
    """output_norm.weight of a GGUF as float32 (the converter keeps norms F32); None if absent or not F32."""
    t = next((t for t in gguf_reader(path).tensors if t.name == "output_norm.weight"), None)
    return None if t is None or t.tensor_type.name != "F32" else np.array(t.data, dtype=np.float32).reshape(-1)


def not_converted_from(path: Path, info: GGUFDraftInfo, folder: Folder) -> str | None:
    """Why the GGUF at `path` is not `folder` converted (None: same lm_head rows and the same final norm)."""
    head, out = folder.shape("lm_head.weight"), info.tensor_shapes.get("output.weight")
    if head is None or out is None or head[0] != out[0]:
        return f"lm_head rows {None if head is None else head[0]} vs {None if out is None else out[0]}"
    norm, gguf_norm = folder.tensor("norm.weight"), _gguf_norm(path)
    if norm is None or gguf_norm is None:
        return "no F32 final norm to compare"
    norm = norm.float().numpy().reshape(-1)
    if norm.shape != gguf_norm.shape or not np.allclose(norm, gguf_norm, rtol=1e-5, atol=1e-6):
        return "its final norm weights differ"
    return None


# ---------------------------------------------------------------- the converter

@functools.lru_cache(maxsize=4)
def llamacpp_converter(cache_dir: Path | None = None) -> tuple[Path, str]:
    """`convert_hf_to_gguf.py` of the pinned llama.cpp tree, and a version line naming its commit and sdist."""
    from serving.llamacpp.build import LLAMA_CPP_PYTHON_VERSION, default_cache_dir, fetch_sdist, source_tree

    cache_dir = cache_dir or default_cache_dir()
    tree, digest = source_tree(fetch_sdist(cache_dir), cache_dir)
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"the pinned llama.cpp tree {tree} has no convert_hf_to_gguf.py")
    version = f"llama.cpp@{_tree_commit(tree)[:7]} (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist sha256:{digest})"
    return script, version


def _tree_commit(tree: Path) -> str:
    """The vendored llama.cpp's commit, from the submodule's git dir the sdist ships ('unknown' if absent)."""
    try:
        marker = (tree / ".git").read_text().strip()
        git_dir = (tree / marker.removeprefix("gitdir:").strip()) if marker.startswith("gitdir:") else tree / ".git"
        return (git_dir / "HEAD").read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def target_folder_for(gguf: str | None = None, model_path: str | None = None, revision: str | None = None,
                      dtype: str = "auto", cache_dir: Path | None = None) -> Path:
    """The configured target's config and tokenizer folder (`tasks.model.target.configured_target_folder`,
    without a hub target's weights: the export reads neither weights nor model code)."""
    from tasks.model.target import configured_target_folder  # torch and transformers: only when a target is needed

    return configured_target_folder(gguf, model_path, revision, dtype, cache_dir, weights=False)


def _target_config(target_folder: Path) -> dict[str, Any]:
    config = json.loads((target_folder / CONFIG_FILE).read_text())
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config


def export_gguf(sglang_folder: str | Path, target_folder: str | Path, out_file: str | Path, *, outtype: str = "f32",
                aux_layer_ids: Sequence[int] | None = None, cache_dir: Path | None = None,
                timeout_s: float = 1800) -> Path:
    """Convert an SGLang export (`export_sglang`) into the GGUF `out_file` with llama.cpp's converter.

    `aux_layer_ids` (project convention) default to the folder's project record; the target folder
    gives the tokenizer and layer count. Returns `out_file`, written atomically and checked.
    """
    from safetensors import safe_open

    # Absolute: the converter runs with its stage folder as working directory, where a path
    # relative to ours (a workspace like `runs/demo`) would name nothing.
    folder, target_folder, out_file = Path(sglang_folder), Path(target_folder).resolve(), Path(out_file).resolve()
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {OUTTYPES}")
    problems = check_sglang(folder)
    if problems:
        raise CheckpointError(folder, problems)
    config = json.loads((folder / CONFIG_FILE).read_text())
    record = config.get(PROJECT_KEY) or {}
    target = _target_config(target_folder)
    num_layers = int(target["num_hidden_layers"])
    if record.get("target_num_layers") not in (None, num_layers):
        raise GGUFExportError(folder, f"the draft was trained for a {record['target_num_layers']}-layer target, "
                                      f"{target_folder} has {num_layers} layers")
    ids = list(aux_layer_ids) if aux_layer_ids is not None else record.get("aux_layer_ids")
    if ids is None:
        raise GGUFExportError(folder, "no project record names the draft's aux layers: pass aux_layer_ids")
    if record.get("aux_layer_ids") is not None and [int(i) for i in ids] != list(record["aux_layer_ids"]):
        raise GGUFExportError(folder, f"aux_layer_ids {list(ids)} differ from the draft's record "
                                      f"{record['aux_layer_ids']}")
    written = llamacpp_layer_ids(ids, num_layers)
    with safe_open(str(folder / WEIGHTS_FILE), framework="np") as f:
        d2t_offsets = f.get_tensor("d2t")

    script, _ = llamacpp_converter(cache_dir)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix=".gguf-stage-", dir=out_file.parent) as stage_dir:
        stage = Path(stage_dir)
        # The converter reads only a top-level key; without it, it falls back to its own default layers.
        (stage / CONFIG_FILE).write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": written}, indent=2))
        (stage / WEIGHTS_FILE).symlink_to((folder / WEIGHTS_FILE).resolve())
        command = [sys.executable, str(script), str(stage), "--target-model-dir", str(target_folder.resolve()),
                   "--outfile", str(tmp), "--outtype", outtype]
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the in-tree gguf-py has EAGLE-3
        env["HF_HUB_OFFLINE"] = "1"  # the target folder is local; never reach for a hub
        try:
            try:
                done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                      timeout=timeout_s, stdin=subprocess.DEVNULL, cwd=stage)
            except subprocess.TimeoutExpired as e:
                raise GGUFExportError(folder, f"the converter ran past {timeout_s:.0f} s", command,
                                      _tail(e.stdout or b"")) from None
            if done.returncode != 0 or not tmp.is_file():
                raise GGUFExportError(folder, f"the converter exited with {done.returncode}"
                                      + ("" if done.returncode else f" but wrote no {tmp.name}"), command,
                                      _tail(done.stdout))
            info = read_gguf_draft(tmp)
            found = gguf_draft_problems(info, target_layers=written, target_hidden_size=int(target["hidden_size"]),
                                        target_vocab_size=int(target["vocab_size"]), d2t_offsets=d2t_offsets,
                                        norm_before_residual=bool(config.get("norm_before_residual", False)),
                                        norm_before_fc=bool(config.get("norm_before_fc", False)))
            if found:
                raise GGUFExportError(folder, "the converted GGUF does not say what was meant:\n"
                                      + "\n".join(f"- {p}" for p in found), command)
            os.replace(tmp, out_file)
        finally:
            tmp.unlink(missing_ok=True)
    return out_file


def _tail(output: bytes) -> str:
    lines = output.decode(errors="replace").splitlines()
    return "\n".join(lines[-_TAIL_LINES:])

