"""Migration 4: train: training runs, metrics, rounds, checkpoints; view checkpoint_lineage."""

VERSION = 4
DESCRIPTION = "train: training runs, metrics, rounds, checkpoints; view checkpoint_lineage"
SQL = """
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
        """
