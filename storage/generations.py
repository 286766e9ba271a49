"""Regenerate's rows: which prompts still need an answer, and the generations, files, failures
and deferrals it recorded.

Owns the tables `generations`, `generation_files`, `generation_failures` and
`generation_deferrals`. Depends on `storage.discover.DiscoverRecords` for imports, whose records
commit with the generations made from them. Promises:
- A Parquet file's lineage, its generations and its batch's failures are one transaction.
- Pending means: no generation under these parameters, not held out, and (unless retrying) no
  recorded failure; deferrals (no endpoint answered) leave a prompt pending.
- A store that does not exist yet has no prompt pending and no generation.
"""

from __future__ import annotations

import pyarrow as pa

from storage.connection import DuckDBFile, utc_now
from storage.discover import DiscoverRecords, MinhashBatch
from storage.schema import GENERATION_ROWS


def _pending(params_key: str, retry_failed: bool) -> tuple[str, list]:
    """The condition on prompts `p` that regenerate has still to answer under `params_key`, its parameters."""
    skip_failed = "" if retry_failed else (
        "AND NOT EXISTS (SELECT 1 FROM generation_failures f WHERE f.prompt_id = p.prompt_id AND f.params_key = ?)"
    )
    return ("NOT EXISTS (SELECT 1 FROM generations g WHERE g.prompt_id = p.prompt_id AND g.params_key = ?) "
            "AND NOT EXISTS (SELECT 1 FROM records r WHERE r.prompt_id = p.prompt_id AND r.outcome = 'heldout') "
            f"{skip_failed}"), [params_key] + ([] if retry_failed else [params_key])


class Generations:
    """Regenerate's queue and its results."""

    def __init__(self, db: DuckDBFile, discover: DiscoverRecords):
        self.db, self.discover = db, discover

    # ------------------------------------------------------------ the queue

    def pending_prompts(self, params_key: str, retry_failed: bool, limit: int | None) -> list[tuple[str, list[dict]]]:
        """Prompts with no generation under `params_key` (and, unless retrying, no recorded failure); never
        held-out ones; in queue order (created_at, prompt_id)."""
        if not self.db.path.exists():
            return []
        where, params = _pending(params_key, retry_failed)
        sql = f"SELECT p.prompt_id, p.messages FROM prompts p WHERE {where} ORDER BY p.created_at, p.prompt_id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self.db.read() as con:
            return [(pid, msgs) for pid, msgs in con.execute(sql, params).fetchall()]

    def pending_queue(self, params_key: str, retry_failed: bool, tagger: str) -> list[tuple[str, str | None]]:
        """(prompt id, cluster by `tagger` or None) of every prompt `pending_prompts` would give, in its order."""
        if not self.db.path.exists():
            return []
        where, params = _pending(params_key, retry_failed)
        with self.db.read() as con:
            return con.execute(
                "SELECT p.prompt_id, t.cluster FROM prompts p LEFT JOIN prompt_tags t "
                f"ON t.prompt_id = p.prompt_id AND t.tagger = ? WHERE {where} ORDER BY p.created_at, p.prompt_id",
                [tagger] + params).fetchall()

    def existing_ids(self, ids: list[str]) -> set[str]:
        """Which of these generation ids are stored."""
        return self.db.stored_ids("generations", "generation_id", ids)

    def files(self, params_key: str) -> set[str]:
        """The registered generation files of these parameters (relative to the generations folder)."""
        if not self.db.path.exists():
            return set()
        with self.db.read() as con:
            rows = con.execute("SELECT file FROM generation_files WHERE params_key = ?", [params_key]).fetchall()
        return {r[0] for r in rows}

    def to_tokenise(self, params_keys: list[str] | None) -> list[tuple[str, str, str]]:
        """(generation_id, params_key, file) of every generation, oldest first (optionally only some params)."""
        if not self.db.path.exists():
            return []
        where, args = ("WHERE params_key IN (SELECT unnest(?))", [params_keys]) if params_keys is not None else ("", [])
        with self.db.read() as con:
            return con.execute(
                f"SELECT generation_id, params_key, file FROM generations {where} ORDER BY created_at, generation_id", args
            ).fetchall()

    # ------------------------------------------------------------ writes

    def write(self, run_id: str, file_row: dict | None, generations: list[dict], failures: list[dict],
              discover_batch: tuple[list[dict], list[dict], MinhashBatch | None] | None = None,
              deferrals: list[dict] = ()) -> None:
        """A Parquet file's lineage, its generations and this batch's failures, in one transaction.

        `discover_batch` (records, prompts, minhash) commits imported records with the generations
        made from them: both or neither, so an import interrupted by a crash is simply redone.
        `deferrals` (same fields as failures) are requests no endpoint answered: recorded for the
        audit, but the prompt stays pending, so the next run asks again without --retry-failed.
        """
        now = utc_now()
        with self.db.write() as con:
            if discover_batch is not None:
                self.discover.insert_batch(con, run_id, now, *discover_batch)
            if file_row is not None:
                con.execute(
                    "INSERT INTO generation_files VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [file_row["file"], file_row["params_key"], file_row["rows"], file_row["bytes"],
                     file_row["sha256"], run_id, now],
                )
            if generations:
                con.register("gen_in", pa.Table.from_pylist(
                    [{**g, "run_id": run_id, "created_at": now} for g in generations], schema=GENERATION_ROWS))
                con.execute("INSERT INTO generations BY NAME SELECT * FROM gen_in ON CONFLICT DO NOTHING")
            if failures:
                con.register("fail_in", pa.Table.from_pylist([{**f, "run_id": run_id, "failed_at": now} for f in failures]))
                con.execute(
                    "INSERT INTO generation_failures SELECT generation_id, prompt_id, params_key, reason, attempts, "
                    "run_id, failed_at FROM fail_in"
                )
            if deferrals:
                con.register("defer_in", pa.Table.from_pylist([{**f, "run_id": run_id, "deferred_at": now} for f in deferrals]))
                con.execute(
                    "INSERT INTO generation_deferrals SELECT generation_id, prompt_id, params_key, reason, attempts, "
                    "run_id, deferred_at FROM defer_in"
                )

    def summary(self, run_id: str) -> dict:
        """What one regenerate run stored: generations, tokens, flags, and prompts failed or deferred."""
        with self.db.read() as con:
            row = con.execute(
                "SELECT count(*), coalesce(sum(completion_tokens), 0), "
                "count(*) FILTER (WHERE list_contains(flags, 'empty')), "
                "count(*) FILTER (WHERE list_contains(flags, 'length')), "
                "count(*) FILTER (WHERE has_token_ids) FROM generations WHERE run_id = ?",
                [run_id],
            ).fetchall()[0]
            failed, deferred = con.execute(
                "SELECT (SELECT count(DISTINCT prompt_id) FROM generation_failures f WHERE run_id = $run "
                "        AND NOT EXISTS (SELECT 1 FROM generations g WHERE g.generation_id = f.generation_id)), "
                "       (SELECT count(DISTINCT prompt_id) FROM generation_deferrals d WHERE run_id = $run "
                "        AND NOT EXISTS (SELECT 1 FROM generations g WHERE g.generation_id = d.generation_id))",
                {"run": run_id},
            ).fetchall()[0]
        keys = ("generations", "completion_tokens", "flagged_empty", "flagged_length", "with_token_ids")
        return {**dict(zip(keys, row)), "failed": failed, "deferred": deferred}
