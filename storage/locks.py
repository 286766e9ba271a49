"""Workspace stage locks: at most one run of a stage (regenerate, extract, train, the pipeline) per workspace.

A stage lock is a `flock` on `<workspace>/.<stage>.lock`, beside the lineage file whose own
short-transaction lock is `storage.connection`'s. Promises: a second run of the same stage on the
same workspace fails at once with `StageBusy` instead of re-queueing the first one's work; the lock
is the open file's, so it is released when its process ends, `kill -9` included.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from storage.errors import StageBusy


@contextmanager
def stage_lock(workspace: Path, stage: str) -> Iterator[None]:
    """One run of a stage per workspace: a second one would re-queue the first one's work."""
    workspace.mkdir(parents=True, exist_ok=True)
    fd = os.open(workspace / f".{stage}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StageBusy(f"another {stage} run holds {workspace}; wait for it or stop it") from None
        yield
    finally:
        os.close(fd)
