"""The lineage store's schema: record outcomes, example queries, and the Arrow row shapes.

Owns the record outcomes, the example queries `eagle3 run` prints, and the Arrow schemas of
the rows the store inserts; the DDL (tables and the documented views `record_outcomes`,
`progress`, `checkpoint_lineage`, `prompt_clusters`) lives in `storage.migrations`, one module
per schema version. Promises: the views are the public SQL surface; the tables behind them may
change in a later migration.
"""

from __future__ import annotations

import pyarrow as pa

from storage.datasets import GENERATION_FILE_SCHEMA

OUTCOMES = ("kept", "heldout", "exact_duplicate", "near_duplicate", "contaminated", "quarantined")


# Questions a person asks of a pipeline's lineage; `eagle3 run` prints them with their answers.
EXAMPLE_QUERIES: list[tuple[str, str]] = [
    ("What happened to every source record?",
     "SELECT source, outcome, count(*) AS records FROM record_outcomes GROUP BY ALL ORDER BY ALL"),
    ("Which sources trained the latest exported draft?",
     "SELECT source, count(DISTINCT sample_id) AS samples, count(DISTINCT shard) AS shards FROM checkpoint_lineage "
     "WHERE checkpoint = (SELECT checkpoint FROM checkpoints WHERE format = 'sglang' ORDER BY created_at DESC LIMIT 1) "
     "GROUP BY source"),
    ("Acceptance length of each drafter, latest benchmark first",
     "SELECT checkpoint, drafter, domain, round(acceptance_token_weighted, 2) AS acceptance, requests "
     "FROM benchmark_results WHERE kind = 'offline' ORDER BY created_at DESC, domain, drafter"),
    ("Does more data buy acceptance? Each checkpoint's held-out acceptance against its training tokens",
     "SELECT run_name, training_tokens, training_conversations, drafter, round(acceptance_length, 2) AS acceptance "
     "FROM acceptance_curve WHERE domain = 'heldout_chat' ORDER BY run_name, training_tokens, drafter"),
]



PROMPT_ROWS = pa.schema([
    ("prompt_id", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("n_turns", pa.int32()),
    ("chars", pa.int32()),
    ("source", pa.string()),
    ("record_key", pa.string()),
    ("format", pa.string()),
    ("run_id", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
])

# The lineage row of a generation: its identity fields as in the Parquet files, plus where and how.
GENERATION_ROWS = pa.schema(
    [GENERATION_FILE_SCHEMA.field(name) for name in (
        "generation_id", "prompt_id", "params_key", "target_model", "target_revision", "template_id", "mode",
        "reasoning", "origin")]
    + [
        ("file", pa.string()),
        ("n_turns", pa.int32()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("finish_reasons", pa.list_(pa.string())),
        ("flags", pa.list_(pa.string())),
        ("has_token_ids", pa.bool_()),
        ("latency_s", pa.float64()),
        ("endpoint", pa.string()),
        ("served_model", pa.string()),
        ("run_id", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("server_build", pa.string()),
    ]
)

SAMPLE_ROWS = pa.schema([
    ("sample_id", pa.string()),
    ("generation_id", pa.string()),
    ("extract_key", pa.string()),
    ("outcome", pa.string()),
    ("reason", pa.string()),
    ("tokens", pa.int32()),
    ("masked_tokens", pa.int32()),
    ("truncated_tokens", pa.int32()),
    ("id_check", pa.string()),
    ("id_mismatch", pa.string()),
    ("shard", pa.string()),
    ("shard_index", pa.int32()),
    ("run_id", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
])

METRIC_ROWS = pa.schema([
    ("run_name", pa.string()),
    ("step", pa.int32()),
    ("round", pa.int32()),
    ("epoch", pa.int32()),
    ("lr", pa.float64()),
    ("loss", pa.float64()),
    ("step_loss", pa.list_(pa.float64())),
    ("accuracy", pa.list_(pa.float64())),
    ("conditional_accuracy", pa.list_(pa.float64())),
    ("tokens", pa.int64()),
    ("grad_norm", pa.float64()),
    ("run_id", pa.string()),
    ("recorded_at", pa.timestamp("us", tz="UTC")),
])

BENCH_ROWS = pa.schema([
    ("bench_id", pa.string()),
    ("checkpoint", pa.string()),
    ("kind", pa.string()),
    ("config_label", pa.string()),
    ("drafter", pa.string()),
    ("domain", pa.string()),
    ("concurrency", pa.int32()),
    ("requests", pa.int32()),
    ("completion_tokens", pa.int64()),
    ("verify_rounds", pa.int64()),
    ("acceptance_token_weighted", pa.float64()),
    ("acceptance_request_mean", pa.float64()),
    ("acceptance_by_position", pa.list_(pa.float64())),
    ("output_tok_s", pa.float64()),
    ("ttft_p50_s", pa.float64()),
    ("details", pa.string()),
    ("run_id", pa.string()),
    ("created_at", pa.timestamp("us", tz="UTC")),
    ("ttft_p90_s", pa.float64()),
    ("server_build", pa.string()),
])

