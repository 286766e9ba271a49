"""Migration 12: near-dedupe index as segment files (storage.minhash_index): registry minhash_segments; the in-database index goes."""

VERSION = 12
DESCRIPTION = "near-dedupe index as segment files (storage.minhash_index): registry minhash_segments; the in-database index goes"
SQL = """
        CREATE TABLE minhash_segments (
            params VARCHAR NOT NULL,
            name VARCHAR NOT NULL,
            rows BIGINT NOT NULL,
            created_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (params, name)
        );
        -- ~3.4 KB per prompt in the file; the next discover rebuilds the index from the stored
        -- prompts (the backfill: stored prompts not in the index), so nothing is lost.
        DROP INDEX prompt_lsh_bands_bucket;
        DROP TABLE prompt_lsh_bands;
        DROP TABLE prompt_minhash;
        """
