"""The `extract` section: the target, the hidden states kept, the disk budget and the extraction backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import Strict, TargetConfig


class VllmExtractConfig(Strict):
    """The vLLM server the `vllm` extraction backend starts (each field is one of its flags)."""

    python: str | None = Field(default=None, description="The vLLM environment's python (default: "
                               "$EAGLE3_VLLM_PYTHON, else .venv-vllm/bin/python from `make vllm`).")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one copy of the target spans (8 for Kimi-K2.5).")
    max_model_len: int | None = Field(default=None, ge=8, description=(
        "vLLM's context: the longest sample plus the one token a request must generate (default: max_length + 1)."))
    max_num_seqs: int = Field(default=8, ge=1, description="Samples prefilled together; also the requests in flight.")
    max_num_batched_tokens: int | None = Field(default=None, ge=8, description="Tokens per engine step (vLLM's default).")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="Share of each GPU vLLM may take.")
    cpu_kvcache_space_gib: int = Field(default=2, ge=1, description="Cache space of vLLM's CPU build (GiB).")
    enforce_eager: bool = Field(default=True, description="No CUDA graphs: prefill-only requests gain nothing from them.")
    startup_timeout_s: float = Field(default=1800, gt=0, description="Loading a 1T-parameter target takes long.")
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` flags, passed as given.")


class ExtractConfig(Strict):
    """Parameters of the `extract` flow: tokenisation, draft vocab, hidden states under a disk budget."""

    workspace: str = "runs/demo"
    target: TargetConfig = Field(default_factory=TargetConfig)
    backend: Literal["hf", "vllm"] = Field(
        default="hf", description="hf: transformers in this process; vllm: a vLLM server this flow starts "
        "(tensor parallelism for targets that do not fit one device).")
    vllm: VllmExtractConfig = Field(default_factory=VllmExtractConfig)
    generation_params_keys: list[str] | None = Field(
        default=None, description="Only generations made under these regenerate parameter keys (default: all).")
    max_length: int = Field(default=2048, ge=8, description="Tokens per sample, chat template included.")
    overflow: Literal["truncate", "drop"] = "truncate"
    draft_vocab_size: int = Field(default=32000, ge=16)
    draft_vocab_file: str | None = Field(
        default=None, description="Use this draft vocab (a file an extraction wrote under a workspace's vocab/, "
        "e.g. one built from more data) instead of building one from this workspace's generations; its size must "
        "be draft_vocab_size. It is copied into this workspace; a run without this field uses the first vocab this "
        "workspace registered for its tokenisation and size, built or given.")
    aux_layer_ids: list[int] | None = Field(
        default=None, description="Outputs of decoder layers i (0-based); default [1, L//2-1, L-4].")
    teacher: Literal["final_hidden", "topk"] = Field(
        default="final_hidden", description="final_hidden: post-norm state (exact); topk: compact target log-probs.")
    topk: int = Field(default=20, ge=1, le=1024)
    storage: Literal["bf16", "fp8"] = "bf16"
    disk_budget_bytes: int = Field(default=10 * 2**30, ge=1, description="Shards of this workspace never exceed it.")
    shard_bytes: int = Field(default=256 * 2**20, ge=1, description="Target size of one shard file.")
    max_batch_tokens: int = Field(default=8192, ge=1, description="Padded tokens per forward pass.")
    limit: int | None = Field(default=None, ge=1, description="At most this many samples this run.")
    workers: int = Field(default=1, ge=1, le=256, description="Extraction processes, each holding the target: 1 runs "
                         "in the flow's process; more run as Dask workers (prefect-dask) on this machine.")
    dask_address: str | None = Field(default=None, description="A running Dask scheduler (tcp://host:8786) whose "
                                     "workers extract instead of local ones; they must see the workspace folder.")

    @model_validator(mode="after")
    def _one_engine(self) -> "ExtractConfig":
        if self.vllm.max_model_len is not None and self.vllm.max_model_len <= self.max_length:
            raise ValueError(f"vllm.max_model_len {self.vllm.max_model_len} must exceed max_length {self.max_length}: "
                             "a request prefills the sample and generates one token")
        if self.backend == "vllm" and (self.workers > 1 or self.dask_address):
            raise ValueError("backend 'vllm' parallelises inside its server (vllm.tensor_parallel_size, "
                             "vllm.max_num_seqs); workers and dask_address are for backend 'hf'")
        return self
