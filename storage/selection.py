"""Reads and writes of acceptance-aware selection: prompt tags, probe results, selection reasons.

Owns the tables `prompt_tags`, `probe_results` and `prompt_selections`. Promises: each write is
one transaction and idempotent (a tag, a probe's cluster row or a selection already stored is
kept as it is); a store that does not exist yet has no tag, probe or selection.
"""

from __future__ import annotations

import pyarrow as pa

from storage.connection import DuckDBFile, dict_rows, utc_now


class Selections:
    """Prompt tags (discover), probe results (after a round), selection reasons (regenerate)."""

    def __init__(self, db: DuckDBFile):
        self.db = db

    # ------------------------------------------------------------ tags (discover)

    def untagged_prompts(self, tagger: str, limit: int | None = None) -> list[tuple[str, list[dict]]]:
        """(prompt id, messages) of stored prompts (kept or held out) that `tagger` has not tagged."""
        if not self.db.path.exists():
            return []
        with self.db.read() as con:
            return con.execute(
                "SELECT p.prompt_id, p.messages FROM prompts p WHERE NOT EXISTS (SELECT 1 FROM prompt_tags t "
                "WHERE t.prompt_id = p.prompt_id AND t.tagger = ?) ORDER BY p.created_at, p.prompt_id"
                + ("" if limit is None else f" LIMIT {int(limit)}"), [tagger]).fetchall()

    def write_tags(self, tagger: str, rows: list[tuple[str, str, str, str]]) -> int:
        """(prompt id, domain, cluster, signals) rows by `tagger`; returns how many were new."""
        if not rows:
            return 0
        ids, domains, clusters, signals = (list(c) for c in zip(*rows))
        now = utc_now()
        with self.db.write() as con:
            con.register("tags_in", pa.table({"prompt_id": ids, "domain": domains, "cluster": clusters,
                                              "signals": signals}))
            return len(con.execute(
                "INSERT INTO prompt_tags SELECT prompt_id, ?, domain, cluster, signals, ? FROM tags_in "
                "ON CONFLICT DO NOTHING RETURNING prompt_id", [tagger, now]).fetchall())

    # ------------------------------------------------------------ the pool and the probe set

    def cluster_pool(self, tagger: str) -> dict[str, int]:
        """Prompts per cluster among those that can be regenerated (stored, not held out)."""
        if not self.db.path.exists():
            return {}
        with self.db.read() as con:
            return dict(con.execute(
                "SELECT t.cluster, count(*) FROM prompt_tags t JOIN prompts p USING (prompt_id) "
                "WHERE t.tagger = ? AND NOT EXISTS (SELECT 1 FROM records r WHERE r.prompt_id = p.prompt_id "
                "AND r.outcome = 'heldout') GROUP BY t.cluster", [tagger]).fetchall())

    def heldout_tagged(self, tagger: str) -> list[tuple[str, list[dict], str]]:
        """(prompt id, messages, cluster) of every held-out prompt `tagger` tagged, in held-out order
        (the order `DiscoverRecords.heldout_prompts` gives, so its first N are the benchmark's)."""
        if not self.db.path.exists():
            return []
        with self.db.read() as con:
            return con.execute(
                "SELECT p.prompt_id, p.messages, t.cluster FROM records r JOIN prompts p USING (prompt_id) "
                "JOIN prompt_tags t ON t.prompt_id = p.prompt_id AND t.tagger = ? "
                "WHERE r.outcome = 'heldout' ORDER BY r.recorded_at, p.prompt_id", [tagger]).fetchall()

    # ------------------------------------------------------------ probes (after a round)

    def write_probe(self, rows: list[dict]) -> None:
        """One probe's rows, one per cluster (`probe_results` columns but `measured_at`)."""
        if not rows:
            return
        now = utc_now()
        cols = ["probe_id", "checkpoint", "export_dir", "tagger", "cluster", "domain", "prompts", "verify_rounds",
                "completion_tokens", "acceptance", "k", "max_new_tokens", "prompt_ids", "run_id"]
        with self.db.write() as con:
            for r in rows:
                con.execute(f"INSERT INTO probe_results ({', '.join(cols)}, measured_at) VALUES "
                            f"({', '.join('?' * len(cols))}, ?) ON CONFLICT DO NOTHING", [r[c] for c in cols] + [now])

    def latest_probe(self, tagger: str, probe_id: str | None = None) -> list[dict]:
        """The newest probe's rows by `tagger` (every cluster it measured), or probe `probe_id`'s; [] before any."""
        if not self.db.path.exists():
            return []
        with self.db.read() as con:
            return dict_rows(con.execute(
                "SELECT * FROM probe_results WHERE probe_id = coalesce(?, (SELECT probe_id FROM probe_results "
                "WHERE tagger = ? ORDER BY measured_at DESC, probe_id LIMIT 1)) ORDER BY cluster", [probe_id, tagger]))

    def probed(self, export_dir: str, tagger: str) -> str | None:
        """The probe id that already measured this export with this tagger, if one did."""
        if not self.db.path.exists():
            return None
        with self.db.read() as con:
            row = con.execute("SELECT probe_id FROM probe_results WHERE export_dir = ? AND tagger = ? LIMIT 1",
                              [export_dir, tagger]).fetchone()
        return row[0] if row else None

    # ------------------------------------------------------------ selections (regenerate)

    def write_selections(self, run_id: str, params_key: str, rows: list[dict]) -> None:
        """Why each prompt of this run's batch was chosen (`prompt_selections` columns but the run's)."""
        if not rows:
            return
        cols = ["prompt_id", "policy", "cluster", "probe_id", "pool_share", "batch_share", "acceptance", "reason"]
        table = pa.table({c: [r.get(c) for r in rows] for c in cols})
        with self.db.write() as con:
            con.register("sel_in", table)
            con.execute(
                "INSERT INTO prompt_selections SELECT prompt_id, ?, ?, policy, cluster, probe_id, pool_share::DOUBLE, "
                "batch_share::DOUBLE, acceptance::DOUBLE, reason, ? FROM sel_in ON CONFLICT DO NOTHING",
                [run_id, params_key, utc_now()])
