"""Migration 7: generation deferrals: requests that failed only because no endpoint answered (the prompt stays pending)."""

VERSION = 7
DESCRIPTION = "generation deferrals: requests that failed only because no endpoint answered (the prompt stays pending)"
SQL = """
        CREATE TABLE generation_deferrals (
            generation_id VARCHAR NOT NULL,
            prompt_id VARCHAR NOT NULL,
            params_key VARCHAR NOT NULL,
            reason VARCHAR NOT NULL,
            attempts INTEGER NOT NULL,
            run_id VARCHAR NOT NULL,
            deferred_at TIMESTAMPTZ NOT NULL
        );
        """
