"""Extract's rows: draft vocabularies, extraction settings, samples, and each shard's life
(written -> consumed -> deleted).

Owns the tables `draft_vocabs`, `extract_settings`, `samples`, `shards` and `shard_reads` (the
shard files themselves are `storage.shards`'). Promises:
- A shard's row and the outcome of every sample of its batch are one transaction, committed only
  after the file is complete on disk: if the commit never happens, the next run deletes the file
  as unregistered and the samples are pending again (nothing lost, nothing twice).
- A shard is deleted only after a training run consumed it.
- A store that does not exist yet has no vocab, settings or shard.
"""

from __future__ import annotations

import json

import pyarrow as pa

from storage.connection import DuckDBFile, dict_row, dict_rows, utc_now
from storage.errors import LineageError
from storage.schema import SAMPLE_ROWS


class Extractions:
    """Extraction's settings and vocab, its samples, and the shard rows training reads."""

    def __init__(self, db: DuckDBFile):
        self.db = db

    # ------------------------------------------------------------ vocab and settings

    def draft_vocab(self, tokenize_key: str, draft_vocab_size: int, vocab_id: str | None = None) -> dict | None:
        """The vocab registered for this tokenisation and size, if any: the first one (it is kept), or the one
        with `vocab_id`."""
        if not self.db.path.exists():
            return None
        with self.db.read() as con:
            return dict_row(con.execute(
                "SELECT * FROM draft_vocabs WHERE tokenize_key = ? AND draft_vocab_size = ? "
                "AND (CAST(? AS VARCHAR) IS NULL OR vocab_id = ?) ORDER BY created_at LIMIT 1",
                [tokenize_key, draft_vocab_size, vocab_id, vocab_id]))

    def register_draft_vocab(self, run_id: str, row: dict) -> None:
        with self.db.write() as con:
            con.execute(
                "INSERT INTO draft_vocabs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [row["vocab_id"], row["tokenize_key"], row["file"], row["sha256"], row["draft_vocab_size"],
                 row["target_vocab_size"], row["coverage"], row["counted_tokens"], row["counted_samples"],
                 json.dumps(row.get("report"), default=str), run_id, utc_now()],
            )

    def register_settings(self, run_id: str, extract_key: str, vocab_id: str, settings: dict) -> None:
        with self.db.write() as con:
            con.execute("INSERT INTO extract_settings VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [extract_key, vocab_id, json.dumps(settings, sort_keys=True), run_id, utc_now()])

    def settings(self, extract_key: str | None) -> dict | None:
        """One extraction's settings (default: the latest registered), with its vocab file."""
        if not self.db.path.exists():
            return None
        where, args = ("WHERE e.extract_key = ?", [extract_key]) if extract_key else ("", [])
        with self.db.read() as con:
            out = dict_row(con.execute(
                "SELECT e.extract_key, e.vocab_id, e.settings, v.file AS vocab_file, v.sha256 AS vocab_sha256 "
                f"FROM extract_settings e JOIN draft_vocabs v USING (vocab_id) {where} "
                "ORDER BY e.created_at DESC LIMIT 1", args))
        if out is None:
            return None
        out["settings"] = json.loads(out["settings"])
        return out

    # ------------------------------------------------------------ samples

    def pending_generations(self, extract_key: str, params_keys: list[str] | None,
                            limit: int | None) -> list[tuple[str, str, str]]:
        """Generations with no sample under `extract_key`, in the order rounds take them."""
        where = "AND g.params_key IN (SELECT unnest(?))" if params_keys is not None else ""
        args: list = [extract_key] + ([params_keys] if params_keys is not None else [])
        sql = (
            "SELECT g.generation_id, g.params_key, g.file FROM generations g "
            "WHERE NOT EXISTS (SELECT 1 FROM samples s WHERE s.generation_id = g.generation_id AND s.extract_key = ?) "
            f"{where} ORDER BY g.created_at, g.generation_id"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self.db.read() as con:
            return con.execute(sql, args).fetchall()

    def write_batch(self, run_id: str, shard_row: dict | None, sample_rows: list[dict]) -> None:
        """A shard's lineage and the outcome of every sample of its batch, in one transaction.

        The shard file is already complete on disk; if this commit never happens the next run
        deletes the file as unregistered and the samples are pending again: nothing lost, nothing twice.
        """
        now = utc_now()
        with self.db.write() as con:
            if shard_row is not None:
                con.execute(
                    "INSERT INTO shards (shard, extract_key, state, bytes, sha256, samples, tokens, masked_tokens, "
                    "run_id, created_at) VALUES (?, ?, 'written', ?, ?, ?, ?, ?, ?, ?)",
                    [shard_row["shard"], shard_row["extract_key"], shard_row["bytes"], shard_row["sha256"],
                     shard_row["samples"], shard_row["tokens"], shard_row["masked_tokens"], run_id, now],
                )
            if sample_rows:
                con.register("smp_in", pa.Table.from_pylist(
                    [{**r, "run_id": run_id, "created_at": now} for r in sample_rows], schema=SAMPLE_ROWS))
                con.execute("INSERT INTO samples SELECT * FROM smp_in")

    def summary(self, run_id: str) -> dict:
        """What one extract run did: samples per outcome, tokens, the token-id check, the commonest reasons."""
        with self.db.read() as con:
            rows = con.execute(
                "SELECT outcome, count(*), coalesce(sum(tokens), 0), coalesce(sum(masked_tokens), 0), "
                "coalesce(sum(truncated_tokens), 0) FROM samples WHERE run_id = ? GROUP BY 1", [run_id]).fetchall()
            checks = dict(con.execute(
                "SELECT id_check, count(*) FROM samples WHERE run_id = ? GROUP BY 1", [run_id]).fetchall())
            first = con.execute(
                "SELECT generation_id, id_mismatch FROM samples WHERE run_id = ? AND id_check = 'mismatch' "
                "ORDER BY created_at, sample_id LIMIT 1", [run_id]).fetchall()
            reasons = con.execute(
                "SELECT regexp_replace(reason, '[0-9]+', 'N', 'g'), count(*) FROM samples "
                "WHERE run_id = ? AND outcome <> 'extracted' GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 10", [run_id]).fetchall()
        by = {o: (n, t, m, c) for o, n, t, m, c in rows}
        ext = by.get("extracted", (0, 0, 0, 0))
        return {
            "extracted": ext[0], "tokens": ext[1], "masked_tokens": ext[2],
            "truncated_tokens": sum(v[3] for v in by.values()),
            "skipped": by.get("skipped", (0,))[0], "quarantined": by.get("quarantined", (0,))[0],
            "ids_checked": checks.get("match", 0) + checks.get("mismatch", 0), "ids_mismatched": checks.get("mismatch", 0),
            "first_mismatch": {"generation_id": first[0][0], **json.loads(first[0][1])} if first else None,
            "reasons": reasons,
        }

    # ------------------------------------------------------------ shards: written -> consumed -> deleted

    def live_shards(self) -> dict[str, dict]:
        """Shards registered and not deleted, by name: what may exist in the shard folder."""
        if not self.db.path.exists():
            return {}
        with self.db.read() as con:
            rows = dict_rows(con.execute("SELECT * FROM shards WHERE state <> 'deleted' ORDER BY created_at, shard"))
        return {r["shard"]: r for r in rows}

    def last_shard_seq(self) -> int:
        """The highest sequence number among registered shards (`<key>-<seq>.safetensors`). Not their
        count: a shard whose samples were all quarantined takes a number but leaves no row."""
        if not self.db.path.exists():
            return 0
        with self.db.read() as con:
            return con.execute("SELECT coalesce(max(CAST(regexp_extract(shard, '-([0-9]+)[.]safetensors$', 1) AS BIGINT)), 0) "
                               "FROM shards").fetchall()[0][0]

    def round_shards(self, extract_key: str, consumer: str, exclude: list[str], kept: bool = False) -> list[dict]:
        """Shards a training round takes: written ones, plus ones this consumer read but did not finish;
        `kept`: also those another run consumed and kept (every shard still on disk)."""
        with self.db.read() as con:
            return dict_rows(con.execute(
                "SELECT shard, sha256, samples, tokens FROM shards WHERE extract_key = ? "
                "AND (state = 'written' OR (state = 'consumed' AND (consumed_by = ? OR ?))) "
                "AND shard NOT IN (SELECT unnest(?::VARCHAR[])) ORDER BY created_at, shard",
                [extract_key, consumer, kept, exclude]))

    def shard_samples(self, shards: list[str]) -> list[tuple[str, int, int]]:
        """(shard, slot, tokens) of every extracted sample in these shards."""
        with self.db.read() as con:
            return con.execute(
                "SELECT shard, shard_index, tokens FROM samples WHERE outcome = 'extracted' "
                "AND shard IN (SELECT unnest(?::VARCHAR[])) ORDER BY shard, shard_index", [shards]).fetchall()

    def mark_shards_read(self, train_run_id: str, shards: list[str], epoch: int) -> None:
        """Training read these shards: the first read moves a shard written -> consumed by that run."""
        if not shards:
            return
        now = utc_now()
        with self.db.write() as con:
            con.register("rd_in", pa.table({"shard": shards}))
            con.execute("INSERT INTO shard_reads SELECT shard, ?, ?, ? FROM rd_in", [train_run_id, epoch, now])
            con.execute(
                "UPDATE shards SET state = 'consumed', consumed_by = ?, consumed_at = ? "
                "WHERE state = 'written' AND shard IN (SELECT shard FROM rd_in)", [train_run_id, now])

    def mark_shard_deleted(self, shard: str) -> None:
        """The shard's file is gone; refused for a shard no training run consumed."""
        with self.db.write() as con:
            state = con.execute("SELECT state FROM shards WHERE shard = ?", [shard]).fetchall()
            if not state:
                raise LineageError(f"no shard {shard!r} in the lineage store")
            if state[0][0] == "written":
                raise LineageError(f"shard {shard!r} was never consumed by a training run; refusing to delete it")
            con.execute("UPDATE shards SET state = 'deleted', deleted_at = coalesce(deleted_at, ?) WHERE shard = ?",
                        [utc_now(), shard])
