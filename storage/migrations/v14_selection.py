"""Migration 14: acceptance-aware selection: prompt_tags (domain, cluster), probe_results, prompt_selections."""

VERSION = 14
DESCRIPTION = "acceptance-aware selection: prompt_tags (domain, cluster), probe_results, prompt_selections"
SQL = """
        -- one row per prompt and tagger (tasks.discover.domains.TAGGER): changed rules tag again, old rows stay
        CREATE TABLE prompt_tags (
            prompt_id VARCHAR NOT NULL,
            tagger VARCHAR NOT NULL,
            domain VARCHAR NOT NULL,
            cluster VARCHAR NOT NULL,
            signals VARCHAR,
            tagged_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (prompt_id, tagger)
        );
        -- the draft's acceptance per cluster on held-out probe prompts, one row per (probe, cluster)
        CREATE TABLE probe_results (
            probe_id VARCHAR NOT NULL,
            checkpoint VARCHAR,
            export_dir VARCHAR NOT NULL,
            tagger VARCHAR NOT NULL,
            cluster VARCHAR NOT NULL,
            domain VARCHAR NOT NULL,
            prompts INTEGER NOT NULL,
            verify_rounds BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL,
            acceptance DOUBLE,
            k INTEGER NOT NULL,
            max_new_tokens INTEGER NOT NULL,
            prompt_ids VARCHAR[] NOT NULL,
            run_id VARCHAR,
            measured_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (probe_id, cluster)
        );
        -- why each prompt was sent to the baseline server: the policy, its cluster, the weights
        CREATE TABLE prompt_selections (
            prompt_id VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            params_key VARCHAR NOT NULL,
            policy VARCHAR NOT NULL,
            cluster VARCHAR,
            probe_id VARCHAR,
            pool_share DOUBLE,
            batch_share DOUBLE,
            acceptance DOUBLE,
            reason VARCHAR NOT NULL,
            selected_at TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (prompt_id, run_id)
        );
        CREATE VIEW prompt_clusters AS
            -- each prompt's tag by the newest tagger that tagged it
            SELECT prompt_id, tagger, domain, cluster, signals FROM prompt_tags
            QUALIFY row_number() OVER (PARTITION BY prompt_id ORDER BY tagged_at DESC, tagger DESC) = 1;
        """
