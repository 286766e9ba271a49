"""The lineage reads that benchmarks, studies and rehearsals make of a workspace: the one place their SQL lives.

Owns read-only questions about one workspace's lineage store that no flow asks (how many loss-masked tokens
a study's first generations hold, what an arm regenerated, what a rehearsal lost), so that benchmarks/ speaks
no SQL (docs/architecture.md: only storage/ speaks SQL). Promises: every read is read-only, under the
store's shared lock (`storage.connection.DuckDBFile.read`), with values passed as parameters, never
formatted into the SQL; a store that does not exist yet reads as empty where a study asks before its
first stage has run (`generation_tokens`, `trained_positions` and the like), and raises LineageError
where a caller needs it to exist (the rehearsals' and benchmarks' checks after a stage).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from storage.connection import DuckDBFile

# The README's example query, typed to `eagle3 sql` as a user would: the scale rehearsal times it.
README_OUTCOMES_SQL = "SELECT outcome, count(*) FROM record_outcomes GROUP BY 1"

# Generations whose prompt is not held out, in the order extraction takes them.
_TRAINABLE_GENERATIONS = (
    "FROM generations g WHERE NOT EXISTS (SELECT 1 FROM records r WHERE r.prompt_id = g.prompt_id "
    "AND r.outcome = 'heldout') ORDER BY g.created_at, g.generation_id")


class StudyReads:
    """Read-only questions about one workspace's lineage store (a `LineageStore`, or its file's path)."""

    def __init__(self, store_or_path: Any) -> None:
        self.file = DuckDBFile(getattr(store_or_path, "path", store_or_path))

    @property
    def path(self) -> Path:
        return self.file.path

    def rows(self, sql: str, params: list | None = None, missing_ok: bool = True) -> list[tuple]:
        if missing_ok and not self.path.exists():
            return []
        with self.file.read() as con:
            return con.execute(sql, params or []).fetchall()

    def one(self, sql: str, params: list | None = None) -> tuple:
        return self.rows(sql, params, missing_ok=False)[0]

    def columns_and_rows(self, sql: str, params: list | None = None) -> tuple[list[str], list[tuple]]:
        with self.file.read() as con:
            res = con.execute(sql, params or [])
            return [d[0] for d in (res.description or [])], res.fetchall()

    # -- the scaling and selection studies
    def generation_tokens(self) -> list[tuple[str, str, int]]:
        """(generation_id, file relative to data/generations, completion tokens) of the generations for
        non-held-out prompts, in extraction order."""
        return [(g, f"{p}/{f}", int(t or 0)) for g, p, f, t in self.rows(
            "SELECT g.generation_id, g.params_key, g.file, g.completion_tokens " + _TRAINABLE_GENERATIONS)]

    def first_generations(self, n: int) -> list[tuple[str, str]]:
        """(generation_id, file relative to data/generations) of the first n generations, extraction order."""
        return [(g, f"{p}/{f}") for g, p, f in self.rows(
            "SELECT g.generation_id, g.params_key, g.file " + _TRAINABLE_GENERATIONS + " LIMIT ?", [int(n)])]

    def sampled_generations(self) -> int:
        rows = self.rows("SELECT count(DISTINCT generation_id) FROM samples")
        return int(rows[0][0]) if rows else 0

    def extracted_tokens(self) -> tuple[int, int, int]:
        """(samples, tokens, loss-masked tokens) extracted in this workspace."""
        rows = self.rows("SELECT count(*), coalesce(sum(tokens), 0), coalesce(sum(masked_tokens), 0) FROM samples "
                         "WHERE outcome = 'extracted'")
        return tuple(int(x) for x in rows[0]) if rows else (0, 0, 0)

    def trained_positions(self, run_name: str) -> int:
        """The train loop's counter (what the acceptance_curve view calls training_tokens: epochs counted)."""
        rows = self.rows("SELECT coalesce(max(tokens), 0) FROM train_metrics WHERE run_name = ?", [run_name])
        return int(rows[0][0]) if rows else 0

    def discovered(self) -> bool:
        rows = self.rows("SELECT count(*) FROM runs WHERE flow = 'discover' AND state = 'COMPLETED'")
        return bool(rows and rows[0][0])

    def regenerate_rate(self) -> float | None:
        """Completion tokens per second over every regenerate run of the workspace (their own summaries)."""
        tokens = seconds = 0.0
        for (summary,) in self.rows("SELECT summary FROM runs WHERE flow = 'regenerate' AND summary IS NOT NULL"):
            s = json.loads(summary) if isinstance(summary, str) else summary
            if s.get("generated") and s.get("seconds"):
                tokens += s.get("completion_tokens") or 0
                seconds += s["seconds"]
        return tokens / seconds if seconds else None

    def regenerated(self, tagger: str) -> dict:
        """What an arm regenerated: completion tokens, generations, generations per cluster of `tagger`, and
        how many probes measured it; {} before its first stage."""
        if not self.path.exists():
            return {}
        tokens, gens = self.one("SELECT coalesce(sum(completion_tokens), 0), count(*) FROM generations")
        mix = dict(self.rows("SELECT coalesce(t.cluster, 'untagged'), count(*) FROM generations g LEFT JOIN "
                             "prompt_tags t ON t.prompt_id = g.prompt_id AND t.tagger = ? GROUP BY 1 ORDER BY 1",
                             [tagger]))
        probes = self.one("SELECT count(DISTINCT probe_id) FROM probe_results")[0]
        return {"regen_completion_tokens": int(tokens), "regen_generations": int(gens), "cluster_mix": mix,
                "probes": int(probes)}

    # -- benchmarks of single stages
    def sample_outcomes(self) -> list[tuple[str, int, int]]:
        """(outcome, samples, tokens) of the extraction, by outcome."""
        return self.rows("SELECT outcome, count(*), sum(tokens) FROM samples GROUP BY 1 ORDER BY 1", missing_ok=False)

    def duplicate_samples(self) -> int:
        """Samples beyond one per generation: extraction must write each generation once."""
        return int(self.one("SELECT count(*) - count(DISTINCT generation_id) FROM samples")[0])

    def shard_times(self) -> list[tuple[float, int]]:
        """(seconds since the epoch it was written, tokens) of each shard, in the order written."""
        return self.rows("SELECT epoch(created_at), tokens FROM shards ORDER BY created_at", missing_ok=False)

    def first_completed_summary(self, flow: str) -> dict:
        """The summary of the flow's first completed run."""
        (summary,) = self.one("SELECT summary FROM runs WHERE flow = ? AND state = 'COMPLETED' "
                              "ORDER BY started_at LIMIT 1", [flow])
        return json.loads(summary) if isinstance(summary, str) else summary

    def prompt_texts(self, prompt_ids: list[str]) -> dict[str, str]:
        """Prompt id -> its first message's text, for the ids asked that are stored."""
        return dict(self.rows("SELECT prompt_id, messages[1].content FROM prompts WHERE list_contains(?, prompt_id)",
                              [list(prompt_ids)], missing_ok=False))

    # -- the scale rehearsal
    def progress(self, stage: str | None = None) -> dict | list[dict] | None:
        """The progress view: the row of `stage` (None when it has none), or every row."""
        cols, rows = self.columns_and_rows("SELECT * FROM progress" + (" WHERE stage = ?" if stage else ""),
                                           [stage] if stage else None)
        found = [dict(zip(cols, r)) for r in rows]
        return (found[0] if found else None) if stage else found

    def outcome_counts(self) -> dict[str, int]:
        return dict(self.rows(README_OUTCOMES_SQL + " ORDER BY 1", missing_ok=False))

    def source_reads(self) -> list[list]:
        return [list(r) for r in self.rows("SELECT source, records, unreadable, complete, stop_reason FROM source_reads",
                                           missing_ok=False)]

    def kept_records(self) -> int:
        return int(self.one("SELECT count(*) FROM records WHERE outcome = 'kept'")[0])

    def kept_prompts(self) -> int:
        """Kept records with their prompt stored: what regenerate has to answer."""
        return int(self.one("SELECT count(*) FROM prompts p JOIN records r ON r.prompt_id = p.prompt_id AND "
                            "r.outcome = 'kept' AND r.source = p.source AND r.record_key = p.record_key")[0])

    def generation_counts(self) -> tuple[int, int]:
        """(generation rows, distinct generation ids)."""
        gens, distinct = self.one("SELECT count(*), count(DISTINCT generation_id) FROM generations")
        return int(gens), int(distinct)

    def failed_prompts(self) -> int:
        return int(self.one("SELECT count(DISTINCT prompt_id) FROM generation_failures")[0])

    def generation_files(self) -> list[tuple[str, int]]:
        """(file, rows) of each generation file registered in the lineage."""
        return self.rows("SELECT file, rows FROM generation_files", missing_ok=False)

    def generation_completion_tokens(self) -> list[tuple[str, int]]:
        """(generation_id, completion tokens or 0) of every generation, by id."""
        return self.rows("SELECT generation_id, coalesce(completion_tokens, 0) FROM generations ORDER BY 1",
                         missing_ok=False)

    def has_checkpoint(self, checkpoint: str) -> bool:
        return bool(self.one("SELECT count(*) FROM checkpoints WHERE checkpoint = ?", [checkpoint])[0])

    def checkpoint_lineage_count(self, checkpoint: str) -> int:
        """Rows of the checkpoint_lineage view for one checkpoint (what `eagle3 lineage` reads)."""
        return int(self.one("SELECT count(*) FROM checkpoint_lineage WHERE checkpoint = ?", [checkpoint])[0])
