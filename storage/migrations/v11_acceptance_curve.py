"""Migration 11: view acceptance_curve: each checkpoint's offline acceptance against what it was trained on so far."""

VERSION = 11
DESCRIPTION = "view acceptance_curve: each checkpoint's offline acceptance against what it was trained on so far"
SQL = """
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
        """
