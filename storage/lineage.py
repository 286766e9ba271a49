"""The DuckDB lineage and progress store: the only module that speaks SQL.

Owns the schema (versioned migrations), the public views (`record_outcomes`, `progress`), and
every read and write of the lineage file. Promises:
- Writers hold the file only for one short transaction, under an exclusive cross-process file
  lock, and retry while another process holds DuckDB's own lock; no process keeps it open for a
  whole stage, so flows in separate Prefect processes and `eagle3 sql` can interleave.
- A write is one transaction: after a crash, `kill -9` included, it is there whole or not at all.
- Readers open the file read-only; `query_readonly` refuses any statement that is not a query.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import duckdb
import numpy as np
import pyarrow as pa

from storage.datasets import GENERATION_FILE_SCHEMA, write_parquet_atomic

OUTCOMES = ("kept", "exact_duplicate", "near_duplicate", "contaminated", "quarantined")

MIGRATIONS: list[tuple[int, str, str]] = [
    (
        1,
        "runs, records, prompts, near-dedupe index; views record_outcomes and progress",
        """
        CREATE TABLE runs (
            run_id VARCHAR PRIMARY KEY,
            flow VARCHAR NOT NULL,
            flow_run_id VARCHAR,
            git_sha VARCHAR,
            config_hash VARCHAR,
            parameters JSON,
            state VARCHAR NOT NULL,
            started_at TIMESTAMPTZ NOT NULL,
            ended_at TIMESTAMPTZ,
            summary JSON,
            host VARCHAR,
            pid INTEGER
        );
        CREATE TABLE source_reads (
            run_id VARCHAR NOT NULL,
            source VARCHAR NOT NULL,
            location VARCHAR NOT NULL,
            records BIGINT NOT NULL,
            unreadable BIGINT NOT NULL,
            complete BOOLEAN NOT NULL,
            stop_reason VARCHAR,
            notes VARCHAR
        );
        CREATE TABLE records (
            source VARCHAR NOT NULL,
            record_key VARCHAR NOT NULL,
            native_id VARCHAR,
            outcome VARCHAR NOT NULL,
            reason VARCHAR,
            prompt_id VARCHAR,
            duplicate_of VARCHAR,
            eval_item VARCHAR,
            similarity FLOAT,
            run_id VARCHAR NOT NULL,
            recorded_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (source, record_key)
        );
        CREATE TABLE prompts (
            prompt_id VARCHAR PRIMARY KEY,
            messages STRUCT(role VARCHAR, content VARCHAR)[] NOT NULL,
            n_turns INTEGER NOT NULL,
            chars INTEGER NOT NULL,
            source VARCHAR NOT NULL,
            record_key VARCHAR NOT NULL,
            format VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        CREATE TABLE prompt_minhash (
            prompt_id VARCHAR NOT NULL,
            params VARCHAR NOT NULL,
            signature BLOB NOT NULL,
            PRIMARY KEY (prompt_id, params)
        );
        CREATE TABLE prompt_lsh_bands (
            params VARCHAR NOT NULL,
            band SMALLINT NOT NULL,
            bucket UBIGINT NOT NULL,
            prompt_id VARCHAR NOT NULL
        );
        CREATE INDEX prompt_lsh_bands_bucket ON prompt_lsh_bands (params, band, bucket);
        CREATE VIEW record_outcomes AS
            SELECT r.source, r.record_key, r.native_id, r.outcome,
                   r.reason, r.duplicate_of, r.eval_item, r.similarity, r.prompt_id,
                   r.run_id, r.recorded_at
            FROM records r;
        CREATE VIEW progress AS
            WITH last_discover AS (
                -- the latest finished run that decided records: its pace is the stage's rate
                SELECT r.run_id, r.started_at, r.ended_at FROM runs r
                WHERE r.flow = 'discover' AND r.ended_at IS NOT NULL
                  AND EXISTS (SELECT 1 FROM records x WHERE x.run_id = r.run_id)
                ORDER BY r.ended_at DESC LIMIT 1
            ), last_counts AS (
                SELECT count(*) AS n FROM records WHERE run_id = (SELECT run_id FROM last_discover)
            )
            SELECT 'discover' AS stage,
                   count(*) FILTER (WHERE outcome <> 'quarantined') AS done,
                   0::BIGINT AS pending,
                   count(*) FILTER (WHERE outcome = 'quarantined') AS failed,
                   NULL::BIGINT AS tokens,
                   (SELECT n / greatest(epoch(ended_at) - epoch(started_at), 1e-3)
                      FROM last_discover, last_counts) AS rate_per_s,
                   NULL::INTERVAL AS eta
            FROM records;
        """,
    ),
    (
        2,
        "generations, generation files and failures; progress covers regenerate",
        """
        CREATE TABLE generation_files (
            file VARCHAR PRIMARY KEY,
            params_key VARCHAR NOT NULL,
            rows INTEGER NOT NULL,
            bytes BIGINT NOT NULL,
            sha256 VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        CREATE TABLE generations (
            generation_id VARCHAR PRIMARY KEY,
            prompt_id VARCHAR NOT NULL,
            params_key VARCHAR NOT NULL,
            target_model VARCHAR NOT NULL,
            target_revision VARCHAR NOT NULL,
            template_id VARCHAR NOT NULL,
            mode VARCHAR NOT NULL,
            reasoning VARCHAR NOT NULL,
            origin VARCHAR NOT NULL,
            file VARCHAR NOT NULL,
            n_turns INTEGER NOT NULL,
            prompt_tokens BIGINT,
            completion_tokens BIGINT,
            finish_reasons VARCHAR[],
            flags VARCHAR[],
            has_token_ids BOOLEAN NOT NULL,
            latency_s DOUBLE,
            endpoint VARCHAR,
            served_model VARCHAR,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        CREATE TABLE generation_failures (
            generation_id VARCHAR NOT NULL,
            prompt_id VARCHAR NOT NULL,
            params_key VARCHAR NOT NULL,
            reason VARCHAR NOT NULL,
            attempts INTEGER NOT NULL,
            run_id VARCHAR NOT NULL,
            failed_at TIMESTAMPTZ NOT NULL
        );
        CREATE OR REPLACE VIEW progress AS
            WITH last_discover AS (
                SELECT r.run_id, r.started_at, r.ended_at FROM runs r
                WHERE r.flow = 'discover' AND r.ended_at IS NOT NULL
                  AND EXISTS (SELECT 1 FROM records x WHERE x.run_id = r.run_id)
                ORDER BY r.ended_at DESC LIMIT 1
            ), discover_row AS (
                SELECT 'discover' AS stage,
                       count(*) FILTER (WHERE outcome <> 'quarantined') AS done,
                       0::BIGINT AS pending,
                       count(*) FILTER (WHERE outcome = 'quarantined') AS failed,
                       NULL::HUGEINT AS tokens,
                       round((SELECT count(*) FROM records WHERE run_id = (SELECT run_id FROM last_discover))
                         / (SELECT greatest(epoch(ended_at) - epoch(started_at), 1e-3) FROM last_discover), 1)
                         AS rate_per_s,
                       NULL::INTERVAL AS eta
                FROM records
            ), last_regen AS (
                -- the latest regenerate run that produced something: its pace predicts the rest
                SELECT r.run_id, r.started_at, coalesce(r.ended_at, now()) AS ended_at FROM runs r
                WHERE r.flow = 'regenerate'
                  AND EXISTS (SELECT 1 FROM generations g WHERE g.run_id = r.run_id AND g.origin = 'server')
                ORDER BY r.started_at DESC LIMIT 1
            ), regen_pace AS (
                SELECT count(*) AS n, sum(g.completion_tokens) AS tokens,
                       greatest(epoch(any_value(l.ended_at)) - epoch(any_value(l.started_at)), 1e-3) AS secs
                FROM generations g JOIN last_regen l USING (run_id)
            ), regen_counts AS (
                SELECT
                    (SELECT count(DISTINCT prompt_id) FROM generations) AS done,
                    (SELECT count(DISTINCT f.prompt_id) FROM generation_failures f
                      WHERE NOT EXISTS (SELECT 1 FROM generations g WHERE g.prompt_id = f.prompt_id)) AS failed,
                    (SELECT count(*) FROM prompts) AS prompts,
                    (SELECT sum(completion_tokens) FROM generations) AS tokens
            ), regenerate_row AS (
                SELECT 'regenerate' AS stage, c.done,
                       greatest(c.prompts - c.done - c.failed, 0) AS pending, c.failed, c.tokens,
                       (SELECT round(tokens / secs, 1) FROM regen_pace) AS rate_per_s,
                       (SELECT CASE WHEN n > 0 THEN to_seconds(round(greatest(c.prompts - c.done - c.failed, 0) * secs / n)::BIGINT) END
                          FROM regen_pace) AS eta
                FROM regen_counts c
            )
            SELECT * FROM discover_row UNION ALL SELECT * FROM regenerate_row;
        """,
    ),
    (
        3,
        "extract: draft vocabs, shards (written -> consumed -> deleted), samples; progress covers extract",
        """
        CREATE TABLE draft_vocabs (
            vocab_id VARCHAR PRIMARY KEY,
            tokenize_key VARCHAR NOT NULL,
            file VARCHAR NOT NULL,
            sha256 VARCHAR NOT NULL,
            draft_vocab_size INTEGER NOT NULL,
            target_vocab_size INTEGER NOT NULL,
            coverage DOUBLE NOT NULL,
            counted_tokens BIGINT NOT NULL,
            counted_samples BIGINT NOT NULL,
            report JSON,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        CREATE TABLE extract_settings (
            extract_key VARCHAR PRIMARY KEY,
            vocab_id VARCHAR NOT NULL,
            settings JSON NOT NULL,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        CREATE TABLE shards (
            shard VARCHAR PRIMARY KEY,
            extract_key VARCHAR NOT NULL,
            state VARCHAR NOT NULL,
            bytes BIGINT NOT NULL,
            sha256 VARCHAR NOT NULL,
            samples INTEGER NOT NULL,
            tokens BIGINT NOT NULL,
            masked_tokens BIGINT NOT NULL,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL,
            consumed_by VARCHAR,
            consumed_at TIMESTAMPTZ,
            deleted_at TIMESTAMPTZ
        );
        CREATE TABLE shard_reads (
            shard VARCHAR NOT NULL,
            train_run_id VARCHAR NOT NULL,
            epoch INTEGER NOT NULL,
            read_at TIMESTAMPTZ NOT NULL
        );
        CREATE TABLE samples (
            sample_id VARCHAR PRIMARY KEY,
            generation_id VARCHAR NOT NULL,
            extract_key VARCHAR NOT NULL,
            outcome VARCHAR NOT NULL,
            reason VARCHAR,
            tokens INTEGER,
            masked_tokens INTEGER,
            truncated_tokens INTEGER,
            id_check VARCHAR NOT NULL,
            id_mismatch VARCHAR,
            shard VARCHAR,
            shard_index INTEGER,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        CREATE INDEX samples_generation ON samples (generation_id, extract_key);
        CREATE OR REPLACE VIEW progress AS
            WITH last_discover AS (
                SELECT r.run_id, r.started_at, r.ended_at FROM runs r
                WHERE r.flow = 'discover' AND r.ended_at IS NOT NULL
                  AND EXISTS (SELECT 1 FROM records x WHERE x.run_id = r.run_id)
                ORDER BY r.ended_at DESC LIMIT 1
            ), discover_row AS (
                SELECT 'discover' AS stage,
                       count(*) FILTER (WHERE outcome <> 'quarantined') AS done,
                       0::BIGINT AS pending,
                       count(*) FILTER (WHERE outcome = 'quarantined') AS failed,
                       NULL::HUGEINT AS tokens,
                       round((SELECT count(*) FROM records WHERE run_id = (SELECT run_id FROM last_discover))
                         / (SELECT greatest(epoch(ended_at) - epoch(started_at), 1e-3) FROM last_discover), 1)
                         AS rate_per_s,
                       NULL::INTERVAL AS eta
                FROM records
            ), last_regen AS (
                SELECT r.run_id, r.started_at, coalesce(r.ended_at, now()) AS ended_at FROM runs r
                WHERE r.flow = 'regenerate'
                  AND EXISTS (SELECT 1 FROM generations g WHERE g.run_id = r.run_id AND g.origin = 'server')
                ORDER BY r.started_at DESC LIMIT 1
            ), regen_pace AS (
                SELECT count(*) AS n, sum(g.completion_tokens) AS tokens,
                       greatest(epoch(any_value(l.ended_at)) - epoch(any_value(l.started_at)), 1e-3) AS secs
                FROM generations g JOIN last_regen l USING (run_id)
            ), regen_counts AS (
                SELECT
                    (SELECT count(DISTINCT prompt_id) FROM generations) AS done,
                    (SELECT count(DISTINCT f.prompt_id) FROM generation_failures f
                      WHERE NOT EXISTS (SELECT 1 FROM generations g WHERE g.prompt_id = f.prompt_id)) AS failed,
                    (SELECT count(*) FROM prompts) AS prompts,
                    (SELECT sum(completion_tokens) FROM generations) AS tokens
            ), regenerate_row AS (
                SELECT 'regenerate' AS stage, c.done,
                       greatest(c.prompts - c.done - c.failed, 0) AS pending, c.failed, c.tokens,
                       (SELECT round(tokens / secs, 1) FROM regen_pace) AS rate_per_s,
                       (SELECT CASE WHEN n > 0 THEN to_seconds(round(greatest(c.prompts - c.done - c.failed, 0) * secs / n)::BIGINT) END
                          FROM regen_pace) AS eta
                FROM regen_counts c
            ), last_extract AS (
                -- the latest extract run that wrote samples: its token pace predicts the rest
                SELECT r.run_id, r.started_at, coalesce(r.ended_at, now()) AS ended_at FROM runs r
                WHERE r.flow = 'extract' AND EXISTS (SELECT 1 FROM samples s WHERE s.run_id = r.run_id)
                ORDER BY r.started_at DESC LIMIT 1
            ), extract_pace AS (
                SELECT count(*) AS n,
                       greatest(epoch(any_value(l.ended_at)) - epoch(any_value(l.started_at)), 1e-3) AS secs,
                       sum(s.tokens) FILTER (WHERE s.outcome = 'extracted') AS tokens
                FROM samples s JOIN last_extract l USING (run_id)
            ), extract_counts AS (
                -- per generation: a generation counts once whatever extract settings it went through
                SELECT
                    (SELECT count(DISTINCT generation_id) FROM samples WHERE outcome = 'extracted') AS done,
                    (SELECT count(DISTINCT generation_id) FROM samples s WHERE outcome <> 'extracted'
                      AND NOT EXISTS (SELECT 1 FROM samples x WHERE x.generation_id = s.generation_id
                                      AND x.outcome = 'extracted')) AS failed,
                    (SELECT count(*) FROM generations) AS generations,
                    (SELECT sum(tokens) FROM samples WHERE outcome = 'extracted') AS tokens
            ), extract_row AS (
                SELECT 'extract' AS stage, c.done,
                       greatest(c.generations - c.done - c.failed, 0) AS pending, c.failed, c.tokens,
                       (SELECT round(tokens / secs, 1) FROM extract_pace) AS rate_per_s,
                       (SELECT CASE WHEN n > 0 THEN to_seconds(round(greatest(c.generations - c.done - c.failed, 0) * secs / n)::BIGINT) END
                          FROM extract_pace) AS eta
                FROM extract_counts c
            )
            SELECT * FROM discover_row UNION ALL SELECT * FROM regenerate_row UNION ALL SELECT * FROM extract_row;
        """,
    ),
    (
        4,
        "train: training runs, metrics, rounds, checkpoints; view checkpoint_lineage",
        """
        CREATE TABLE train_runs (
            run_name VARCHAR PRIMARY KEY,
            mode VARCHAR NOT NULL,
            extract_key VARCHAR NOT NULL,
            vocab_id VARCHAR NOT NULL,
            target VARCHAR NOT NULL,
            target_revision VARCHAR NOT NULL,
            draft_config JSON NOT NULL,
            train_config JSON NOT NULL,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        CREATE TABLE train_metrics (
            run_name VARCHAR NOT NULL,
            step INTEGER NOT NULL,
            round INTEGER NOT NULL,
            epoch INTEGER NOT NULL,
            lr DOUBLE NOT NULL,
            loss DOUBLE NOT NULL,
            step_loss DOUBLE[] NOT NULL,
            accuracy DOUBLE[] NOT NULL,
            conditional_accuracy DOUBLE[] NOT NULL,
            tokens BIGINT NOT NULL,
            grad_norm DOUBLE,
            run_id VARCHAR NOT NULL,
            recorded_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (run_name, step)
        );
        CREATE TABLE train_rounds (
            run_name VARCHAR NOT NULL,
            round INTEGER NOT NULL,
            shards VARCHAR[] NOT NULL,
            samples BIGINT NOT NULL,
            epochs INTEGER NOT NULL,
            last_step INTEGER NOT NULL,
            run_id VARCHAR NOT NULL,
            completed_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (run_name, round)
        );
        CREATE TABLE checkpoints (
            checkpoint VARCHAR PRIMARY KEY,
            run_name VARCHAR NOT NULL,
            step INTEGER NOT NULL,
            format VARCHAR NOT NULL,
            path VARCHAR NOT NULL,
            sha256 VARCHAR NOT NULL,
            rounds INTEGER NOT NULL,
            target VARCHAR NOT NULL,
            target_revision VARCHAR NOT NULL,
            aux_layer_ids INTEGER[] NOT NULL,
            vocab_id VARCHAR NOT NULL,
            extract_key VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        CREATE VIEW checkpoint_lineage AS
            SELECT c.checkpoint, c.format, c.path, c.run_name, c.step, r.round, u.shard, s.sample_id,
                   s.generation_id, g.prompt_id, rec.source, rec.record_key
            FROM checkpoints c
            JOIN train_rounds r ON r.run_name = c.run_name AND r.round < c.rounds
            CROSS JOIN LATERAL (SELECT unnest(r.shards) AS shard) u
            JOIN samples s ON s.shard = u.shard AND s.outcome = 'extracted'
            JOIN generations g ON g.generation_id = s.generation_id
            LEFT JOIN records rec ON rec.prompt_id = g.prompt_id AND rec.outcome = 'kept';
        """,
    ),
    (
        5,
        "benchmark: results per checkpoint, drafter, domain and config",
        """
        CREATE TABLE benchmark_results (
            bench_id VARCHAR NOT NULL,
            checkpoint VARCHAR,
            kind VARCHAR NOT NULL,
            config_label VARCHAR NOT NULL,
            drafter VARCHAR NOT NULL,
            domain VARCHAR NOT NULL,
            concurrency INTEGER,
            requests INTEGER NOT NULL,
            completion_tokens BIGINT NOT NULL,
            verify_rounds BIGINT,
            acceptance_token_weighted DOUBLE,
            acceptance_request_mean DOUBLE,
            acceptance_by_position DOUBLE[],
            output_tok_s DOUBLE,
            ttft_p50_s DOUBLE,
            details JSON,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        """,
    ),
    (
        6,
        "progress: train and benchmark rows (the data stages' rows are kept as progress_data)",
        """
        ALTER VIEW progress RENAME TO progress_data;
        CREATE VIEW progress AS
            WITH last_train AS (
                -- the latest training run that completed a round: its token pace predicts the rest
                SELECT r.run_id, greatest(epoch(r.ended_at) - epoch(r.started_at), 1e-3) AS secs FROM runs r
                WHERE r.flow = 'train' AND r.ended_at IS NOT NULL
                  AND EXISTS (SELECT 1 FROM train_rounds t WHERE t.run_id = r.run_id)
                ORDER BY r.started_at DESC LIMIT 1
            ), train_pace AS (
                SELECT sum(s.tokens * t.epochs) / any_value(l.secs) AS tok_s
                FROM last_train l JOIN train_rounds t ON t.run_id = l.run_id
                CROSS JOIN LATERAL (SELECT unnest(t.shards) AS shard) u JOIN shards s ON s.shard = u.shard
            ), train_epochs AS (
                SELECT coalesce(max((train_config->>'epochs')::INTEGER), 1) AS epochs FROM train_runs
            ), train_counts AS (
                -- a shard counts as trained once a completed round lists it; written shards wait
                SELECT coalesce(sum(samples) FILTER (WHERE trained), 0) AS done,
                       coalesce(sum(tokens) FILTER (WHERE trained), 0) AS tokens,
                       coalesce(sum(samples) FILTER (WHERE NOT trained), 0) AS pending,
                       coalesce(sum(tokens) FILTER (WHERE NOT trained), 0) AS pending_tokens
                FROM (SELECT s.samples, s.tokens,
                             EXISTS (SELECT 1 FROM train_rounds r WHERE list_contains(r.shards, s.shard)) AS trained
                      FROM shards s)
            ), train_row AS (
                SELECT 'train' AS stage, c.done, c.pending, 0::BIGINT AS failed, c.tokens::HUGEINT AS tokens,
                       (SELECT round(tok_s, 1) FROM train_pace) AS rate_per_s,
                       (SELECT CASE WHEN tok_s > 0 THEN to_seconds(round(c.pending_tokens * e.epochs / tok_s)::BIGINT) END
                          FROM train_pace, train_epochs e) AS eta
                FROM train_counts c
            ), latest_exports AS (
                SELECT checkpoint FROM checkpoints WHERE format = 'sglang'
                QUALIFY row_number() OVER (PARTITION BY run_name ORDER BY created_at DESC) = 1
            ), benchmark_row AS (
                -- done: each training run's latest SGLang export, benchmarked or not (pending)
                SELECT 'benchmark' AS stage,
                       count(*) FILTER (WHERE EXISTS (SELECT 1 FROM benchmark_results b WHERE b.checkpoint = c.checkpoint))
                         AS done,
                       count(*) FILTER (WHERE NOT EXISTS (
                           SELECT 1 FROM benchmark_results b WHERE b.checkpoint = c.checkpoint)) AS pending,
                       (SELECT count(*) FROM runs WHERE flow = 'benchmark' AND state IN ('FAILED', 'CRASHED')
                          AND started_at > coalesce((SELECT max(started_at) FROM runs
                                                     WHERE flow = 'benchmark' AND state = 'COMPLETED'),
                                                    '-infinity'::TIMESTAMPTZ)) AS failed,
                       (SELECT sum(completion_tokens) FROM benchmark_results)::HUGEINT AS tokens,
                       NULL::DOUBLE AS rate_per_s, NULL::INTERVAL AS eta
                FROM latest_exports c
            )
            SELECT * FROM progress_data UNION ALL SELECT * FROM train_row UNION ALL SELECT * FROM benchmark_row;
        """,
    ),
]


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
]


class LineageError(RuntimeError):
    """A lineage store problem a user can act on (missing file, refused statement)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class StoreLocking:
    lock_timeout_s: float = 600.0
    open_retry_s: float = 120.0


class LineageStore:
    def __init__(self, path: str | Path, locking: StoreLocking | None = None):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.locking = locking or StoreLocking()
        self._migrated = False

    # ------------------------------------------------------------ connections

    @contextmanager
    def _flock(self, exclusive: bool) -> Iterator[None]:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + self.locking.lock_timeout_s
        delay = 0.005
        try:
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LineageError(
                            f"lineage store {self.path} stayed locked by another process for "
                            f"{self.locking.lock_timeout_s:.0f} s"
                        ) from None
                    time.sleep(delay * (1 + random.random()))
                    delay = min(delay * 2, 0.25)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _connect(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        # DuckDB's own file lock can still be held by a process that does not use our lock
        # file (an interactive `duckdb` shell, say): retry with backoff instead of failing.
        deadline = time.monotonic() + self.locking.open_retry_s
        delay = 0.01
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=read_only)
            except duckdb.IOException as e:
                if "lock" not in str(e).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)

    @contextmanager
    def write(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """One transaction on the file, under the exclusive lock; committed on success."""
        with self._flock(exclusive=True):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            con = self._connect(read_only=False)
            try:
                if not self._migrated:
                    self._migrate(con)
                con.execute("BEGIN TRANSACTION")
                try:
                    yield con
                    con.execute("COMMIT")
                except BaseException:
                    con.execute("ROLLBACK")
                    raise
            finally:
                con.close()

    @contextmanager
    def read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        if not self.path.exists():
            raise LineageError(f"no lineage store at {self.path}: run a stage (eagle3 discover) first")
        with self._flock(exclusive=False):
            con = self._connect(read_only=True)
            try:
                yield con
            finally:
                con.close()

    def _migrate(self, con: duckdb.DuckDBPyConnection) -> None:
        con.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version INTEGER PRIMARY KEY, description VARCHAR, applied_at TIMESTAMPTZ)"
        )
        done = {v for (v,) in con.execute("SELECT version FROM schema_migrations").fetchall()}
        for version, description, sql in MIGRATIONS:
            if version in done:
                continue
            con.execute("BEGIN TRANSACTION")
            try:
                con.execute(sql)
                con.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", [version, description, _now()])
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        self._migrated = True

    def schema_version(self) -> int:
        with self.read() as con:
            return con.execute("SELECT max(version) FROM schema_migrations").fetchall()[0][0]

    # ------------------------------------------------------------ runs

    def begin_run(self, flow: str, parameters: dict, config_hash: str, flow_run_id: str | None, git_sha: str | None) -> str:
        """A new run row; runs left RUNNING by a dead process on this host become CRASHED."""
        run_id = uuid.uuid4().hex
        host = socket.gethostname()
        with self.write() as con:
            for other, pid in con.execute(
                "SELECT run_id, pid FROM runs WHERE state = 'RUNNING' AND host = ?", [host]
            ).fetchall():
                if pid is not None and not _alive(pid):
                    con.execute("UPDATE runs SET state = 'CRASHED', ended_at = ? WHERE run_id = ?", [_now(), other])
            con.execute(
                "INSERT INTO runs (run_id, flow, flow_run_id, git_sha, config_hash, parameters, state, started_at, host, pid) "
                "VALUES (?, ?, ?, ?, ?, ?, 'RUNNING', ?, ?, ?)",
                [run_id, flow, flow_run_id, git_sha, config_hash, json.dumps(parameters, default=str), _now(), host, os.getpid()],
            )
        return run_id

    def finish_run(self, run_id: str, state: str, summary: dict | None = None) -> None:
        with self.write() as con:
            con.execute(
                "UPDATE runs SET state = ?, ended_at = ?, summary = ? WHERE run_id = ?",
                [state, _now(), json.dumps(summary or {}, default=str), run_id],
            )

    def record_source_reads(self, run_id: str, reads: list[dict]) -> None:
        if not reads:
            return
        rows = pa.Table.from_pylist([{**r, "run_id": run_id} for r in reads])
        with self.write() as con:
            con.register("reads_in", rows)
            con.execute(
                "INSERT INTO source_reads SELECT run_id, source, location, records, unreadable, "
                "complete, stop_reason, notes FROM reads_in"
            )

    # ------------------------------------------------------------ discover: lookups

    def seen_record_keys(self, source: str) -> set[str]:
        if not self.path.exists():
            return set()
        with self.read() as con:
            return {k for (k,) in con.execute("SELECT record_key FROM records WHERE source = ?", [source]).fetchall()}

    def existing_prompt_ids(self, prompt_ids: list[str]) -> set[str]:
        if not self.path.exists() or not prompt_ids:
            return set()
        with self.read() as con:
            con.register("ids_in", pa.table({"prompt_id": prompt_ids}))
            rows = con.execute("SELECT DISTINCT p.prompt_id FROM prompts p JOIN ids_in USING (prompt_id)").fetchall()
        return {r[0] for r in rows}

    def band_collisions(self, params: str, keys: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """Stored prompts sharing an LSH bucket with batch texts: (batch index, prompt id) pairs."""
        if not self.path.exists() or keys.size == 0:
            return np.zeros(0, np.int64), []
        n, bands = keys.shape
        probe = pa.table({
            "idx": np.repeat(np.arange(n, dtype=np.int64), bands),
            "band": np.tile(np.arange(bands, dtype=np.int16), n),
            "bucket": keys.reshape(-1),
        })
        with self.read() as con:
            con.register("probe", probe)
            rows = con.execute(
                "SELECT DISTINCT p.idx, b.prompt_id FROM probe p JOIN prompt_lsh_bands b "
                "ON b.params = ? AND b.band = p.band AND b.bucket = p.bucket ORDER BY p.idx, b.prompt_id",
                [params],
            ).fetchall()
        return np.array([r[0] for r in rows], dtype=np.int64), [r[1] for r in rows]

    def minhash_signatures(self, params: str, prompt_ids: list[str], num_perm: int) -> np.ndarray:
        if not prompt_ids:
            return np.zeros((0, num_perm), np.uint32)
        with self.read() as con:
            con.register("ids_in", pa.table({"prompt_id": prompt_ids, "pos": np.arange(len(prompt_ids))}))
            rows = con.execute(
                "SELECT i.pos, m.signature FROM ids_in i JOIN prompt_minhash m "
                "ON m.prompt_id = i.prompt_id AND m.params = ? ORDER BY i.pos",
                [params],
            ).fetchall()
        if len(rows) != len(prompt_ids):
            raise LineageError("a stored prompt lost its MinHash signature; rerun discover to backfill")
        return np.stack([np.frombuffer(sig, dtype=np.uint32) for _, sig in rows])

    def prompts_without_signature(self, params: str) -> tuple[list[str], list[list[dict]]]:
        """Kept prompts with no signature under these near-dedupe parameters (after a change)."""
        if not self.path.exists():
            return [], []
        with self.read() as con:
            rows = con.execute(
                "SELECT p.prompt_id, p.messages FROM prompts p ANTI JOIN "
                "(SELECT prompt_id FROM prompt_minhash WHERE params = ?) m USING (prompt_id) ORDER BY p.prompt_id",
                [params],
            ).fetchall()
        return [r[0] for r in rows], [r[1] for r in rows]

    # ------------------------------------------------------------ discover: writes

    def write_discover_batch(
        self,
        run_id: str,
        records: list[dict],
        prompts: list[dict],
        minhash: tuple[str, list[str], np.ndarray, np.ndarray] | None,
    ) -> None:
        """Outcomes, kept prompts and their near-dedupe index, all in one transaction.

        Idempotent: a record or prompt already stored is left as it is, so replaying a batch after
        a crash adds nothing twice.
        """
        with self.write() as con:
            self._insert_discover(con, run_id, _now(), records, prompts, minhash)

    def _insert_discover(self, con, run_id: str, now: datetime, records: list[dict], prompts: list[dict],
                         minhash: tuple[str, list[str], np.ndarray, np.ndarray] | None) -> None:
        if records:
            con.register("rec_in", pa.Table.from_pylist([{**r, "run_id": run_id, "recorded_at": now} for r in records]))
            con.execute(
                "INSERT INTO records SELECT source, record_key, native_id, outcome, reason, prompt_id, "
                "duplicate_of, eval_item, similarity, run_id, recorded_at FROM rec_in ON CONFLICT DO NOTHING"
            )
        if prompts:
            table = pa.Table.from_pylist([{**p, "run_id": run_id, "created_at": now} for p in prompts], schema=_PROMPT_SCHEMA)
            con.register("prm_in", table)
            con.execute(
                "INSERT INTO prompts SELECT prompt_id, messages, n_turns, chars, source, record_key, format, "
                "run_id, created_at FROM prm_in ON CONFLICT DO NOTHING"
            )
        if minhash is not None:
            self._insert_minhash(con, *minhash)

    def write_minhash(self, params: str, prompt_ids: list[str], sig: np.ndarray, keys: np.ndarray) -> None:
        with self.write() as con:
            self._insert_minhash(con, params, prompt_ids, sig, keys)

    @staticmethod
    def _insert_minhash(con, params: str, prompt_ids: list[str], sig: np.ndarray, keys: np.ndarray) -> None:
        if not prompt_ids:
            return
        con.register("sig_in", pa.table({
            "prompt_id": prompt_ids,
            "signature": [row.tobytes() for row in np.ascontiguousarray(sig, dtype=np.uint32)],
        }))
        con.execute(
            "INSERT INTO prompt_minhash SELECT prompt_id, ?, signature FROM sig_in ON CONFLICT DO NOTHING", [params]
        )
        bands = keys.shape[1]
        con.register("band_in", pa.table({
            "band": np.tile(np.arange(bands, dtype=np.int16), len(prompt_ids)),
            "bucket": keys.reshape(-1),
            "prompt_id": np.repeat(np.array(prompt_ids, dtype=object), bands),
        }))
        # Only prompts whose signature was new get bands, so a replayed batch adds none twice.
        con.execute(
            "INSERT INTO prompt_lsh_bands SELECT ?, b.band, b.bucket, b.prompt_id FROM band_in b "
            "WHERE NOT EXISTS (SELECT 1 FROM prompt_lsh_bands x WHERE x.params = ? AND x.prompt_id = b.prompt_id)",
            [params, params],
        )

    # ------------------------------------------------------------ regenerate

    def pending_prompts(self, params_key: str, retry_failed: bool, limit: int | None) -> list[tuple[str, list[dict]]]:
        """Prompts with no generation under `params_key` (and, unless retrying, no recorded failure)."""
        if not self.path.exists():
            return []
        skip_failed = "" if retry_failed else (
            "AND NOT EXISTS (SELECT 1 FROM generation_failures f WHERE f.prompt_id = p.prompt_id AND f.params_key = ?)"
        )
        params = [params_key] + ([] if retry_failed else [params_key])
        sql = (
            "SELECT p.prompt_id, p.messages FROM prompts p "
            "WHERE NOT EXISTS (SELECT 1 FROM generations g WHERE g.prompt_id = p.prompt_id AND g.params_key = ?) "
            f"{skip_failed} ORDER BY p.created_at, p.prompt_id"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self.read() as con:
            return [(pid, msgs) for pid, msgs in con.execute(sql, params).fetchall()]

    def existing_generation_ids(self, ids: list[str]) -> set[str]:
        if not self.path.exists() or not ids:
            return set()
        with self.read() as con:
            con.register("ids_in", pa.table({"generation_id": ids}))
            rows = con.execute("SELECT g.generation_id FROM generations g JOIN ids_in USING (generation_id)").fetchall()
        return {r[0] for r in rows}

    def generation_files(self, params_key: str) -> set[str]:
        if not self.path.exists():
            return set()
        with self.read() as con:
            rows = con.execute("SELECT file FROM generation_files WHERE params_key = ?", [params_key]).fetchall()
        return {r[0] for r in rows}

    def write_generations(self, run_id: str, file_row: dict | None, generations: list[dict], failures: list[dict],
                          discover_batch: tuple[list[dict], list[dict], tuple | None] | None = None) -> None:
        """A Parquet file's lineage, its generations and this batch's failures, in one transaction.

        `discover_batch` (records, prompts, minhash) commits imported records with the generations
        made from them: both or neither, so an import interrupted by a crash is simply redone.
        """
        now = _now()
        with self.write() as con:
            if discover_batch is not None:
                self._insert_discover(con, run_id, now, *discover_batch)
            if file_row is not None:
                con.execute(
                    "INSERT INTO generation_files VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [file_row["file"], file_row["params_key"], file_row["rows"], file_row["bytes"],
                     file_row["sha256"], run_id, now],
                )
            if generations:
                con.register("gen_in", pa.Table.from_pylist(
                    [{**g, "run_id": run_id, "created_at": now} for g in generations], schema=_GENERATION_SCHEMA))
                con.execute("INSERT INTO generations SELECT * FROM gen_in ON CONFLICT DO NOTHING")
            if failures:
                con.register("fail_in", pa.Table.from_pylist([{**f, "run_id": run_id, "failed_at": now} for f in failures]))
                con.execute(
                    "INSERT INTO generation_failures SELECT generation_id, prompt_id, params_key, reason, attempts, "
                    "run_id, failed_at FROM fail_in"
                )

    def generation_summary(self, run_id: str) -> dict:
        with self.read() as con:
            row = con.execute(
                "SELECT count(*), coalesce(sum(completion_tokens), 0), "
                "count(*) FILTER (WHERE list_contains(flags, 'empty')), "
                "count(*) FILTER (WHERE list_contains(flags, 'length')), "
                "count(*) FILTER (WHERE has_token_ids) FROM generations WHERE run_id = ?",
                [run_id],
            ).fetchall()[0]
            failed = con.execute(
                "SELECT count(DISTINCT prompt_id) FROM generation_failures f WHERE run_id = ? "
                "AND NOT EXISTS (SELECT 1 FROM generations g WHERE g.generation_id = f.generation_id)",
                [run_id],
            ).fetchall()[0][0]
        keys = ("generations", "completion_tokens", "flagged_empty", "flagged_length", "with_token_ids")
        return {**dict(zip(keys, row)), "failed": failed}

    # ------------------------------------------------------------ extract

    def generations_to_tokenise(self, params_keys: list[str] | None) -> list[tuple[str, str, str]]:
        """(generation_id, params_key, file) of every generation, oldest first (optionally only some params)."""
        if not self.path.exists():
            return []
        where, args = ("WHERE params_key IN (SELECT unnest(?))", [params_keys]) if params_keys is not None else ("", [])
        with self.read() as con:
            return con.execute(
                f"SELECT generation_id, params_key, file FROM generations {where} ORDER BY created_at, generation_id", args
            ).fetchall()

    def pending_generations(self, extract_key: str, params_keys: list[str] | None,
                            limit: int | None) -> list[tuple[str, str, str]]:
        """Generations with no sample under `extract_key`, in the order rounds take them."""
        where = "AND g.params_key IN (SELECT unnest(?))" if params_keys is not None else ""
        args: list = [extract_key] + ([params_keys] if params_keys is not None else [])
        sql = (
            "SELECT g.generation_id, g.params_key, g.file FROM generations g "
            "WHERE NOT EXISTS (SELECT 1 FROM samples s WHERE s.generation_id = g.generation_id AND s.extract_key = ?) "
            f"{where} ORDER BY g.created_at, g.generation_id"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self.read() as con:
            return con.execute(sql, args).fetchall()

    def draft_vocab(self, tokenize_key: str, draft_vocab_size: int) -> dict | None:
        """The vocab built for this tokenisation and size, if any (the first one built is kept)."""
        if not self.path.exists():
            return None
        with self.read() as con:
            res = con.execute(
                "SELECT * FROM draft_vocabs WHERE tokenize_key = ? AND draft_vocab_size = ? ORDER BY created_at LIMIT 1",
                [tokenize_key, draft_vocab_size])
            cols = [d[0] for d in res.description]
            row = res.fetchone()
        return dict(zip(cols, row)) if row else None

    def register_draft_vocab(self, run_id: str, row: dict) -> None:
        with self.write() as con:
            con.execute(
                "INSERT INTO draft_vocabs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [row["vocab_id"], row["tokenize_key"], row["file"], row["sha256"], row["draft_vocab_size"],
                 row["target_vocab_size"], row["coverage"], row["counted_tokens"], row["counted_samples"],
                 json.dumps(row.get("report"), default=str), run_id, _now()],
            )

    def register_extract_settings(self, run_id: str, extract_key: str, vocab_id: str, settings: dict) -> None:
        with self.write() as con:
            con.execute("INSERT INTO extract_settings VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [extract_key, vocab_id, json.dumps(settings, sort_keys=True), run_id, _now()])

    def live_shards(self) -> dict[str, dict]:
        """Shards registered and not deleted, by name: what may exist in the shard folder."""
        if not self.path.exists():
            return {}
        with self.read() as con:
            res = con.execute("SELECT * FROM shards WHERE state <> 'deleted' ORDER BY created_at, shard")
            cols = [d[0] for d in res.description]
            return {r[0]: dict(zip(cols, r)) for r in res.fetchall()}

    def last_shard_seq(self) -> int:
        """The highest sequence number among registered shards (`<key>-<seq>.safetensors`). Not their
        count: a shard whose samples were all quarantined takes a number but leaves no row."""
        if not self.path.exists():
            return 0
        with self.read() as con:
            return con.execute("SELECT coalesce(max(CAST(regexp_extract(shard, '-([0-9]+)[.]safetensors$', 1) AS BIGINT)), 0) "
                               "FROM shards").fetchall()[0][0]

    def write_extract_batch(self, run_id: str, shard_row: dict | None, sample_rows: list[dict]) -> None:
        """A shard's lineage and the outcome of every sample of its batch, in one transaction.

        The shard file is already complete on disk; if this commit never happens the next run
        deletes the file as unregistered and the samples are pending again: nothing lost, nothing twice.
        """
        now = _now()
        with self.write() as con:
            if shard_row is not None:
                con.execute(
                    "INSERT INTO shards (shard, extract_key, state, bytes, sha256, samples, tokens, masked_tokens, "
                    "run_id, created_at) VALUES (?, ?, 'written', ?, ?, ?, ?, ?, ?, ?)",
                    [shard_row["shard"], shard_row["extract_key"], shard_row["bytes"], shard_row["sha256"],
                     shard_row["samples"], shard_row["tokens"], shard_row["masked_tokens"], run_id, now],
                )
            if sample_rows:
                con.register("smp_in", pa.Table.from_pylist(
                    [{**r, "run_id": run_id, "created_at": now} for r in sample_rows], schema=_SAMPLE_SCHEMA))
                con.execute("INSERT INTO samples SELECT * FROM smp_in")

    def mark_shards_read(self, train_run_id: str, shards: list[str], epoch: int) -> None:
        """Training read these shards: the first read moves a shard written -> consumed by that run."""
        if not shards:
            return
        now = _now()
        with self.write() as con:
            con.register("rd_in", pa.table({"shard": shards}))
            con.execute("INSERT INTO shard_reads SELECT shard, ?, ?, ? FROM rd_in", [train_run_id, epoch, now])
            con.execute(
                "UPDATE shards SET state = 'consumed', consumed_by = ?, consumed_at = ? "
                "WHERE state = 'written' AND shard IN (SELECT shard FROM rd_in)", [train_run_id, now])

    def mark_shard_deleted(self, shard: str) -> None:
        with self.write() as con:
            state = con.execute("SELECT state FROM shards WHERE shard = ?", [shard]).fetchall()
            if not state:
                raise LineageError(f"no shard {shard!r} in the lineage store")
            if state[0][0] == "written":
                raise LineageError(f"shard {shard!r} was never consumed by a training run; refusing to delete it")
            con.execute("UPDATE shards SET state = 'deleted', deleted_at = coalesce(deleted_at, ?) WHERE shard = ?",
                        [_now(), shard])

    def extract_summary(self, run_id: str) -> dict:
        with self.read() as con:
            rows = con.execute(
                "SELECT outcome, count(*), coalesce(sum(tokens), 0), coalesce(sum(masked_tokens), 0), "
                "coalesce(sum(truncated_tokens), 0) FROM samples WHERE run_id = ? GROUP BY 1", [run_id]).fetchall()
            checks = dict(con.execute(
                "SELECT id_check, count(*) FROM samples WHERE run_id = ? GROUP BY 1", [run_id]).fetchall())
            first = con.execute(
                "SELECT generation_id, id_mismatch FROM samples WHERE run_id = ? AND id_check = 'mismatch' "
                "ORDER BY created_at, sample_id LIMIT 1", [run_id]).fetchall()
            reasons = con.execute(
                "SELECT regexp_replace(reason, '[0-9]+', 'N', 'g'), count(*) FROM samples "
                "WHERE run_id = ? AND outcome <> 'extracted' GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 10", [run_id]).fetchall()
        by = {o: (n, t, m, c) for o, n, t, m, c in rows}
        ext = by.get("extracted", (0, 0, 0, 0))
        return {
            "extracted": ext[0], "tokens": ext[1], "masked_tokens": ext[2],
            "truncated_tokens": sum(v[3] for v in by.values()),
            "skipped": by.get("skipped", (0,))[0], "quarantined": by.get("quarantined", (0,))[0],
            "ids_checked": checks.get("match", 0) + checks.get("mismatch", 0), "ids_mismatched": checks.get("mismatch", 0),
            "first_mismatch": {"generation_id": first[0][0], **json.loads(first[0][1])} if first else None,
            "reasons": reasons,
        }

    # ------------------------------------------------------------ train

    def extract_settings(self, extract_key: str | None) -> dict | None:
        """One extraction's settings (default: the latest registered), with its vocab file."""
        if not self.path.exists():
            return None
        where, args = ("WHERE e.extract_key = ?", [extract_key]) if extract_key else ("", [])
        with self.read() as con:
            res = con.execute(
                "SELECT e.extract_key, e.vocab_id, e.settings, v.file AS vocab_file, v.sha256 AS vocab_sha256 "
                f"FROM extract_settings e JOIN draft_vocabs v USING (vocab_id) {where} "
                "ORDER BY e.created_at DESC LIMIT 1", args)
            cols = [d[0] for d in res.description]
            row = res.fetchone()
        if row is None:
            return None
        out = dict(zip(cols, row))
        out["settings"] = json.loads(out["settings"])
        return out

    def round_shards(self, extract_key: str, consumer: str, exclude: list[str]) -> list[dict]:
        """Shards a training round takes: written ones, plus ones this consumer read but did not finish."""
        with self.read() as con:
            res = con.execute(
                "SELECT shard, sha256, samples, tokens FROM shards WHERE extract_key = ? "
                "AND (state = 'written' OR (state = 'consumed' AND consumed_by = ?)) "
                "AND shard NOT IN (SELECT unnest(?::VARCHAR[])) ORDER BY created_at, shard",
                [extract_key, consumer, exclude])
            cols = [d[0] for d in res.description]
            return [dict(zip(cols, r)) for r in res.fetchall()]

    def shard_samples(self, shards: list[str]) -> list[tuple[str, int, int]]:
        """(shard, slot, tokens) of every extracted sample in these shards."""
        with self.read() as con:
            return con.execute(
                "SELECT shard, shard_index, tokens FROM samples WHERE outcome = 'extracted' "
                "AND shard IN (SELECT unnest(?::VARCHAR[])) ORDER BY shard, shard_index", [shards]).fetchall()

    def register_train_run(self, run_id: str, row: dict) -> dict:
        """The training run's identity; an existing one with the same name is returned as stored."""
        with self.write() as con:
            con.execute(
                "INSERT INTO train_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [row["run_name"], row["mode"], row["extract_key"], row["vocab_id"], row["target"], row["target_revision"],
                 json.dumps(row["draft_config"], sort_keys=True), json.dumps(row["train_config"], sort_keys=True),
                 run_id, _now()])
            res = con.execute("SELECT * FROM train_runs WHERE run_name = ?", [row["run_name"]])
            cols = [d[0] for d in res.description]
            return dict(zip(cols, res.fetchone()))

    def write_train_metrics(self, run_id: str, run_name: str, rows: list[dict]) -> None:
        """Metrics rows keyed by (run, step): steps redone after a resume replace their first record."""
        if not rows:
            return
        now = _now()
        with self.write() as con:
            con.register("m_in", pa.Table.from_pylist([{**r, "run_name": run_name, "run_id": run_id, "recorded_at": now}
                                                       for r in rows], schema=_METRIC_SCHEMA))
            con.execute("INSERT OR REPLACE INTO train_metrics SELECT * FROM m_in")

    def train_metrics(self, run_name: str) -> list[dict]:
        with self.read() as con:
            res = con.execute("SELECT * FROM train_metrics WHERE run_name = ? ORDER BY step", [run_name])
            cols = [d[0] for d in res.description]
            return [dict(zip(cols, r)) for r in res.fetchall()]

    def write_train_round(self, run_id: str, run_name: str, round_index: int, shards: list[str], samples: int,
                          epochs: int, last_step: int) -> None:
        with self.write() as con:
            con.execute("INSERT INTO train_rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [run_name, round_index, shards, samples, epochs, last_step, run_id, _now()])

    def register_checkpoint(self, run_id: str, row: dict) -> None:
        with self.write() as con:
            con.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [row["checkpoint"], row["run_name"], row["step"], row["format"], row["path"], row["sha256"], row["rounds"],
                 row["target"], row["target_revision"], row["aux_layer_ids"], row["vocab_id"], row["extract_key"],
                 run_id, _now()])

    # ------------------------------------------------------------ benchmark
    def checkpoint_row(self, path: str | None = None, fmt: str = "sglang") -> dict | None:
        """The registered checkpoint at `path`, or the latest one of `fmt`."""
        if not self.path.exists():
            return None
        with self.read() as con:
            if path is not None:
                res = con.execute("SELECT * FROM checkpoints WHERE path = ? ORDER BY created_at DESC LIMIT 1", [path])
            else:
                res = con.execute("SELECT * FROM checkpoints WHERE format = ? ORDER BY created_at DESC LIMIT 1", [fmt])
            cols = [d[0] for d in res.description]
            row = res.fetchone()
        return dict(zip(cols, row)) if row else None


    def write_benchmark_results(self, run_id: str, rows: list[dict]) -> None:
        """One benchmark's rows (per config, drafter, domain), in one transaction."""
        if not rows:
            return
        now = _now()
        with self.write() as con:
            con.register("b_in", pa.Table.from_pylist(
                [{**r, "details": json.dumps(r.get("details") or {}, default=str), "run_id": run_id, "created_at": now}
                 for r in rows], schema=_BENCH_SCHEMA))
            con.execute("INSERT INTO benchmark_results SELECT * FROM b_in")

    # ------------------------------------------------------------ reports and exports

    def outcome_counts(self, run_id: str | None = None) -> dict[str, int]:
        counts = {o: 0 for o in OUTCOMES}
        if not self.path.exists():
            return counts
        with self.read() as con:
            sql = "SELECT outcome, count(*) FROM records"
            rows = con.execute(sql + (" WHERE run_id = ? GROUP BY 1" if run_id else " GROUP BY 1"), [run_id] if run_id else []).fetchall()
        counts.update(dict(rows))
        return counts

    def quarantine_reasons(self, run_id: str, limit: int = 10) -> list[tuple[str, int]]:
        with self.read() as con:
            return con.execute(
                "SELECT regexp_replace(reason, '[0-9]+', 'N', 'g') AS why, count(*) FROM records "
                "WHERE run_id = ? AND outcome = 'quarantined' GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT ?",
                [run_id, limit],
            ).fetchall()

    def export_prompts(self, target: Path) -> int:
        """Write every kept prompt to one Parquet file, atomically."""
        with self.read() as con:
            table = con.sql(
                "SELECT prompt_id, messages, source, record_key, format, n_turns, chars, run_id "
                "FROM prompts ORDER BY created_at, prompt_id"
            ).to_arrow_table()
        write_parquet_atomic(table, target)
        return table.num_rows

    def benchmarked(self, checkpoint: str, config_hash: str) -> str | None:
        """The bench_id of a completed benchmark of `checkpoint` under this config, if there is one."""
        if not self.path.exists():
            return None
        with self.read() as con:
            row = con.execute(
                "SELECT b.bench_id FROM benchmark_results b JOIN runs r USING (run_id) "
                "WHERE b.checkpoint = ? AND r.config_hash = ? AND r.state = 'COMPLETED' "
                "ORDER BY b.created_at DESC LIMIT 1", [checkpoint, config_hash]).fetchone()
        return row[0] if row else None

    def pipeline_report(self, run_name: str | None = None) -> dict:
        """What a whole pipeline has done so far, over every run: the demo's closing summary."""
        with self.read() as con:
            one = lambda sql, *p: con.execute(sql, list(p)).fetchone()  # noqa: E731
            outcomes = dict(con.execute("SELECT outcome, count(*) FROM records GROUP BY 1").fetchall())
            gens, completion = one("SELECT count(*), coalesce(sum(completion_tokens), 0) FROM generations")
            failed_prompts = one("SELECT count(DISTINCT prompt_id) FROM generation_failures f WHERE NOT EXISTS "
                                 "(SELECT 1 FROM generations g WHERE g.prompt_id = f.prompt_id)")[0]
            samples = dict(con.execute("SELECT outcome, count(*) FROM samples GROUP BY 1").fetchall())
            tokens, masked = one("SELECT coalesce(sum(tokens), 0), coalesce(sum(masked_tokens), 0) FROM samples "
                                 "WHERE outcome = 'extracted'")
            shards = dict(con.execute("SELECT state, count(*) FROM shards GROUP BY 1").fetchall())
            shard_bytes = one("SELECT coalesce(sum(bytes), 0) FROM shards")[0]
            peak, budget = one("SELECT max((summary->>'peak_disk_bytes')::BIGINT), "
                               "max((summary->>'disk_budget_bytes')::BIGINT) FROM runs WHERE flow = 'extract'")
            name_filter = "WHERE run_name = ?" if run_name else ""
            metric = con.execute(f"SELECT run_name, step, loss, accuracy, conditional_accuracy, tokens FROM train_metrics "
                                 f"{name_filter} ORDER BY recorded_at DESC, step DESC LIMIT 1",
                                 [run_name] if run_name else []).fetchone()
            ckpt = con.execute(f"SELECT checkpoint, path FROM checkpoints {name_filter} "
                               f"{'AND' if run_name else 'WHERE'} format = 'sglang' ORDER BY created_at DESC LIMIT 1",
                               [run_name] if run_name else []).fetchone()
            acceptance: dict[str, float] = {}
            if ckpt is not None:
                acceptance = dict(con.execute(
                    "SELECT drafter, acceptance_token_weighted FROM benchmark_results WHERE bench_id = "
                    "(SELECT bench_id FROM benchmark_results WHERE checkpoint = ? AND kind = 'offline' "
                    " ORDER BY created_at DESC LIMIT 1) AND domain = 'all' AND kind = 'offline'", [ckpt[0]]).fetchall())
        return {
            "records_in": sum(outcomes.values()), "record_outcomes": outcomes, "kept": outcomes.get("kept", 0),
            "generations": gens, "completion_tokens": completion, "failed_prompts": failed_prompts,
            "samples": samples, "tokens": tokens, "masked_tokens": masked,
            "shards": shards, "shard_bytes_written": shard_bytes, "peak_disk_bytes": peak, "disk_budget_bytes": budget,
            "train": None if metric is None else dict(zip(
                ("run_name", "step", "loss", "accuracy", "conditional_accuracy", "tokens"), metric)),
            "checkpoint": None if ckpt is None else {"checkpoint": ckpt[0], "path": ckpt[1]},
            "acceptance": acceptance,
        }

    def checkpoint_lineage(self, checkpoint: str) -> tuple[dict, list[str], list[tuple]]:
        """A checkpoint (by id, unique id prefix, exported path, or run name: its latest export) and every (round, shard, sample,
        generation, prompt, source record) it was trained on."""
        path = str(Path(checkpoint).resolve()) if Path(checkpoint).exists() else checkpoint
        with self.read() as con:
            res = con.execute("SELECT * FROM checkpoints WHERE checkpoint = ? OR path = ? OR path = ? "
                              "OR starts_with(checkpoint, ?) ORDER BY created_at", [checkpoint, checkpoint, path, checkpoint])
            cols = [d[0] for d in res.description]
            found = [dict(zip(cols, r)) for r in res.fetchall()]
            if len(found) > 1 and all(r["run_name"] == checkpoint for r in found):
                # a training run's name: its latest SGLang export
                found = [r for r in found if r["format"] == "sglang"][-1:] or found[-1:]
            if not found:
                raise LineageError(f"no checkpoint {checkpoint!r} in {self.path}; list them with "
                                   "`eagle3 sql \"SELECT checkpoint, format, path FROM checkpoints\"`")
            if len({r["checkpoint"] for r in found}) > 1:
                raise LineageError(f"{checkpoint!r} matches {len(found)} checkpoints "
                                   f"({', '.join(r['checkpoint'] for r in found[:5])}); give more of the id")
            res = con.execute(
                "SELECT round, shard, sample_id, generation_id, prompt_id, source, record_key FROM checkpoint_lineage "
                "WHERE checkpoint = ? ORDER BY round, shard, sample_id", [found[0]["checkpoint"]])
            return found[0], [d[0] for d in res.description], res.fetchall()

    def query_readonly(self, sql: str) -> tuple[list[str], list[tuple]]:
        """Run one or more read-only statements; return the last one's columns and rows."""
        with self.read() as con:
            try:
                statements = con.extract_statements(sql)
            except duckdb.Error as e:
                raise LineageError(f"SQL error: {e}") from None
            if not statements:
                raise LineageError("no SQL statement given")
            for st in statements:
                if st.type not in _READ_ONLY_TYPES:
                    raise LineageError(
                        f"refused: `eagle3 sql` is read-only and this is a {st.type.name} statement; "
                        "the lineage store is written only by the pipeline's flows"
                    )
            try:
                for st in statements[:-1]:
                    con.execute(st).fetchall()
                res = con.execute(statements[-1])
                cols = [d[0] for d in (res.description or [])]
                return cols, res.fetchall()
            except duckdb.Error as e:
                raise LineageError(f"SQL error: {e}") from None

    def progress(self) -> tuple[list[str], list[tuple]]:
        return self.query_readonly(
            "SELECT * FROM progress ORDER BY list_position(['discover', 'regenerate', 'extract', 'train', 'benchmark'], stage)")


_READ_ONLY_TYPES = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}

_PROMPT_SCHEMA = pa.schema([
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
_GENERATION_SCHEMA = pa.schema(
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
    ]
)

_SAMPLE_SCHEMA = pa.schema([
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

_METRIC_SCHEMA = pa.schema([
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

_BENCH_SCHEMA = pa.schema([
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
])
