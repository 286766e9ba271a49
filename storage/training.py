"""Train's rows: each training run's identity, its metrics per step, its validations, and the rounds it trained.

Owns the tables `train_runs`, `train_metrics`, `train_validations` and `train_rounds` (which shards a
round takes is `storage.extraction`'s; the checkpoints it exports are `storage.checkpoints`').
Promises: a training run's identity is registered once, by name, and kept; metrics are keyed by
(run, step) and validations by (run, round, step), so steps redone after a resume replace their
first record; a round is recorded once.
"""

from __future__ import annotations

import json

import pyarrow as pa

from storage.connection import DuckDBFile, dict_row, dict_rows, utc_now
from storage.schema import METRIC_ROWS


class TrainingRuns:
    """Training runs, their metrics, their validations and their rounds."""

    def __init__(self, db: DuckDBFile):
        self.db = db

    def register_run(self, run_id: str, row: dict) -> dict:
        """The training run's identity; an existing one with the same name is returned as stored."""
        with self.db.write() as con:
            con.execute(
                "INSERT INTO train_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [row["run_name"], row["mode"], row["extract_key"], row["vocab_id"], row["target"], row["target_revision"],
                 json.dumps(row["draft_config"], sort_keys=True), json.dumps(row["train_config"], sort_keys=True),
                 run_id, utc_now()])
            return dict_row(con.execute("SELECT * FROM train_runs WHERE run_name = ?", [row["run_name"]]))

    def write_metrics(self, run_id: str, run_name: str, rows: list[dict]) -> None:
        """Metrics rows keyed by (run, step): steps redone after a resume replace their first record."""
        if not rows:
            return
        now = utc_now()
        with self.db.write() as con:
            con.register("m_in", pa.Table.from_pylist([{**r, "run_name": run_name, "run_id": run_id, "recorded_at": now}
                                                       for r in rows], schema=METRIC_ROWS))
            con.execute("INSERT OR REPLACE INTO train_metrics SELECT * FROM m_in")

    def metrics(self, run_name: str) -> list[dict]:
        """Every metrics row of a training run, by step."""
        with self.db.read() as con:
            return dict_rows(con.execute("SELECT * FROM train_metrics WHERE run_name = ? ORDER BY step", [run_name]))

    def write_validation(self, run_id: str, run_name: str, round_index: int, validation: dict, kept: bool) -> None:
        """One validation (`Validation.to_json()`) of the run's round, written when it is measured, so that a run
        resumed after a kill still reports it."""
        v = validation
        with self.db.write() as con:
            con.execute(
                "INSERT OR REPLACE INTO train_validations VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [run_name, round_index, v["step"], v["epoch"], v["samples"], v["positions"], v["accuracy"],
                 v["conditional_accuracy"], v["expected_acceptance"], kept, run_id, utc_now()])

    def validations(self, run_name: str) -> list[dict]:
        """Every validation of a training run, from every invocation, by round and step."""
        with self.db.read() as con:
            return dict_rows(con.execute(
                "SELECT step, epoch, samples, positions, accuracy, conditional_accuracy, expected_acceptance, "
                "round, kept FROM train_validations WHERE run_name = ? ORDER BY round, step", [run_name]))

    def write_round(self, run_id: str, run_name: str, round_index: int, shards: list[str], samples: int,
                    epochs: int, last_step: int) -> None:
        with self.db.write() as con:
            con.execute("INSERT INTO train_rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [run_name, round_index, shards, samples, epochs, last_step, run_id, utc_now()])
