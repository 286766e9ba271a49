"""The `runs` table: one row per flow run, with its state, parameters and summary.

Promises: a run begins RUNNING; runs left RUNNING on this host by a process that is gone are
marked CRASHED when the next one begins, so `eagle3 status` never shows a dead run as running.
"""

from __future__ import annotations

import json
import os
import socket
import uuid

from storage.connection import DuckDBFile, utc_now
from storage.datasets import pid_alive


class Runs:
    """Beginning and finishing flow runs."""

    def __init__(self, db: DuckDBFile):
        self.db = db

    def begin(self, flow: str, parameters: dict, config_hash: str, flow_run_id: str | None, git_sha: str | None) -> str:
        """A new run row; runs left RUNNING by a dead process on this host become CRASHED."""
        run_id = uuid.uuid4().hex
        host = socket.gethostname()
        with self.db.write() as con:
            for other, pid in con.execute(
                "SELECT run_id, pid FROM runs WHERE state = 'RUNNING' AND host = ?", [host]
            ).fetchall():
                if pid is not None and not pid_alive(pid):
                    con.execute("UPDATE runs SET state = 'CRASHED', ended_at = ? WHERE run_id = ?", [utc_now(), other])
            con.execute(
                "INSERT INTO runs (run_id, flow, flow_run_id, git_sha, config_hash, parameters, state, started_at, host, pid) "
                "VALUES (?, ?, ?, ?, ?, ?, 'RUNNING', ?, ?, ?)",
                [run_id, flow, flow_run_id, git_sha, config_hash, json.dumps(parameters, default=str), utc_now(), host,
                 os.getpid()],
            )
        return run_id

    def finish(self, run_id: str, state: str, summary: dict | None = None) -> None:
        with self.db.write() as con:
            con.execute(
                "UPDATE runs SET state = ?, ended_at = ?, summary = ? WHERE run_id = ?",
                [state, utc_now(), json.dumps(summary or {}, default=str), run_id],
            )
