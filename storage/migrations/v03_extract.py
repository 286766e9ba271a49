"""Migration 3: extract: draft vocabs, shards (written -> consumed -> deleted), samples; progress covers extract."""

VERSION = 3
DESCRIPTION = "extract: draft vocabs, shards (written -> consumed -> deleted), samples; progress covers extract"
SQL = """
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
        """
