"""One DuckDB file opened for short transactions, safely shared by many processes.

Owns the cross-process file lock, DuckDB's own lock retries, and applying the migrations of
`storage.migrations` on the first write. Promises: writers hold the file only for one short
transaction, under an exclusive lock, and retry while another process holds DuckDB's own lock;
readers open it read-only under a shared lock; a write is one transaction, there whole or not at
all after a crash (`kill -9` included). Every repository of `storage.lineage.LineageStore` is
built on one shared `DuckDBFile`.
"""

from __future__ import annotations

import fcntl
import os
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import duckdb
import pyarrow as pa

from storage.errors import LineageError
from storage.migrations import MIGRATIONS


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


# DuckDB's Python package shares one database instance between the connections a process opens
# on the same file. Opening and closing such connections from two threads at once can leave a
# new connection without the package's Arrow scan: `register` then fails with "Table Function
# with name python_arrow_scan does not exist" (duckdb 2.0.1; about 1 in 1,000 cycles with two
# threads reading, never in 60,000 with this lock). A thread that polls the store while a flow
# reads it did exactly that in CI. Opening and closing take milliseconds, so one lock suffices.
_OPEN_CLOSE = threading.Lock()


@dataclass
class StoreLocking:
    """How long to wait for our lock file, and for DuckDB's own lock, before giving up."""

    lock_timeout_s: float = 600.0
    open_retry_s: float = 120.0


def _close(con: duckdb.DuckDBPyConnection) -> None:
    with _OPEN_CLOSE:
        con.close()


class DuckDBFile:
    """The file, its lock and its schema; the repositories hold one and add the queries."""

    def __init__(self, path: str | Path, locking: StoreLocking | None = None):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.locking = locking or StoreLocking()
        self._migrated = False

    @contextmanager
    def _flock(self, exclusive: bool) -> Iterator[None]:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + self.locking.lock_timeout_s
        delay = 0.005
        try:
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LineageError(
                            f"lineage store {self.path} stayed locked by another process for "
                            f"{self.locking.lock_timeout_s:.0f} s"
                        ) from None
                    time.sleep(delay * (1 + random.random()))
                    delay = min(delay * 2, 0.25)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _connect(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        # DuckDB's own file lock can still be held by a process that does not use our lock
        # file (an interactive `duckdb` shell, say): retry with backoff instead of failing.
        deadline = time.monotonic() + self.locking.open_retry_s
        delay = 0.01
        while True:
            try:
                with _OPEN_CLOSE:
                    return duckdb.connect(str(self.path), read_only=read_only)
            except duckdb.IOException as e:
                if "lock" not in str(e).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)

    @contextmanager
    def write(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """One transaction on the file, under the exclusive lock; committed on success."""
        with self._flock(exclusive=True):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            con = self._connect(read_only=False)
            try:
                if not self._migrated:
                    self._migrate(con)
                con.execute("BEGIN TRANSACTION")
                try:
                    yield con
                    con.execute("COMMIT")
                except BaseException:
                    con.execute("ROLLBACK")
                    raise
            finally:
                _close(con)

    @contextmanager
    def read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        if not self.path.exists():
            raise LineageError(f"no lineage store at {self.path}: run a stage (eagle3 discover) first")
        with self._flock(exclusive=False):
            con = self._connect(read_only=True)
            try:
                yield con
            finally:
                _close(con)

    def _migrate(self, con: duckdb.DuckDBPyConnection) -> None:
        con.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version INTEGER PRIMARY KEY, description VARCHAR, applied_at TIMESTAMPTZ)"
        )
        done = {v for (v,) in con.execute("SELECT version FROM schema_migrations").fetchall()}
        for version, description, sql in MIGRATIONS:
            if version in done:
                continue
            con.execute("BEGIN TRANSACTION")
            try:
                con.execute(sql)
                con.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", [version, description, utc_now()])
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        self._migrated = True

    def stored_ids(self, table: str, column: str, ids: list[str]) -> set[str]:
        """Which of `ids` appear in `table`'s `column` (none when the file does not exist yet)."""
        if not self.path.exists() or not ids:
            return set()
        with self.read() as con:
            con.register("ids_in", pa.table({column: ids}))
            rows = con.execute(f"SELECT DISTINCT t.{column} FROM {table} t JOIN ids_in USING ({column})").fetchall()
        return {r[0] for r in rows}

    def schema_version(self) -> int:
        with self.read() as con:
            return con.execute("SELECT max(version) FROM schema_migrations").fetchall()[0][0]


def dict_rows(result: duckdb.DuckDBPyConnection) -> list[dict]:
    """Every row of an executed query, as {column: value}."""
    cols = [d[0] for d in result.description]
    return [dict(zip(cols, r)) for r in result.fetchall()]


def dict_row(result: duckdb.DuckDBPyConnection) -> dict | None:
    """The first row of an executed query as {column: value}; None if it has none."""
    cols = [d[0] for d in result.description]
    row = result.fetchone()
    return dict(zip(cols, row)) if row else None
