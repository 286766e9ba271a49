"""The lineage store's DDL: versioned migrations, applied in order by `storage.connection`.

Owns the list of (version, description, SQL) that builds the tables and the public views
(`record_outcomes`, `progress`, `checkpoint_lineage`, ...). Promises: an applied migration is
never edited; a schema change is a new entry appended at the end with the next version.
"""

from __future__ import annotations

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
    (
        7,
        "generation deferrals: requests that failed only because no endpoint answered (the prompt stays pending)",
        """
        CREATE TABLE generation_deferrals (
            generation_id VARCHAR NOT NULL,
            prompt_id VARCHAR NOT NULL,
            params_key VARCHAR NOT NULL,
            reason VARCHAR NOT NULL,
            attempts INTEGER NOT NULL,
            run_id VARCHAR NOT NULL,
            deferred_at TIMESTAMPTZ NOT NULL
        );
        """,
    ),
    (
        8,
        "server builds: the engine version behind every generation and benchmark row; TTFT p90",
        """
        ALTER TABLE generations ADD COLUMN server_build VARCHAR;
        ALTER TABLE benchmark_results ADD COLUMN ttft_p90_s DOUBLE;
        ALTER TABLE benchmark_results ADD COLUMN server_build VARCHAR;
        """,
    ),
    (
        9,
        "checkpoints: the converter that made an export (llama.cpp's convert_hf_to_gguf.py for gguf)",
        """
        ALTER TABLE checkpoints ADD COLUMN converter VARCHAR;
        """,
    ),
    (
        10,
        "held-out chat prompts: view heldout_prompts; progress_data counts them out of regenerate's pending",
        """
        CREATE VIEW heldout_prompts AS
            SELECT p.prompt_id, p.messages, p.n_turns, p.chars, r.source, r.record_key, r.reason,
                   r.run_id, r.recorded_at
            FROM records r JOIN prompts p USING (prompt_id)
            WHERE r.outcome = 'heldout';
        CREATE OR REPLACE VIEW progress_data AS
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
                    -- held-out prompts are never regenerated: not pending
                    (SELECT count(*) FROM prompts p WHERE NOT EXISTS (SELECT 1 FROM records r
                      WHERE r.prompt_id = p.prompt_id AND r.outcome = 'heldout')) AS prompts,
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
        11,
        "view acceptance_curve: each checkpoint's offline acceptance against what it was trained on so far",
        """
        CREATE VIEW acceptance_curve AS
            WITH latest AS (
                -- a checkpoint's latest offline measurement per chain depth, drafter and domain
                SELECT * FROM benchmark_results
                WHERE kind = 'offline' AND checkpoint IS NOT NULL
                QUALIFY row_number() OVER (PARTITION BY checkpoint, config_label, drafter, domain
                                           ORDER BY created_at DESC, bench_id DESC) = 1
            ), trained AS (
                -- training_tokens: loss-masked positions trained on up to the checkpoint's step (the train
                -- loop's counter, each epoch's pass counted); training_conversations: distinct samples of
                -- the rounds completed before the export (an online round covers every generation so far)
                SELECT c.checkpoint, c.run_name, c.step, c.rounds,
                       (SELECT max(m.tokens) FROM train_metrics m
                         WHERE m.run_name = c.run_name AND m.step <= c.step) AS training_tokens,
                       (SELECT CASE WHEN any_value(r.mode) = 'online' THEN max(t.samples) ELSE sum(t.samples) END
                          FROM train_rounds t LEFT JOIN train_runs r USING (run_name)
                         WHERE t.run_name = c.run_name AND t.round < c.rounds)::BIGINT AS training_conversations
                FROM checkpoints c
            )
            SELECT t.checkpoint, t.run_name, t.step, t.rounds, t.training_tokens, t.training_conversations,
                   l.drafter, l.domain, l.config_label, l.acceptance_token_weighted AS acceptance_length,
                   l.requests, l.completion_tokens, l.bench_id, l.created_at AS measured_at
            FROM latest l JOIN trained t USING (checkpoint)
            ORDER BY t.run_name, t.training_tokens NULLS FIRST, t.training_conversations NULLS FIRST, t.step,
                     l.config_label, l.domain, l.drafter;
        """,
    ),
    (
        12,
        "near-dedupe index as segment files (storage.minhash_index): registry minhash_segments; the in-database index goes",
        """
        CREATE TABLE minhash_segments (
            params VARCHAR NOT NULL,
            name VARCHAR NOT NULL,
            rows BIGINT NOT NULL,
            created_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (params, name)
        );
        -- ~3.4 KB per prompt in the file; the next discover rebuilds the index from the stored
        -- prompts (the backfill: stored prompts not in the index), so nothing is lost.
        DROP INDEX prompt_lsh_bands_bucket;
        DROP TABLE prompt_lsh_bands;
        DROP TABLE prompt_minhash;
        """,
    ),
    (
        13,
        "progress: regenerate's ETA paced in requests (user turns in mode all), not prompts",
        """
        CREATE OR REPLACE VIEW progress_data AS
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
            ), regen_units AS (
                -- requests a prompt takes: one per user turn in mode `all`, one in mode `last`. The pace
                -- is in requests, not prompts: sources differ in turns, and a queue that ends with
                -- one-turn prompts made a prompt-paced ETA 42% long at 90% done (the scale rehearsal).
                SELECT p.prompt_id,
                       CASE WHEN (SELECT any_value(g.mode) FROM generations g JOIN last_regen l USING (run_id)) = 'last'
                            THEN 1
                            -- user turns: a prompt is an optional system turn, then user/assistant turns
                            -- alternating and ending with a user turn, so with or without the system turn
                            ELSE (p.n_turns + 1) // 2 END AS units
                FROM prompts p
            ), regen_pace AS (
                SELECT count(*) AS n, sum(u.units) AS units, sum(g.completion_tokens) AS tokens,
                       greatest(epoch(any_value(l.ended_at)) - epoch(any_value(l.started_at)), 1e-3) AS secs
                FROM generations g JOIN last_regen l USING (run_id) LEFT JOIN regen_units u USING (prompt_id)
            ), regen_counts AS (
                SELECT
                    (SELECT count(DISTINCT prompt_id) FROM generations) AS done,
                    (SELECT count(DISTINCT f.prompt_id) FROM generation_failures f
                      WHERE NOT EXISTS (SELECT 1 FROM generations g WHERE g.prompt_id = f.prompt_id)) AS failed,
                    -- held-out prompts are never regenerated: not pending
                    (SELECT count(*) FROM prompts p WHERE NOT EXISTS (SELECT 1 FROM records r
                      WHERE r.prompt_id = p.prompt_id AND r.outcome = 'heldout')) AS prompts,
                    (SELECT sum(completion_tokens) FROM generations) AS tokens,
                    (SELECT sum(u.units) FROM regen_units u
                      WHERE NOT EXISTS (SELECT 1 FROM generations g WHERE g.prompt_id = u.prompt_id)
                        AND NOT EXISTS (SELECT 1 FROM generation_failures f WHERE f.prompt_id = u.prompt_id)
                        AND NOT EXISTS (SELECT 1 FROM records r WHERE r.prompt_id = u.prompt_id
                                        AND r.outcome = 'heldout')) AS pending_units
            ), regenerate_row AS (
                SELECT 'regenerate' AS stage, c.done,
                       greatest(c.prompts - c.done - c.failed, 0) AS pending, c.failed, c.tokens,
                       (SELECT round(tokens / secs, 1) FROM regen_pace) AS rate_per_s,
                       (SELECT CASE WHEN units > 0 THEN to_seconds(round(coalesce(c.pending_units, 0) * secs / units)::BIGINT) END
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
]
