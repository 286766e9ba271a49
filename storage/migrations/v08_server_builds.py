"""Migration 8: server builds: the engine version behind every generation and benchmark row; TTFT p90."""

VERSION = 8
DESCRIPTION = "server builds: the engine version behind every generation and benchmark row; TTFT p90"
SQL = """
        ALTER TABLE generations ADD COLUMN server_build VARCHAR;
        ALTER TABLE benchmark_results ADD COLUMN ttft_p90_s DOUBLE;
        ALTER TABLE benchmark_results ADD COLUMN server_build VARCHAR;
        """
