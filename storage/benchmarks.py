"""Benchmark results and what they say over training: the acceptance curve.

Owns the table `benchmark_results` and the reads of the documented view `acceptance_curve`.
Promises: one benchmark's rows are one transaction; a benchmark counts as done only when its run
completed; a store that does not exist yet has no result and no curve.
"""

from __future__ import annotations

import json

import pyarrow as pa

from storage.connection import DuckDBFile, dict_rows, utc_now
from storage.schema import BENCH_ROWS


class Benchmarks:
    """Writing benchmark rows; reading which ran, and the acceptance curve."""

    def __init__(self, db: DuckDBFile):
        self.db = db

    def write_results(self, run_id: str, rows: list[dict]) -> None:
        """One benchmark's rows (per config, drafter, domain), in one transaction."""
        if not rows:
            return
        now = utc_now()
        with self.db.write() as con:
            con.register("b_in", pa.Table.from_pylist(
                [{**r, "details": json.dumps(r.get("details") or {}, default=str), "run_id": run_id, "created_at": now}
                 for r in rows], schema=BENCH_ROWS))
            con.execute("INSERT INTO benchmark_results BY NAME SELECT * FROM b_in")

    def completed(self, checkpoint: str, config_hash: str) -> str | None:
        """The bench_id of a completed benchmark of `checkpoint` under this config, if there is one."""
        if not self.db.path.exists():
            return None
        with self.db.read() as con:
            row = con.execute(
                "SELECT b.bench_id FROM benchmark_results b JOIN runs r USING (run_id) "
                "WHERE b.checkpoint = ? AND r.config_hash = ? AND r.state = 'COMPLETED' "
                "ORDER BY b.created_at DESC LIMIT 1", [checkpoint, config_hash]).fetchone()
        return row[0] if row else None

    def acceptance_curve(self) -> list[dict]:
        """Every point of the view `acceptance_curve`, each training run in cumulative order."""
        if not self.db.path.exists():
            return []
        with self.db.read() as con:
            return dict_rows(con.execute(
                "SELECT * FROM acceptance_curve ORDER BY run_name, training_tokens NULLS FIRST, "
                "training_conversations NULLS FIRST, step, config_label, domain, drafter"))

    def acceptance_latest(self) -> list[dict]:
        """The curve's latest point: every drafter's row of the newest measured EAGLE-3 point, on the
        held-out chat domain when it was measured, else on all domains together."""
        if not self.db.path.exists():
            return []
        with self.db.read() as con:
            return dict_rows(con.execute(
                "WITH newest AS (SELECT checkpoint, config_label, domain FROM acceptance_curve "
                "  WHERE drafter = 'eagle3' AND domain IN ('heldout_chat', 'all') "
                "  ORDER BY measured_at DESC, domain = 'heldout_chat' DESC LIMIT 1) "
                "SELECT a.* FROM acceptance_curve a JOIN newest n USING (checkpoint, config_label, domain) "
                "ORDER BY a.drafter"))
