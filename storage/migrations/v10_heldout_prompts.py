"""Migration 10: held-out chat prompts: view heldout_prompts; progress_data counts them out of regenerate's pending."""

VERSION = 10
DESCRIPTION = "held-out chat prompts: view heldout_prompts; progress_data counts them out of regenerate's pending"
SQL = """
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
        """
