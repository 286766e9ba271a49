"""Who wrote a lineage row: the Prefect flow-run id and the code's git sha; a flow run's `runs` row.

Promises: never fails a run for missing metadata (a value it cannot find is None); every flow run
ends its row COMPLETED with its summary, or FAILED with the error.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=1)
def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT, capture_output=True, text=True)
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run_metadata() -> dict:
    from prefect.runtime import flow_run

    return {"flow_run_id": flow_run.id, "git_sha": git_sha()}


@dataclass
class LineageRun:
    run_id: str
    summary: dict[str, Any] | None = None  # what the COMPLETED row records; set by the flow


@contextmanager
def lineage_run(store, flow: str, config) -> Iterator[LineageRun]:
    """A `runs` row for this flow run (parameters, config hash, Prefect id, git sha): FAILED with the
    error if the block raises, else COMPLETED with `run.summary`."""
    from tasks.ids import config_hash

    meta = run_metadata()
    run = LineageRun(store.runs.begin(flow, config.model_dump(mode="json"), config_hash(config), meta["flow_run_id"],
                                     meta["git_sha"]))
    try:
        yield run
    except BaseException as e:
        store.runs.finish(run.run_id, "FAILED", {"error": f"{type(e).__name__}: {e}"})
        raise
    store.runs.finish(run.run_id, "COMPLETED", run.summary or {})
