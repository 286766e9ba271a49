"""Migration 2: generations, generation files and failures; progress covers regenerate."""

VERSION = 2
DESCRIPTION = "generations, generation files and failures; progress covers regenerate"
SQL = """
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
        """
