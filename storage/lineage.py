"""The DuckDB lineage and progress store: the only module that speaks SQL.

Owns every write and stage read of the lineage file, by stage (runs, discover, regenerate,
extract, train, benchmark); the file's locks and migrations are `storage.connection`'s, the
reports `storage.reports`' and `storage.evaluation`'s, the schema `storage.schema`'s. Promises:
- No process keeps the file open for a whole stage: each call is one short transaction (a
  write) or one read-only open, so flows in separate Prefect processes and `eagle3 sql` interleave.
- A write is one transaction: after a crash, `kill -9` included, it is there whole or not at all.
- Resume and dedupe are by content-addressed ids, never by counting rows.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

from storage.connection import StoreLocking, _now
from storage.errors import LineageError
from storage.evaluation import EvaluationReads
from storage.exact_index import ExactIndexStore
from storage.minhash_index import NearIndexStore
from storage.reports import LineageReports
from storage.selection import SelectionStore
from storage.schema import BENCH_ROWS, GENERATION_ROWS, METRIC_ROWS, PROMPT_ROWS, SAMPLE_ROWS

__all__ = ["LineageError", "LineageStore", "StoreLocking"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LineageStore(NearIndexStore, ExactIndexStore, LineageReports, EvaluationReads, SelectionStore):
    """Every write and stage read of the lineage file (reports: `storage.reports`, `storage.evaluation`)."""

    # ------------------------------------------------------------ runs

    def begin_run(self, flow: str, parameters: dict, config_hash: str, flow_run_id: str | None, git_sha: str | None) -> str:
        """A new run row; runs left RUNNING by a dead process on this host become CRASHED."""
        run_id = uuid.uuid4().hex
        host = socket.gethostname()
        with self.write() as con:
            for other, pid in con.execute(
                "SELECT run_id, pid FROM runs WHERE state = 'RUNNING' AND host = ?", [host]
            ).fetchall():
                if pid is not None and not _alive(pid):
                    con.execute("UPDATE runs SET state = 'CRASHED', ended_at = ? WHERE run_id = ?", [_now(), other])
            con.execute(
                "INSERT INTO runs (run_id, flow, flow_run_id, git_sha, config_hash, parameters, state, started_at, host, pid) "
                "VALUES (?, ?, ?, ?, ?, ?, 'RUNNING', ?, ?, ?)",
                [run_id, flow, flow_run_id, git_sha, config_hash, json.dumps(parameters, default=str), _now(), host, os.getpid()],
            )
        return run_id

    def finish_run(self, run_id: str, state: str, summary: dict | None = None) -> None:
        with self.write() as con:
            con.execute(
                "UPDATE runs SET state = ?, ended_at = ?, summary = ? WHERE run_id = ?",
                [state, _now(), json.dumps(summary or {}, default=str), run_id],
            )

    def record_source_reads(self, run_id: str, reads: list[dict]) -> None:
        if not reads:
            return
        rows = pa.Table.from_pylist([{**r, "run_id": run_id} for r in reads])
        with self.write() as con:
            con.register("reads_in", rows)
            con.execute(
                "INSERT INTO source_reads SELECT run_id, source, location, records, unreadable, "
                "complete, stop_reason, notes FROM reads_in"
            )

    # ------------------------------------------------------------ discover: lookups

    def seen_record_keys(self, source: str) -> set[str]:
        if not self.path.exists():
            return set()
        with self.read() as con:
            return {k for (k,) in con.execute("SELECT record_key FROM records WHERE source = ?", [source]).fetchall()}

    # ------------------------------------------------------------ discover: writes

    def write_discover_batch(
        self,
        run_id: str,
        records: list[dict],
        prompts: list[dict],
        minhash: tuple[str, list[str], np.ndarray, np.ndarray] | None,
    ) -> None:
        """Outcomes, kept prompts and their near-dedupe index, all in one transaction.

        Idempotent: a record or prompt already stored is left as it is, so replaying a batch after
        a crash adds nothing twice.
        """
        with self.write() as con:
            n_records, inserted = self._insert_discover(con, run_id, _now(), records, prompts, minhash)
        self.discover_batch_written(sorted(inserted), records, n_records)

    def _insert_discover(self, con, run_id: str, now: datetime, records: list[dict], prompts: list[dict],
                         minhash: tuple[str, list[str], np.ndarray, np.ndarray] | None) -> tuple[int, set[str]]:
        """Returns how many outcome rows and which prompts this transaction inserted."""
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
            self._insert_minhash(con, params, [ids[k] for k in keep], sig[keep], keys[keep])
        return n_records, inserted

    # ------------------------------------------------------------ regenerate

    @staticmethod
    def _pending(params_key: str, retry_failed: bool) -> tuple[str, list]:
        """The condition on prompts `p` that regenerate has still to answer under `params_key`, its parameters."""
        skip_failed = "" if retry_failed else (
            "AND NOT EXISTS (SELECT 1 FROM generation_failures f WHERE f.prompt_id = p.prompt_id AND f.params_key = ?)"
        )
        return ("NOT EXISTS (SELECT 1 FROM generations g WHERE g.prompt_id = p.prompt_id AND g.params_key = ?) "
                "AND NOT EXISTS (SELECT 1 FROM records r WHERE r.prompt_id = p.prompt_id AND r.outcome = 'heldout') "
                f"{skip_failed}"), [params_key] + ([] if retry_failed else [params_key])

    def pending_prompts(self, params_key: str, retry_failed: bool, limit: int | None) -> list[tuple[str, list[dict]]]:
        """Prompts with no generation under `params_key` (and, unless retrying, no recorded failure); never
        held-out ones; in queue order (created_at, prompt_id)."""
        if not self.path.exists():
            return []
        where, params = self._pending(params_key, retry_failed)
        sql = f"SELECT p.prompt_id, p.messages FROM prompts p WHERE {where} ORDER BY p.created_at, p.prompt_id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self.read() as con:
            return [(pid, msgs) for pid, msgs in con.execute(sql, params).fetchall()]

    def pending_queue(self, params_key: str, retry_failed: bool, tagger: str) -> list[tuple[str, str | None]]:
        """(prompt id, cluster by `tagger` or None) of every prompt `pending_prompts` would give, in its order."""
        if not self.path.exists():
            return []
        where, params = self._pending(params_key, retry_failed)
        with self.read() as con:
            return con.execute(
                "SELECT p.prompt_id, t.cluster FROM prompts p LEFT JOIN prompt_tags t "
                f"ON t.prompt_id = p.prompt_id AND t.tagger = ? WHERE {where} ORDER BY p.created_at, p.prompt_id",
                [tagger] + params).fetchall()

    def prompt_messages(self, prompt_ids: list[str]) -> list[tuple[str, list[dict]]]:
        """(prompt id, messages) of these stored prompts, in the order given."""
        if not self.path.exists() or not prompt_ids:
            return []
        with self.read() as con:
            con.register("ids_in", pa.table({"prompt_id": prompt_ids, "pos": list(range(len(prompt_ids)))}))
            return con.execute("SELECT p.prompt_id, p.messages FROM prompts p JOIN ids_in USING (prompt_id) "
                               "ORDER BY ids_in.pos").fetchall()

    def existing_generation_ids(self, ids: list[str]) -> set[str]:
        if not self.path.exists() or not ids:
            return set()
        with self.read() as con:
            con.register("ids_in", pa.table({"generation_id": ids}))
            rows = con.execute("SELECT g.generation_id FROM generations g JOIN ids_in USING (generation_id)").fetchall()
        return {r[0] for r in rows}

    def generation_files(self, params_key: str) -> set[str]:
        if not self.path.exists():
            return set()
        with self.read() as con:
            rows = con.execute("SELECT file FROM generation_files WHERE params_key = ?", [params_key]).fetchall()
        return {r[0] for r in rows}

    def write_generations(self, run_id: str, file_row: dict | None, generations: list[dict], failures: list[dict],
                          discover_batch: tuple[list[dict], list[dict], tuple | None] | None = None,
                          deferrals: list[dict] = ()) -> None:
        """A Parquet file's lineage, its generations and this batch's failures, in one transaction.

        `discover_batch` (records, prompts, minhash) commits imported records with the generations
        made from them: both or neither, so an import interrupted by a crash is simply redone.
        `deferrals` (same fields as failures) are requests no endpoint answered: recorded for the
        audit, but the prompt stays pending, so the next run asks again without --retry-failed.
        """
        now = _now()
        with self.write() as con:
            if discover_batch is not None:
                self._insert_discover(con, run_id, now, *discover_batch)
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

    def generation_summary(self, run_id: str) -> dict:
        with self.read() as con:
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

    # ------------------------------------------------------------ extract

    def generations_to_tokenise(self, params_keys: list[str] | None) -> list[tuple[str, str, str]]:
        """(generation_id, params_key, file) of every generation, oldest first (optionally only some params)."""
        if not self.path.exists():
            return []
        where, args = ("WHERE params_key IN (SELECT unnest(?))", [params_keys]) if params_keys is not None else ("", [])
        with self.read() as con:
            return con.execute(
                f"SELECT generation_id, params_key, file FROM generations {where} ORDER BY created_at, generation_id", args
            ).fetchall()

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
        with self.read() as con:
            return con.execute(sql, args).fetchall()

    def draft_vocab(self, tokenize_key: str, draft_vocab_size: int, vocab_id: str | None = None) -> dict | None:
        """The vocab registered for this tokenisation and size, if any: the first one (it is kept), or the one
        with `vocab_id`."""
        if not self.path.exists():
            return None
        with self.read() as con:
            res = con.execute(
                "SELECT * FROM draft_vocabs WHERE tokenize_key = ? AND draft_vocab_size = ? "
                "AND (CAST(? AS VARCHAR) IS NULL OR vocab_id = ?) ORDER BY created_at LIMIT 1",
                [tokenize_key, draft_vocab_size, vocab_id, vocab_id])
            cols = [d[0] for d in res.description]
            row = res.fetchone()
        return dict(zip(cols, row)) if row else None

    def register_draft_vocab(self, run_id: str, row: dict) -> None:
        with self.write() as con:
            con.execute(
                "INSERT INTO draft_vocabs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [row["vocab_id"], row["tokenize_key"], row["file"], row["sha256"], row["draft_vocab_size"],
                 row["target_vocab_size"], row["coverage"], row["counted_tokens"], row["counted_samples"],
                 json.dumps(row.get("report"), default=str), run_id, _now()],
            )

    def register_extract_settings(self, run_id: str, extract_key: str, vocab_id: str, settings: dict) -> None:
        with self.write() as con:
            con.execute("INSERT INTO extract_settings VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [extract_key, vocab_id, json.dumps(settings, sort_keys=True), run_id, _now()])

    def live_shards(self) -> dict[str, dict]:
        """Shards registered and not deleted, by name: what may exist in the shard folder."""
        if not self.path.exists():
            return {}
        with self.read() as con:
            res = con.execute("SELECT * FROM shards WHERE state <> 'deleted' ORDER BY created_at, shard")
            cols = [d[0] for d in res.description]
            return {r[0]: dict(zip(cols, r)) for r in res.fetchall()}

    def last_shard_seq(self) -> int:
        """The highest sequence number among registered shards (`<key>-<seq>.safetensors`). Not their
        count: a shard whose samples were all quarantined takes a number but leaves no row."""
        if not self.path.exists():
            return 0
        with self.read() as con:
            return con.execute("SELECT coalesce(max(CAST(regexp_extract(shard, '-([0-9]+)[.]safetensors$', 1) AS BIGINT)), 0) "
                               "FROM shards").fetchall()[0][0]

    def write_extract_batch(self, run_id: str, shard_row: dict | None, sample_rows: list[dict]) -> None:
        """A shard's lineage and the outcome of every sample of its batch, in one transaction.

        The shard file is already complete on disk; if this commit never happens the next run
        deletes the file as unregistered and the samples are pending again: nothing lost, nothing twice.
        """
        now = _now()
        with self.write() as con:
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

    def mark_shards_read(self, train_run_id: str, shards: list[str], epoch: int) -> None:
        """Training read these shards: the first read moves a shard written -> consumed by that run."""
        if not shards:
            return
        now = _now()
        with self.write() as con:
            con.register("rd_in", pa.table({"shard": shards}))
            con.execute("INSERT INTO shard_reads SELECT shard, ?, ?, ? FROM rd_in", [train_run_id, epoch, now])
            con.execute(
                "UPDATE shards SET state = 'consumed', consumed_by = ?, consumed_at = ? "
                "WHERE state = 'written' AND shard IN (SELECT shard FROM rd_in)", [train_run_id, now])

    def mark_shard_deleted(self, shard: str) -> None:
        with self.write() as con:
            state = con.execute("SELECT state FROM shards WHERE shard = ?", [shard]).fetchall()
            if not state:
                raise LineageError(f"no shard {shard!r} in the lineage store")
            if state[0][0] == "written":
                raise LineageError(f"shard {shard!r} was never consumed by a training run; refusing to delete it")
            con.execute("UPDATE shards SET state = 'deleted', deleted_at = coalesce(deleted_at, ?) WHERE shard = ?",
                        [_now(), shard])

    def extract_summary(self, run_id: str) -> dict:
        with self.read() as con:
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

    # ------------------------------------------------------------ train

    def extract_settings(self, extract_key: str | None) -> dict | None:
        """One extraction's settings (default: the latest registered), with its vocab file."""
        if not self.path.exists():
            return None
        where, args = ("WHERE e.extract_key = ?", [extract_key]) if extract_key else ("", [])
        with self.read() as con:
            res = con.execute(
                "SELECT e.extract_key, e.vocab_id, e.settings, v.file AS vocab_file, v.sha256 AS vocab_sha256 "
                f"FROM extract_settings e JOIN draft_vocabs v USING (vocab_id) {where} "
                "ORDER BY e.created_at DESC LIMIT 1", args)
            cols = [d[0] for d in res.description]
            row = res.fetchone()
        if row is None:
            return None
        out = dict(zip(cols, row))
        out["settings"] = json.loads(out["settings"])
        return out

    def round_shards(self, extract_key: str, consumer: str, exclude: list[str]) -> list[dict]:
        """Shards a training round takes: written ones, plus ones this consumer read but did not finish."""
        with self.read() as con:
            res = con.execute(
                "SELECT shard, sha256, samples, tokens FROM shards WHERE extract_key = ? "
                "AND (state = 'written' OR (state = 'consumed' AND consumed_by = ?)) "
                "AND shard NOT IN (SELECT unnest(?::VARCHAR[])) ORDER BY created_at, shard",
                [extract_key, consumer, exclude])
            cols = [d[0] for d in res.description]
            return [dict(zip(cols, r)) for r in res.fetchall()]

    def shard_samples(self, shards: list[str]) -> list[tuple[str, int, int]]:
        """(shard, slot, tokens) of every extracted sample in these shards."""
        with self.read() as con:
            return con.execute(
                "SELECT shard, shard_index, tokens FROM samples WHERE outcome = 'extracted' "
                "AND shard IN (SELECT unnest(?::VARCHAR[])) ORDER BY shard, shard_index", [shards]).fetchall()

    def register_train_run(self, run_id: str, row: dict) -> dict:
        """The training run's identity; an existing one with the same name is returned as stored."""
        with self.write() as con:
            con.execute(
                "INSERT INTO train_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [row["run_name"], row["mode"], row["extract_key"], row["vocab_id"], row["target"], row["target_revision"],
                 json.dumps(row["draft_config"], sort_keys=True), json.dumps(row["train_config"], sort_keys=True),
                 run_id, _now()])
            res = con.execute("SELECT * FROM train_runs WHERE run_name = ?", [row["run_name"]])
            cols = [d[0] for d in res.description]
            return dict(zip(cols, res.fetchone()))

    def write_train_metrics(self, run_id: str, run_name: str, rows: list[dict]) -> None:
        """Metrics rows keyed by (run, step): steps redone after a resume replace their first record."""
        if not rows:
            return
        now = _now()
        with self.write() as con:
            con.register("m_in", pa.Table.from_pylist([{**r, "run_name": run_name, "run_id": run_id, "recorded_at": now}
                                                       for r in rows], schema=METRIC_ROWS))
            con.execute("INSERT OR REPLACE INTO train_metrics SELECT * FROM m_in")

    def train_metrics(self, run_name: str) -> list[dict]:
        with self.read() as con:
            res = con.execute("SELECT * FROM train_metrics WHERE run_name = ? ORDER BY step", [run_name])
            cols = [d[0] for d in res.description]
            return [dict(zip(cols, r)) for r in res.fetchall()]

    def write_train_round(self, run_id: str, run_name: str, round_index: int, shards: list[str], samples: int,
                          epochs: int, last_step: int) -> None:
        with self.write() as con:
            con.execute("INSERT INTO train_rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [run_name, round_index, shards, samples, epochs, last_step, run_id, _now()])

    def register_checkpoint(self, run_id: str, row: dict) -> None:
        """Register an exported checkpoint; its path is stored absolute, so every reader finds it from any directory.

        `converter` (optional) names the program and version that converted it (the gguf format).
        """
        with self.write() as con:
            con.execute(
                "INSERT OR REPLACE INTO checkpoints (checkpoint, run_name, step, format, path, sha256, rounds, target, "
                "target_revision, aux_layer_ids, vocab_id, extract_key, run_id, created_at, converter) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [row["checkpoint"], row["run_name"], row["step"], row["format"], str(Path(row["path"]).resolve()),
                 row["sha256"], row["rounds"],
                 row["target"], row["target_revision"], row["aux_layer_ids"], row["vocab_id"], row["extract_key"],
                 run_id, _now(), row.get("converter")])

    # ------------------------------------------------------------ benchmark
    def checkpoint_row(self, path: str | None = None, fmt: str = "sglang") -> dict | None:
        """The registered checkpoint at `path` (as given, or resolved from this directory), or the latest one of `fmt`."""
        if not self.path.exists():
            return None
        with self.read() as con:
            if path is not None:
                res = con.execute("SELECT * FROM checkpoints WHERE path = ? OR path = ? ORDER BY created_at DESC LIMIT 1",
                                  [path, str(Path(path).resolve())])
            else:
                res = con.execute("SELECT * FROM checkpoints WHERE format = ? ORDER BY created_at DESC LIMIT 1", [fmt])
            cols = [d[0] for d in res.description]
            row = res.fetchone()
        return dict(zip(cols, row)) if row else None

    def checkpoint_export(self, run_name: str, step: int, fmt: str) -> dict | None:
        """The latest registered export in format `fmt` of training run `run_name` at `step` (None if none)."""
        if not self.path.exists():
            return None
        with self.read() as con:
            res = con.execute("SELECT * FROM checkpoints WHERE run_name = ? AND step = ? AND format = ? "
                              "ORDER BY created_at DESC LIMIT 1", [run_name, step, fmt])
            cols = [d[0] for d in res.description]
            row = res.fetchone()
        return dict(zip(cols, row)) if row else None

    def write_benchmark_results(self, run_id: str, rows: list[dict]) -> None:
        """One benchmark's rows (per config, drafter, domain), in one transaction."""
        if not rows:
            return
        now = _now()
        with self.write() as con:
            con.register("b_in", pa.Table.from_pylist(
                [{**r, "details": json.dumps(r.get("details") or {}, default=str), "run_id": run_id, "created_at": now}
                 for r in rows], schema=BENCH_ROWS))
            con.execute("INSERT INTO benchmark_results BY NAME SELECT * FROM b_in")
