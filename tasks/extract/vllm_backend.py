"""The vLLM extraction backend: target states from a vLLM server, for targets that need tensor parallelism.

Owns turning what vLLM captures into this project's records: vLLM (`serving.vllm.extract_server`) prefills
each sample once and writes the aux layers and the last layer's pre-norm output; here the
post-norm state is computed from the latter with the target's own final RMSNorm weights (read
from its safetensors, not the whole model), and the record is built by the same code as the `hf`
backend's (`tasks.extract.hf_backend.record_from_states`, `TopkTeacher`). Promises: records equal the `hf`
backend's within bf16 rounding (tests/test_extract_vllm.py states the tolerance); a file whose
token ids or shape differ from the sample's is a hard error (a wrong file is not bad data); a
non-finite state quarantines its sample with the tensor named; results come in sample order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from safetensors import safe_open

from serving.vllm.extract_server import (VllmHiddenStatesServer, VllmLaunch, clear_states_dir, default_vllm_python,
                                 read_hidden_states, vllm_layer_ids)
from tasks.config import ExtractConfig
from tasks.extract.hf_backend import (Extracted, ExtractSettings, Quarantined, Sample, TopkTeacher, as_result, precheck_samples,
                           record_from_states, validate_aux_layer_ids)
from tasks.model.target import TargetFiles, resolve_device, resolve_target_dtype

# Model types whose final norm is RMSNorm as `weight * x / rms(x)` (Llama's). Gemma's adds 1 to the
# weight, and others differ again: computing those with this formula would be silently wrong.
RMSNORM_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                       "kimi_k2", "kimi_k25", "kimi_vl", "glm4_moe"}


def text_config(config):
    """The language model's config (multimodal targets nest it)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


