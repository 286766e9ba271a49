"""The whole YAML file: every stage's section, schedules and shared resources, read and validated with errors
that name the file and each bad field's dotted path."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from tasks.config.base import Strict, TargetConfig
from tasks.config.discover import DiscoverConfig
from tasks.config.regenerate import RegenerateConfig
from tasks.config.extract import ExtractConfig
from tasks.config.train import TrainConfig
from tasks.config.benchmark import BenchConfig, ProbeConfig


STAGES = ("discover", "regenerate", "extract", "train", "benchmark", "probe")


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
