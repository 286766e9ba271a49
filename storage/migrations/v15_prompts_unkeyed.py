"""Migration 15: prompts without a primary key: discover's write inserts what an anti-join under the writer lock leaves."""

VERSION = 15
DESCRIPTION = "prompts without a primary key: discover's write inserts what an anti-join under the writer lock leaves"
SQL = """
        -- The key's index (random 32-character ids: about 76 B a prompt in DuckDB's buffers, 145 on
        -- disk) was loaded whole by every write that inserted prompts. Without it a 10M-record
        -- discover peaked at 3.41 GiB, not 3.89, in a lineage file of 4.13 GB, not 5.48
        -- (benchmarks/README, dedupe_catalog). Writers are serialised by the store's exclusive
        -- lock, so the anti-join in `LineageStore._insert_discover` keeps prompt ids unique, and a
        -- replayed batch still inserts nothing twice.
        CREATE TABLE prompts_unkeyed (
            prompt_id VARCHAR NOT NULL,
            messages STRUCT(role VARCHAR, content VARCHAR)[] NOT NULL,
            n_turns INTEGER NOT NULL,
            chars INTEGER NOT NULL,
            source VARCHAR NOT NULL,
            record_key VARCHAR NOT NULL,
            format VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL
        );
        INSERT INTO prompts_unkeyed SELECT prompt_id, messages, n_turns, chars, source, record_key, format,
                                           run_id, created_at FROM prompts;
        -- the views that read prompts are bound by name when queried, so they read the new table
        DROP TABLE prompts;
        ALTER TABLE prompts_unkeyed RENAME TO prompts;
        """
