"""Exported checkpoints: every export of a training run's step, in each format (sglang, gguf, ...).

Owns the table `checkpoints` (what each was trained on is the view `checkpoint_lineage`, read by
`storage.reports`). Promises: a checkpoint's path is stored absolute, so every reader finds it from
any directory; a lookup by path accepts the path as given or resolved from this directory; a store
that does not exist yet has no checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from storage.connection import DuckDBFile, dict_row, utc_now


class Checkpoints:
    """Registering exports, and finding one by path, by format, or by run and step."""

    def __init__(self, db: DuckDBFile):
        self.db = db

    def register(self, run_id: str, row: dict) -> None:
        """Register an exported checkpoint; its path is stored absolute, so every reader finds it from any directory.

        `converter` (optional) names the program and version that converted it (the gguf format).
        """
        with self.db.write() as con:
            con.execute(
                "INSERT OR REPLACE INTO checkpoints (checkpoint, run_name, step, format, path, sha256, rounds, target, "
                "target_revision, aux_layer_ids, vocab_id, extract_key, run_id, created_at, converter) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [row["checkpoint"], row["run_name"], row["step"], row["format"], str(Path(row["path"]).resolve()),
                 row["sha256"], row["rounds"],
                 row["target"], row["target_revision"], row["aux_layer_ids"], row["vocab_id"], row["extract_key"],
                 run_id, utc_now(), row.get("converter")])

    def find(self, path: str | None = None, fmt: str = "sglang") -> dict | None:
        """The registered checkpoint at `path` (as given, or resolved from this directory), or the latest one of `fmt`."""
        if not self.db.path.exists():
            return None
        with self.db.read() as con:
            if path is not None:
                return dict_row(con.execute(
                    "SELECT * FROM checkpoints WHERE path = ? OR path = ? ORDER BY created_at DESC LIMIT 1",
                    [path, str(Path(path).resolve())]))
            return dict_row(con.execute(
                "SELECT * FROM checkpoints WHERE format = ? ORDER BY created_at DESC LIMIT 1", [fmt]))

    def latest_export(self, run_name: str, fmt: str) -> dict | None:
        """The newest registered export in format `fmt` of training run `run_name` (None if none)."""
        if not self.db.path.exists():
            return None
        with self.db.read() as con:
            return dict_row(con.execute("SELECT * FROM checkpoints WHERE run_name = ? AND format = ? "
                                        "ORDER BY created_at DESC LIMIT 1", [run_name, fmt]))

    def export_of(self, run_name: str, step: int, fmt: str) -> dict | None:
        """The latest registered export in format `fmt` of training run `run_name` at `step` (None if none)."""
        if not self.db.path.exists():
            return None
        with self.db.read() as con:
            return dict_row(con.execute("SELECT * FROM checkpoints WHERE run_name = ? AND step = ? AND format = ? "
                                        "ORDER BY created_at DESC LIMIT 1", [run_name, step, fmt]))
