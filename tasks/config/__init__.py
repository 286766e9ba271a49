"""The one typed configuration of the pipeline, a module per stage's section.

Owns the pydantic models behind `configs/*.yaml` and the Prefect flow parameters. Promises: every
field is validated on load, unknown fields are refused, and an error names the field by its
dotted path (`discover.sources.0.kind`) and the file it came from.

`from tasks.config import X` works for every model; the sections live in base (what they share:
the target), discover, regenerate, extract, train, benchmark (and probe) and pipeline (the whole
file, `load_config`). `config_hash`, the id lineage rows record their config by, is in tasks/ids.py.
"""

from tasks.config.base import Strict, TargetConfig
from tasks.config.benchmark import (BenchConfig, EvalSetConfigRef, OnlineBenchConfig, OnlineServerConfig, ProbeConfig,
                                    ServingBenchConfig, VllmServingConfig)
from tasks.config.discover import (DecontaminateConfig, DiscoverConfig, EvalSetConfig, HeldoutConfig, NearDedupeConfig,
                                   RecordFormat, SourceConfig)
from tasks.config.extract import ExtractConfig, VllmExtractConfig
from tasks.config.pipeline import STAGES, ConfigError, PipelineConfig, ResourcesConfig, ScheduleConfig, load_config
from tasks.config.regenerate import (BaselineLaunchConfig, EmbeddedServerConfig, EndpointConfig, ImportConfig,
                                     RegenerateConfig, RetryConfig, SamplingConfig)
from tasks.config.train import TrainConfig
from tasks.ids import config_hash

__all__ = [
    "STAGES", "BaselineLaunchConfig", "BenchConfig", "ConfigError", "DecontaminateConfig", "DiscoverConfig",
    "EmbeddedServerConfig", "EndpointConfig", "EvalSetConfig", "EvalSetConfigRef", "ExtractConfig", "HeldoutConfig",
    "ImportConfig", "NearDedupeConfig", "OnlineBenchConfig", "OnlineServerConfig", "PipelineConfig", "ProbeConfig",
    "RecordFormat", "RegenerateConfig", "ResourcesConfig", "RetryConfig", "SamplingConfig", "ScheduleConfig",
    "ServingBenchConfig", "SourceConfig", "Strict", "TargetConfig", "TrainConfig", "VllmExtractConfig",
    "VllmServingConfig", "config_hash", "load_config",
]
