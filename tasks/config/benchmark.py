"""The `benchmark` and `probe` sections: what measures a draft's acceptance, offline, online and served."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import Strict, TargetConfig


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
