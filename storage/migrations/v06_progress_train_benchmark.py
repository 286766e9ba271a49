"""Migration 6: progress: train and benchmark rows (the data stages' rows are kept as progress_data)."""

VERSION = 6
DESCRIPTION = "progress: train and benchmark rows (the data stages' rows are kept as progress_data)"
SQL = """
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
        """
