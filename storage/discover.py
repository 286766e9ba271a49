"""Discover's rows: source reads, record outcomes, kept and held-out prompts.

Owns the tables `source_reads`, `records` and `prompts` (the near-dedupe index segments a batch
adds are `storage.minhash_index`'s, written inside the same transaction). Promises:
- A discover batch is one transaction and idempotent: a record or prompt already stored is left
  as it is, so replaying a batch after a crash adds nothing twice.
- The held-out set is read in the order prompts were held out, so a growing set keeps its first
  prompts first (a benchmark's first N stay the same prompts).
- A store that does not exist yet has no record, prompt or held-out prompt.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from storage.connection import DuckDBFile, utc_now
from storage.datasets import write_parquet_atomic
from storage.exact_index import ExactIndexStore
from storage.minhash_index import NearIndexStore
from storage.schema import OUTCOMES, PROMPT_ROWS

# (params key, prompt ids, signatures, band keys) of a batch's prompts, for the near-dedupe index.
MinhashBatch = tuple[str, list[str], np.ndarray, np.ndarray]


class DiscoverRecords:
    """Writes and reads of discover's records and prompts; tells the dedupe indexes what it stored."""

    def __init__(self, db: DuckDBFile, exact_index: ExactIndexStore, near_index: NearIndexStore):
        self.db, self.exact_index, self.near_index = db, exact_index, near_index

    # ------------------------------------------------------------ writes

    def record_source_reads(self, run_id: str, reads: list[dict]) -> None:
        if not reads:
            return
        rows = pa.Table.from_pylist([{**r, "run_id": run_id} for r in reads])
        with self.db.write() as con:
            con.register("reads_in", rows)
            con.execute(
                "INSERT INTO source_reads SELECT run_id, source, location, records, unreadable, "
                "complete, stop_reason, notes FROM reads_in"
            )

    def write_batch(self, run_id: str, records: list[dict], prompts: list[dict], minhash: MinhashBatch | None) -> None:
        """Outcomes, kept prompts and their near-dedupe index, all in one transaction.

        Idempotent: a record or prompt already stored is left as it is, so replaying a batch after
        a crash adds nothing twice.
        """
        with self.db.write() as con:
            n_records, inserted = self.insert_batch(con, run_id, utc_now(), records, prompts, minhash)
        self.exact_index.batch_written(sorted(inserted), records, n_records)

    def insert_batch(self, con: duckdb.DuckDBPyConnection, run_id: str, now: datetime, records: list[dict],
                     prompts: list[dict], minhash: MinhashBatch | None) -> tuple[int, set[str]]:
        """A batch's rows inside the caller's transaction; returns how many outcome rows and which
        prompts it inserted. (Regenerate's imports call it to commit records with their generations.)"""
        n_records = 0
        if records:
            # Built column by column: a dict per row through from_pylist was a third of the write at 10M records.
            columns = {k: [r[k] for r in records] for k in records[0]}
            columns["similarity"] = pa.array(columns["similarity"], type=pa.float32())
            con.register("rec_in", pa.table({**columns, "run_id": pa.repeat(run_id, len(records)),
                                             "recorded_at": pa.repeat(pa.scalar(now, pa.timestamp("us", tz="UTC")),
                                                                      len(records))}))
            (n_records,), = con.execute(
                "INSERT INTO records SELECT source, record_key, native_id, outcome, reason, prompt_id, "
                "duplicate_of, eval_item, similarity, run_id, recorded_at FROM rec_in ON CONFLICT DO NOTHING"
            ).fetchall()
        inserted: set[str] = set()
        if prompts:
            # `prompts` has no key (migration 15): ids stay unique because writers hold the exclusive
            # lock, repeats within the batch are dropped here and stored ids by the anti-join.
            first = {p["prompt_id"]: k for k, p in reversed(list(enumerate(prompts)))}
            if len(first) < len(prompts):
                prompts = [p for k, p in enumerate(prompts) if first[p["prompt_id"]] == k]
            columns = {k: [p[k] for p in prompts] for k in PROMPT_ROWS.names if k not in ("run_id", "created_at")}
            table = pa.Table.from_pydict({**columns, "run_id": [run_id] * len(prompts), "created_at": [now] * len(prompts)},
                                         schema=PROMPT_ROWS)
            con.register("prm_in", table)
            inserted = {r[0] for r in con.execute(
                "INSERT INTO prompts SELECT n.prompt_id, n.messages, n.n_turns, n.chars, n.source, n.record_key, "
                "n.format, n.run_id, n.created_at FROM prm_in n "
                "WHERE NOT EXISTS (SELECT 1 FROM prompts p WHERE p.prompt_id = n.prompt_id) RETURNING prompt_id"
            ).fetchall()}
        if minhash is not None:
            # Only prompts this transaction stored are indexed: a prompt another process stored
            # meanwhile is indexed by that process, so none is indexed twice.
            params, ids, sig, keys = minhash
            keep = [k for k, p in enumerate(ids) if p in inserted]
            self.near_index.insert_segment(con, params, [ids[k] for k in keep], sig[keep], keys[keep])
        return n_records, inserted

    # ------------------------------------------------------------ reads

    def seen_record_keys(self, source: str) -> set[str]:
        if not self.db.path.exists():
            return set()
        with self.db.read() as con:
            return {k for (k,) in con.execute("SELECT record_key FROM records WHERE source = ?", [source]).fetchall()}

    def prompt_messages(self, prompt_ids: list[str]) -> list[tuple[str, list[dict]]]:
        """(prompt id, messages) of these stored prompts, in the order given."""
        if not self.db.path.exists() or not prompt_ids:
            return []
        with self.db.read() as con:
            con.register("ids_in", pa.table({"prompt_id": prompt_ids, "pos": list(range(len(prompt_ids)))}))
            return con.execute("SELECT p.prompt_id, p.messages FROM prompts p JOIN ids_in USING (prompt_id) "
                               "ORDER BY ids_in.pos").fetchall()

    def outcome_counts(self, run_id: str | None = None) -> dict[str, int]:
        """Records per outcome (every outcome present, 0 when none), of one run or of all."""
        counts = {o: 0 for o in OUTCOMES}
        if not self.db.path.exists():
            return counts
        with self.db.read() as con:
            sql = "SELECT outcome, count(*) FROM records"
            rows = con.execute(sql + (" WHERE run_id = ? GROUP BY 1" if run_id else " GROUP BY 1"),
                               [run_id] if run_id else []).fetchall()
        counts.update(dict(rows))
        return counts

    def quarantine_reasons(self, run_id: str, limit: int = 10) -> list[tuple[str, int]]:
        """A run's commonest quarantine reasons, numbers folded to N so alike reasons count together."""
        with self.db.read() as con:
            return con.execute(
                "SELECT regexp_replace(reason, '[0-9]+', 'N', 'g') AS why, count(*) FROM records "
                "WHERE run_id = ? AND outcome = 'quarantined' GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT ?",
                [run_id, limit],
            ).fetchall()

    def export_prompts(self, target: Path) -> int:
        """Write every kept prompt to one Parquet file, atomically."""
        with self.db.read() as con:
            table = con.sql(
                "SELECT prompt_id, messages, source, record_key, format, n_turns, chars, run_id "
                "FROM prompts ORDER BY created_at, prompt_id"
            ).to_arrow_table()
        write_parquet_atomic(table, target)
        return table.num_rows

    # ------------------------------------------------------------ the held-out set

    def heldout_count(self) -> int:
        """Held-out prompts in the workspace (what `discover.heldout.cap` limits)."""
        if not self.db.path.exists():
            return 0
        with self.db.read() as con:
            return con.execute("SELECT count(*) FROM records WHERE outcome = 'heldout'").fetchone()[0]

    def heldout_prompts(self) -> list[tuple[str, list[dict]]]:
        """(prompt id, messages) of every held-out prompt, in the order they were held out (a growing
        set keeps its first prompts first, so a benchmark's first N stay the same prompts)."""
        if not self.db.path.exists():
            return []
        with self.db.read() as con:
            return con.execute(
                "SELECT p.prompt_id, p.messages FROM records r JOIN prompts p USING (prompt_id) "
                "WHERE r.outcome = 'heldout' ORDER BY r.recorded_at, p.prompt_id").fetchall()

    def heldout_among(self, prompt_ids: list[str]) -> set[str]:
        """Which of these prompt ids are held out."""
        if not self.db.path.exists() or not prompt_ids:
            return set()
        with self.db.read() as con:
            con.register("ids_in", pa.table({"prompt_id": prompt_ids}))
            return {r[0] for r in con.execute(
                "SELECT DISTINCT r.prompt_id FROM records r JOIN ids_in USING (prompt_id) "
                "WHERE r.outcome = 'heldout'").fetchall()}