class TargetTensors:
    """Named tensors of a transformers folder's safetensors, read one by one (never the whole model)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            self.where = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.folder} holds no safetensors")
            self.where = {}
            for f in files:
                with safe_open(str(f), framework="pt") as st:
                    self.where.update({k: f.name for k in st.keys()})

    def first(self, names: list[str]) -> tuple[str, torch.Tensor]:
        for name in names:
            if name in self.where:
                with safe_open(str(self.folder / self.where[name]), framework="pt") as st:
                    return name, st.get_tensor(name)
        raise KeyError(f"{self.folder}: none of {names} among its {len(self.where)} tensors")


def load_final_norm_and_head(folder: Path, config, with_head: bool = True) -> tuple[torch.Tensor, float, torch.Tensor | None]:
    """The target's final norm weight, its epsilon, and its lm_head weight (the input embedding when tied).

    `with_head=False` skips the lm_head (None): only the top-k teacher needs it, and for Kimi-K2.5 it
    is 2.3 GB to read.
    """
    text = text_config(config)
    model_type = getattr(text, "model_type", None)
    if model_type not in RMSNORM_MODEL_TYPES:
        raise ValueError(f"the vllm backend computes the post-norm state itself and knows the final norm of "
                         f"{sorted(RMSNORM_MODEL_TYPES)} only; {folder} is a {model_type!r}")
    tensors = TargetTensors(folder)
    prefixes = ["", "language_model.", "model.language_model."]
    _, norm = tensors.first([p + "model.norm.weight" for p in prefixes] + ["model.language_model.norm.weight"])
    if norm.shape != (text.hidden_size,):
        raise ValueError(f"{folder}: final norm {tuple(norm.shape)} does not match hidden size {text.hidden_size}")
    if not with_head:
        return norm, float(text.rms_norm_eps), None
    heads = [p + "lm_head.weight" for p in prefixes]
    if getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
        heads += [p + "model.embed_tokens.weight" for p in prefixes] + ["model.language_model.embed_tokens.weight"]
    _, head = tensors.first(heads)
    if head.shape != (text.vocab_size, text.hidden_size):
        raise ValueError(f"{folder}: lm_head {tuple(head.shape)} does not match vocab {text.vocab_size} x hidden size "
                         f"{text.hidden_size}")
    return norm, float(text.rms_norm_eps), head


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class VllmExtractor:
    """An `Extractor` over a running `VllmHiddenStatesServer` started with `vllm_layer_ids(aux, L)`."""

    def __init__(self, server: VllmHiddenStatesServer, settings: ExtractSettings, config, norm_weight: torch.Tensor,
                 norm_eps: float, head_weight: torch.Tensor | None = None, t2d: torch.Tensor | None = None,
                 concurrency: int = 8) -> None:
        text = text_config(config)
        self.num_layers: int = text.num_hidden_layers
        self.vocab_size: int = text.vocab_size
        self.hidden_size: int = text.hidden_size
        validate_aux_layer_ids(settings.aux_layer_ids, self.num_layers)
        expected = vllm_layer_ids(settings.aux_layer_ids, self.num_layers)
        if list(server.launch.layer_ids) != expected:
            raise ValueError(f"the vLLM server captures layers {server.launch.layer_ids}, but aux layer ids "
                             f"{settings.aux_layer_ids} need vLLM ids {expected} (vllm_layer_ids)")
        self.server = server
        self.settings = settings
        self.norm_weight, self.norm_eps = norm_weight, norm_eps
        self.teacher = None
        if settings.teacher == "topk":
            if head_weight is None:
                raise ValueError("teacher 'topk' needs the target's lm_head weight")
            self.teacher = TopkTeacher(head_weight, None, t2d, settings.topk)
        self.concurrency = max(1, concurrency)
        self.labels = [f"aux layer {i} (vLLM layer id {i + 1})" for i in settings.aux_layer_ids] + [
            f"final_hidden (norm of vLLM layer id {self.num_layers})"]

    def extract(self, samples: list[Sample]) -> list[Extracted | Quarantined]:
        results = precheck_samples(samples, self.vocab_size)
        todo = [i for i, r in enumerate(results) if r is None]
        with httpx.Client() as client, ThreadPoolExecutor(self.concurrency) as pool:
            # One request per sample, `concurrency` in flight: vLLM batches them itself.
            for i, r in zip(todo, pool.map(lambda i: self._one(client, samples[i]), todo)):
                results[i] = as_result(i, r)
        return results  # type: ignore[return-value]  # every slot is filled above

    def _one(self, client: httpx.Client, sample: Sample) -> Extracted | str:
        ids, mask = sample
        data = read_hidden_states(self.server.prefill(client, ids))
        got = data["token_ids"].tolist()
        if got != ids:
            raise RuntimeError(f"the vLLM server wrote states for other token ids than sent ({len(got)} ids, "
                               f"{len(ids)} sent)")
        states = data["hidden_states"]  # [T, 4, H]: the aux layers, then the last layer's pre-norm output
        if tuple(states.shape) != (len(ids), 4, self.hidden_size):
            raise RuntimeError(f"the vLLM server wrote hidden states of shape {tuple(states.shape)}, expected "
                               f"({len(ids)}, 4, {self.hidden_size})")
        final = rms_norm(states[:, 3], self.norm_weight, self.norm_eps)
        return record_from_states(ids, mask, [states[:, j] for j in range(3)], final, self.labels, self.settings,
                                  self.teacher)


@contextmanager
def open_vllm_extractor(config: ExtractConfig, files: TargetFiles, settings: ExtractSettings, t2d: torch.Tensor | None,
                        states_dir: Path, log_path: Path | None = None) -> Iterator[VllmExtractor]:
    """Start the configured vLLM server on the target's folder and yield an extractor over it; stop it after.

    Leftover state files of a crashed run are removed first (their samples are still pending).
    """
    v = config.vllm
    text = text_config(files.config)
    clear_states_dir(states_dir)
    launch = VllmLaunch(
        model=files.folder, layer_ids=vllm_layer_ids(settings.aux_layer_ids, text.num_hidden_layers),
        states_dir=states_dir, dtype=resolve_target_dtype(config.target.dtype), tensor_parallel_size=v.tensor_parallel_size,
        max_model_len=v.max_model_len or config.max_length + 1, max_num_seqs=v.max_num_seqs,
        max_num_batched_tokens=v.max_num_batched_tokens, gpu_memory_utilization=v.gpu_memory_utilization,
        cpu_kvcache_space_gib=v.cpu_kvcache_space_gib, enforce_eager=v.enforce_eager,
        trust_remote_code=config.target.trust_remote_code,
        python=Path(v.python) if v.python else default_vllm_python(), extra_args=tuple(v.extra_args))
    topk = settings.teacher == "topk"
    norm, eps, head = load_final_norm_and_head(files.folder, files.config, with_head=topk)
    # The top-k teacher's matmul over the full vocab (163,840 x 7168 for Kimi-K2.5: ~10 TFLOP per
    # 4K-token sample) belongs on a GPU: `target.device` (the room vLLM's memory share leaves).
    device = resolve_device(config.target.device)
    with VllmHiddenStatesServer(launch, log_path=log_path, startup_timeout_s=v.startup_timeout_s) as server:
        yield VllmExtractor(server, settings, files.config, norm, eps, head.to(device) if topk else None,
                            t2d if topk else None, concurrency=v.max_num_seqs)
