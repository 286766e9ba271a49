"""Migration 16: train_validations: every validation of a training run, kept across restarts."""

VERSION = 16
DESCRIPTION = "train_validations: every validation of a training run, kept across restarts"
SQL = """
        -- A run's validations lived only in its invocation's summary, so a run resumed after a kill
        -- reported the validations of its last invocation alone. Keyed by (run, round, step): a step
        -- validated again after a resume replaces its first record, as train_metrics does.
        CREATE TABLE train_validations (
            run_name VARCHAR NOT NULL,
            round INTEGER NOT NULL,
            step INTEGER NOT NULL,
            epoch INTEGER NOT NULL,
            samples INTEGER NOT NULL,
            positions BIGINT NOT NULL,
            accuracy DOUBLE[] NOT NULL,
            conditional_accuracy DOUBLE[] NOT NULL,
            expected_acceptance DOUBLE NOT NULL,
            kept BOOLEAN NOT NULL,
            run_id VARCHAR NOT NULL,
            recorded_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (run_name, round, step)
        );
        """
