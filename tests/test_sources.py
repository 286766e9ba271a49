"""Reading sources: every good record survives truncation and corruption; the cut is reported."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.config import SourceConfig
from tasks.discover.sources import (
    SourceError,
    read_file,
    read_json_text,
    read_source,
    sample_records,
    sharegpt_package_path,
    source_quotas,
)


def conv(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}


def pretty_array(items: list[dict]) -> str:
    return json.dumps(items, indent=2)


def test_truncated_json_array_keeps_every_complete_record():
    text = pretty_array([conv(i) for i in range(10)])
    cut = text[: text.index('"question 9"') + 5]  # inside the last record
    records, report = read_json_text(cut, "s", "mem")
    good = [r for r in records if r.error is None]
    assert [r.data["id"] for r in good] == [f"c{i}" for i in range(9)]
    assert len(records) == 10 and records[-1].data is None
    assert records[-1].error.startswith("truncated")
    assert not report.complete and "record #9" in report.stop_reason


def test_array_cut_between_records_is_reported_without_losing_one():
    text = pretty_array([conv(i) for i in range(5)])
    cut = text[: text.rindex("}") + 1] + ",\n"  # no closing bracket
    records, report = read_json_text(cut, "s", "mem")
    assert [r.data["id"] for r in records] == [f"c{i}" for i in range(5)]
    assert not report.complete and "closing ']'" in report.stop_reason


def test_corrupt_record_in_the_middle_costs_only_itself():
    parts = [json.dumps(conv(i), indent=2) for i in range(6)]
    parts[2] = parts[2].replace('"question 2"', '"question 2" oops')  # a syntax error inside
    text = "[\n" + ",\n".join("  " + p.replace("\n", "\n  ") for p in parts) + "\n]"
    records, report = read_json_text(text, "s", "mem")
    assert len(records) == 6
    assert [r.data["id"] for r in records if r.data] == ["c0", "c1", "c3", "c4", "c5"]
    assert records[2].error.startswith("invalid JSON") and records[2].record_key == "#2"
    assert report.complete


def test_unbalanced_quote_resyncs_on_the_next_record():
    parts = [json.dumps(conv(i), indent=2) for i in range(4)]
    parts[1] = parts[1].replace('"answer 1"', '"answer 1')  # an unterminated string swallows braces
    text = "[\n" + ",\n".join("  " + p.replace("\n", "\n  ") for p in parts) + "\n]"
    records, _ = read_json_text(text, "s", "mem")
    assert [r.data["id"] for r in records if r.data] == ["c0", "c2", "c3"]
    assert records[1].data is None and "invalid JSON" in records[1].error


def test_non_object_elements_are_unreadable_records():
    records, _ = read_json_text('[{"prompt": "a"}, 3, "x", {"prompt": "b"}]', "s", "mem")
    assert [r.error is None for r in records] == [True, False, False, True]
    assert "not an object" in records[1].error


def test_jsonl_bad_lines_and_cut_last_line(tmp_path: Path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n{not json}\n[1, 2]\n\n{"prompt": "b"}\n{"prompt": "c')
    records, report = read_file(p, "s")
    assert [r.record_key for r in records] == ["L1", "L2", "L3", "L5", "L6"]
    assert [r.data["prompt"] for r in records if r.data] == ["a", "b"]
    assert "column" in records[1].error and "not an object" in records[2].error
    assert records[4].error.startswith("truncated") and not report.complete


def test_truncated_gzip_keeps_what_decompresses(tmp_path: Path):
    body = "".join(json.dumps({"prompt": f"p{i} " * 50}) + "\n" for i in range(2000)).encode()
    full = gzip.compress(body)
    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(full[: len(full) * 2 // 3])
    records, report = read_file(p, "s")
    good = [r for r in records if r.error is None]
    assert 100 < len(good) < 2000
    assert [r.data["prompt"].split()[0] for r in good] == [f"p{i}" for i in range(len(good))]
    assert not report.complete and "gzip" in report.stop_reason


def test_json_gz_array(tmp_path: Path):
    p = tmp_path / "d.json.gz"
    p.write_bytes(gzip.compress(json.dumps([conv(i) for i in range(3)]).encode()))
    records, report = read_file(p, "s")
    assert len(records) == 3 and report.complete


def test_parquet_unreadable_row_group_quarantines_its_rows(tmp_path: Path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(30)]}), p, row_group_size=10, compression="none", use_dictionary=False)
    md = pq.ParquetFile(p).metadata
    rg = md.row_group(1).column(0)
    data = bytearray(p.read_bytes())
    start = rg.data_page_offset
    data[start : start + rg.total_compressed_size] = b"\xff" * rg.total_compressed_size
    p.write_bytes(bytes(data))
    records, report = read_file(p, "s")
    assert len(records) == 30
    assert sum(r.error is None for r in records) == 20
    assert all(r.error and "row group 1" in r.error for r in records[10:20])


def test_parquet_with_cut_footer_is_one_quarantined_record(tmp_path: Path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), p)
    p.write_bytes(p.read_bytes()[:-20])
    records, report = read_file(p, "s")
    assert len(records) == 1 and records[0].error.startswith("unreadable parquet")
    assert not report.complete


def test_glob_reads_every_file_with_file_scoped_keys(tmp_path: Path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"prompt": name}) + "\n")
    records, reports = read_source(SourceConfig(name="g", kind="file", path=str(tmp_path / "*.jsonl")))
    assert [r.record_key for r in records] == ["a.jsonl:L1", "b.jsonl:L1"]
    assert len(reports) == 2


def test_missing_file_and_empty_glob_name_the_source(tmp_path: Path):
    with pytest.raises(SourceError, match="source 'x'.*not found"):
        read_source(SourceConfig(name="x", kind="file", path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(SourceError, match="source 'y': no file matches"):
        read_source(SourceConfig(name="y", kind="file", path=str(tmp_path / "*.parquet")))


def test_hub_loader_on_a_local_dataset_folder(tmp_path: Path):
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"instruction": f"do {i}", "output": "ok"}) + "\n" for i in range(4)))
    records, reports = read_source(SourceConfig(name="hub", kind="hub", path=str(folder), split="train"))
    assert [r.data["instruction"] for r in records] == [f"do {i}" for i in range(4)]
    assert [r.record_key for r in records] == ["i0", "i1", "i2", "i3"]
    with pytest.raises(SourceError, match="source 'hub2': cannot load dataset"):
        read_source(SourceConfig(name="hub2", kind="hub", path="no-such-org/no-such-dataset"))


def test_the_real_sharegpt_package_file():
    records, reports = read_source(SourceConfig(name="sharegpt", kind="sharegpt_package"))
    good = [r for r in records if r.error is None]
    assert 17_000 < len(good) < 18_000  # "about 17.6 thousand"
    assert len(records) == len(good) + 1  # the one cut at the end, quarantined, not lost
    assert not reports[0].complete and "file ends inside record" in reports[0].stop_reason
    assert reports[0].location == str(sharegpt_package_path())
    assert good[0].data["id"] == "QWJhYvA_0"


def test_sample_is_reproducible_and_grows_as_a_superset():
    records, _ = read_json_text(json.dumps([conv(i) for i in range(100)]), "s", "mem")
    a = sample_records(records, 10, seed=1)
    assert [r.record_key for r in a] == [r.record_key for r in sample_records(records, 10, seed=1)]
    assert {r.record_key for r in a} != {r.record_key for r in sample_records(records, 10, seed=2)}
    assert {r.record_key for r in a} <= {r.record_key for r in sample_records(records, 30, seed=1)}


def test_quotas_share_the_total_by_weight_and_respect_limits():
    cfgs = [
        SourceConfig(name="a", kind="file", path="x", weight=3),
        SourceConfig(name="b", kind="file", path="x", weight=1),
        SourceConfig(name="c", kind="file", path="x", weight=1, limit=5),
    ]
    q = source_quotas(cfgs, {"a": 1000, "b": 1000, "c": 1000}, total_limit=100)
    assert sum(q.values()) == 100 and q["c"] == 5 and q["a"] > 2 * q["b"]
    q = source_quotas(cfgs, {"a": 10, "b": 1000, "c": 1000}, total_limit=100)
    assert q["a"] == 10 and sum(q.values()) == 100  # the unused share goes to the others
