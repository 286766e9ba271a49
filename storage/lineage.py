"""The DuckDB lineage and progress store: the only place that speaks SQL, as one repository per concern.

`LineageStore(path)` is the one entry point: it opens nothing itself, but holds one `DuckDBFile`
(`storage.connection`: the file, its locks, its migrations) and the repositories built on it, each
owning its tables:

    store.runs          storage.runs         flow runs
    store.discover      storage.discover     source reads, record outcomes, prompts, the held-out set
    store.exact_index   storage.exact_index  exact dedupe's in-memory index of stored prompt ids
    store.near_index    storage.minhash_index  near dedupe's MinHash segment files and their registry
    store.generations   storage.generations  regenerate's queue, generations, failures, deferrals
    store.extraction    storage.extraction   draft vocabs, extraction settings, samples, shard rows
    store.training      storage.training     training runs, metrics, rounds
    store.checkpoints   storage.checkpoints  exported checkpoints
    store.benchmarks    storage.benchmarks   benchmark results, the acceptance curve
    store.selection     storage.selection    prompt tags, probe results, selection reasons
    store.reports       storage.reports      the pipeline summary, a checkpoint's lineage, read-only SQL

Promises (see docs/architecture.md):
- No process keeps the file open for a whole stage: each call is one short transaction (a
  write) or one read-only open, so flows in separate Prefect processes and `eagle3 sql` interleave.
- A write is one transaction: after a crash, `kill -9` included, it is there whole or not at all.
- Resume and dedupe are by content-addressed ids, never by counting rows.
"""

from __future__ import annotations

from pathlib import Path

from storage.benchmarks import Benchmarks
from storage.checkpoints import Checkpoints
from storage.connection import DuckDBFile, StoreLocking
from storage.discover import DiscoverRecords
from storage.errors import LineageError
from storage.exact_index import ExactIndexStore
from storage.extraction import Extractions
from storage.generations import Generations
from storage.minhash_index import NearIndexStore
from storage.reports import Reports
from storage.runs import Runs
from storage.selection import Selections
from storage.training import TrainingRuns

__all__ = ["LineageError", "LineageStore", "StoreLocking"]


class LineageStore:
    """One workspace's lineage file and its repositories (a plain composition: each is an attribute)."""

    def __init__(self, path: str | Path, locking: StoreLocking | None = None):
        self.db = DuckDBFile(path, locking)
        self.path = self.db.path
        self.runs = Runs(self.db)
        self.exact_index = ExactIndexStore(self.db)
        self.near_index = NearIndexStore(self.db)
        self.discover = DiscoverRecords(self.db, self.exact_index, self.near_index)
        self.generations = Generations(self.db, self.discover)
        self.extraction = Extractions(self.db)
        self.training = TrainingRuns(self.db)
        self.checkpoints = Checkpoints(self.db)
        self.benchmarks = Benchmarks(self.db)
        self.selection = Selections(self.db)
        self.reports = Reports(self.db)
