"""Dataset files: Parquet written so that a torn or partial file is never visible.

Owns atomic writes (temporary name in the same folder, fsync, rename, fsync of the folder) and
the cleanup of files a crashed writer left behind. Promises: a reader sees a whole file or none.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

TMP_PREFIX = ".tmp-"


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """A temporary path beside `target`; on a clean exit it is fsynced and renamed onto `target`.

    Whatever the block wrote is visible under `target` whole or not at all; on an exception the
    temporary is removed, and one a crash leaves behind is found by `remove_unregistered`.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}-{target.name}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(data: bytes, target: Path) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def write_parquet_atomic(table: pa.Table, target: Path) -> tuple[int, str]:
    """Write `table` to `target` atomically; returns (bytes, sha256) of the file."""
    with atomic_path(target) as tmp:
        pq.write_table(table, tmp, compression="zstd")
        size, digest = tmp.stat().st_size, file_sha256(tmp)
    return size, digest


def remove_unregistered(folder: Path, registered: set[str], suffix: str = ".parquet") -> list[Path]:
    """Delete temporaries and `suffix` files the lineage store does not know (a crash left them)."""
    if not folder.exists():
        return []
    removed = []
    for p in folder.iterdir():
        if p.is_file() and (p.name.startswith(TMP_PREFIX) or (p.suffix == suffix and p.name not in registered)):
            p.unlink()
            removed.append(p)
    if removed:
        fsync_dir(folder)
    return removed


_TURN = pa.struct([
    ("turn_index", pa.int32()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("prompt_token_ids", pa.list_(pa.int64())),
    ("completion_token_ids", pa.list_(pa.int64())),
    ("latency_s", pa.float64()),
    ("endpoint", pa.string()),
    ("served_model", pa.string()),
    ("attempts", pa.int32()),
    ("server_build", pa.string()),  # the engine's version as it reported it; absent in older files
])

GENERATION_FILE_SCHEMA = pa.schema([
    ("generation_id", pa.string()),
    ("prompt_id", pa.string()),
    ("params_key", pa.string()),
    ("target_model", pa.string()),
    ("target_revision", pa.string()),
    ("template_id", pa.string()),
    ("mode", pa.string()),
    ("reasoning", pa.string()),
    ("sampling", pa.string()),
    ("origin", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())]))),
    ("turns", pa.list_(_TURN)),
    ("input_ids", pa.list_(pa.int64())),
    ("loss_mask", pa.list_(pa.int8())),
    ("flags", pa.list_(pa.string())),
])


def write_generation_file(rows: list[dict], target: Path) -> tuple[int, str]:
    """A batch of generations as one Parquet file (the schema every later stage reads)."""
    return write_parquet_atomic(pa.Table.from_pylist(rows, schema=GENERATION_FILE_SCHEMA), target)


def read_generation_rows(folder: Path, wanted: list[tuple[str, str]]) -> list[dict]:
    """The stored rows of (generation_id, file) pairs, in the order asked; each file is read once.

    `file` is relative to `folder` (the generations folder: `<params_key>/<file name>`).
    """
    by_file: dict[str, set[str]] = {}
    for gid, file in wanted:
        by_file.setdefault(file, set()).add(gid)
    rows: dict[str, dict] = {}
    for file, ids in by_file.items():
        table = pq.read_table(folder / file, columns=["generation_id", "messages", "turns", "input_ids", "loss_mask"])
        for row in table.to_pylist():
            if row["generation_id"] in ids:
                rows[row["generation_id"]] = row
    missing = [gid for gid, _ in wanted if gid not in rows]
    if missing:
        raise FileNotFoundError(f"{len(missing)} generation(s) registered in lineage are missing from their files, "
                                f"e.g. {missing[0]}")
    return [rows[gid] for gid, _ in wanted]


def write_folder_atomically(folder: Path, write: Callable[[Path], None]) -> bool:
    """Fill a temporary sibling of `folder` with `write`, then rename it into place.

    Returns False when another process finished the same folder first (its folder is kept and
    ours discarded: both are conversions of the same file). On any error nothing is left behind.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_temps(folder)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        try:
            os.rename(tmp, folder)  # atomic on one filesystem; fails if folder exists and is non-empty
        except OSError:
            if folder.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def _remove_orphaned_temps(folder: Path) -> None:
    """Delete temporary folders of conversions whose process is gone (killed mid-write): ~260 MB each."""
    pattern = re.compile(rf"^\.{re.escape(folder.name)}\.tmp-(\d+)-[0-9a-f]+$")
    for entry in folder.parent.iterdir():
        m = pattern.match(entry.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
