"""Migration 1: runs, records, prompts, near-dedupe index; views record_outcomes and progress."""

VERSION = 1
DESCRIPTION = "runs, records, prompts, near-dedupe index; views record_outcomes and progress"
SQL = """
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
        """
