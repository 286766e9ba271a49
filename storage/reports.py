"""Reads that answer a person's questions of the lineage store: summaries, lineage, read-only SQL.

The queries behind `eagle3 status`, `eagle3 sql`, `eagle3 lineage` and the pipeline's closing
summary, over every table and the views `progress` and `checkpoint_lineage`. Promises:
`query_readonly` runs only SELECT/EXPLAIN statements; every method opens the file read-only.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from storage.connection import DuckDBFile, dict_rows
from storage.errors import LineageError

_READ_ONLY_TYPES = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


class Reports:
    """Whole-pipeline summaries, a checkpoint's lineage, and read-only SQL."""

    def __init__(self, db: DuckDBFile):
        self.db = db

    def pipeline(self, run_name: str | None = None) -> dict:
        """What a whole pipeline has done so far, over every run: the demo's closing summary."""
        with self.db.read() as con:
            one = lambda sql, *p: con.execute(sql, list(p)).fetchone()  # noqa: E731
            outcomes = dict(con.execute("SELECT outcome, count(*) FROM records GROUP BY 1").fetchall())
            gens, completion = one("SELECT count(*), coalesce(sum(completion_tokens), 0) FROM generations")
            failed_prompts = one("SELECT count(DISTINCT prompt_id) FROM generation_failures f WHERE NOT EXISTS "
                                 "(SELECT 1 FROM generations g WHERE g.prompt_id = f.prompt_id)")[0]
            samples = dict(con.execute("SELECT outcome, count(*) FROM samples GROUP BY 1").fetchall())
            tokens, masked = one("SELECT coalesce(sum(tokens), 0), coalesce(sum(masked_tokens), 0) FROM samples "
                                 "WHERE outcome = 'extracted'")
            shards = dict(con.execute("SELECT state, count(*) FROM shards GROUP BY 1").fetchall())
            shard_bytes = one("SELECT coalesce(sum(bytes), 0) FROM shards")[0]
            peak, budget = one("SELECT max((summary->>'peak_disk_bytes')::BIGINT), "
                               "max((summary->>'disk_budget_bytes')::BIGINT) FROM runs WHERE flow = 'extract'")
            name_filter = "WHERE run_name = ?" if run_name else ""
            metric = con.execute(f"SELECT run_name, step, loss, accuracy, conditional_accuracy, tokens FROM train_metrics "
                                 f"{name_filter} ORDER BY recorded_at DESC, step DESC LIMIT 1",
                                 [run_name] if run_name else []).fetchone()
            ckpt = con.execute(f"SELECT checkpoint, path FROM checkpoints {name_filter} "
                               f"{'AND' if run_name else 'WHERE'} format = 'sglang' ORDER BY created_at DESC LIMIT 1",
                               [run_name] if run_name else []).fetchone()
            acceptance: dict[str, float] = {}
            serving: list[dict] = []
            if ckpt is not None:
                acceptance = dict(con.execute(
                    "SELECT drafter, acceptance_token_weighted FROM benchmark_results WHERE bench_id = "
                    "(SELECT bench_id FROM benchmark_results WHERE checkpoint = ? AND kind = 'offline' "
                    " ORDER BY created_at DESC LIMIT 1) AND domain = 'all' AND kind = 'offline'", [ckpt[0]]).fetchall())
                # the llama-server rows of the latest serving benchmark: each row's details hold its summary row
                serving = [json.loads(d) for (d,) in con.execute(
                    "SELECT details FROM benchmark_results WHERE bench_id = "
                    "(SELECT bench_id FROM benchmark_results WHERE checkpoint = ? AND kind = 'serving' "
                    " ORDER BY created_at DESC LIMIT 1) AND kind = 'serving'", [ckpt[0]]).fetchall()]
        return {
            "records_in": sum(outcomes.values()), "record_outcomes": outcomes, "kept": outcomes.get("kept", 0),
            "generations": gens, "completion_tokens": completion, "failed_prompts": failed_prompts,
            "samples": samples, "tokens": tokens, "masked_tokens": masked,
            "shards": shards, "shard_bytes_written": shard_bytes, "peak_disk_bytes": peak, "disk_budget_bytes": budget,
            "train": None if metric is None else dict(zip(
                ("run_name", "step", "loss", "accuracy", "conditional_accuracy", "tokens"), metric)),
            "checkpoint": None if ckpt is None else {"checkpoint": ckpt[0], "path": ckpt[1]},
            "acceptance": acceptance,
            "serving": serving,
        }

    def checkpoint_lineage(self, checkpoint: str) -> tuple[dict, list[str], list[tuple]]:
        """A checkpoint (by id, unique id prefix, exported path, or run name: its latest export) and every (round, shard, sample,
        generation, prompt, source record) it was trained on."""
        path = str(Path(checkpoint).resolve()) if Path(checkpoint).exists() else checkpoint
        with self.db.read() as con:
            found = dict_rows(con.execute(
                "SELECT * FROM checkpoints WHERE checkpoint = ? OR path = ? OR path = ? "
                "OR starts_with(checkpoint, ?) ORDER BY created_at", [checkpoint, checkpoint, path, checkpoint]))
            if len(found) > 1 and all(r["run_name"] == checkpoint for r in found):
                # a training run's name: its latest SGLang export
                found = [r for r in found if r["format"] == "sglang"][-1:] or found[-1:]
            if not found:
                raise LineageError(f"no checkpoint {checkpoint!r} in {self.db.path}; list them with "
                                   "`eagle3 sql \"SELECT checkpoint, format, path FROM checkpoints\"`")
            if len({r["checkpoint"] for r in found}) > 1:
                raise LineageError(f"{checkpoint!r} matches {len(found)} checkpoints "
                                   f"({', '.join(r['checkpoint'] for r in found[:5])}); give more of the id")
            res = con.execute(
                "SELECT round, shard, sample_id, generation_id, prompt_id, source, record_key FROM checkpoint_lineage "
                "WHERE checkpoint = ? ORDER BY round, shard, sample_id", [found[0]["checkpoint"]])
            return found[0], [d[0] for d in res.description], res.fetchall()

    def query_readonly(self, sql: str) -> tuple[list[str], list[tuple]]:
        """Run one or more read-only statements; return the last one's columns and rows."""
        with self.db.read() as con:
            try:
                statements = con.extract_statements(sql)
            except duckdb.Error as e:
                raise LineageError(f"SQL error: {e}") from None
            if not statements:
                raise LineageError("no SQL statement given")
            for st in statements:
                if st.type not in _READ_ONLY_TYPES:
                    raise LineageError(
                        f"refused: `eagle3 sql` is read-only and this is a {st.type.name} statement; "
                        "the lineage store is written only by the pipeline's flows"
                    )
            try:
                for st in statements[:-1]:
                    con.execute(st).fetchall()
                res = con.execute(statements[-1])
                cols = [d[0] for d in (res.description or [])]
                return cols, res.fetchall()
            except duckdb.Error as e:
                raise LineageError(f"SQL error: {e}") from None

    def progress(self) -> tuple[list[str], list[tuple]]:
        return self.query_readonly(
            "SELECT * FROM progress ORDER BY list_position(['discover', 'regenerate', 'extract', 'train', 'benchmark'], stage)")
