"""Migration 5: benchmark: results per checkpoint, drafter, domain and config."""

VERSION = 5
DESCRIPTION = "benchmark: results per checkpoint, drafter, domain and config"
SQL = """
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
        """
