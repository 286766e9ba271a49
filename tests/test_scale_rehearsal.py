"""The scale rehearsal's parts at a small size: its sources and its production-like scripted server.

benchmarks/rehearsals/scale.py reports numbers that rest on two claims tested here: the 10 built
sources are what the report says they are (every format reads back, the cut file is reported as
cut, the bad rows are quarantined with a reason, nothing else is lost), and the scripted TP-8 server
answers with the drawn lengths and counts its busy slot-time correctly (the saturation figure is
computed from that counter). Bounds only, never speed.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from benchmarks.rehearsals import sources as rehearsal
from serving.client import Endpoint, RetryPolicy, ServerPool
from serving.scripted_server import drawn_length, long_answer, spawn
from tasks.config import SourceConfig
from tasks.discover.prompts import Quarantine, normalise_record
from tasks.discover.sources import read_source

pytestmark = pytest.mark.slow  # starts scripted servers: not in `make test-fast`


def test_rehearsal_sources_read_back_with_the_cut_and_the_bad_rows_reported(tmp_path):
    written = rehearsal.build_sources(tmp_path, records=17_672 + 3_000, seed=1)
    assert written["records"] == sum(written["records_written"].values())
    quarantined = 0
    for name, file, fmt, _ in rehearsal.SOURCES[1:]:
        records, reports = read_source(SourceConfig(name=name, kind="file", path=str(tmp_path / file), format=fmt))
        n = written["records_written"][name]
        assert len(records) == n, name  # every record the file holds comes back, readable or not
        (report,) = reports
        if name == "openai_truncated_jsonl":
            assert not report.complete and "file ends inside line" in report.stop_reason
            assert report.unreadable == 1  # the cut record, quarantined: not lost
        else:
            assert report.complete, name
        for r in records:
            result = Quarantine(r.error) if r.error else normalise_record(r.data, fmt, "prompt", "response")
            if isinstance(result, Quarantine):
                assert result.reason, f"{name} {r.record_key}: a quarantine names its reason"
                quarantined += 1
    # Every planted bad row, and the cut record, is quarantined; no other row is.
    assert quarantined == written["bad_rows"] + 1


def test_scripted_tp8_server_draws_lengths_and_counts_busy_slot_time(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("30\n50\n70\n")
    tokens_per_s, scale, slots = 100.0, 5.0, 2
    proc, url = spawn("--answer-lengths", str(lengths), "--tokens-per-s", str(tokens_per_s), "--slots", str(slots),
                      "--time-scale", str(scale), log_path=tmp_path / "server.log")
    try:
        prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(6)]

        async def ask():
            async with ServerPool([Endpoint(url, max_concurrency=6)], RetryPolicy()) as pool:
                return await asyncio.gather(*(pool.chat(p) for p in prompts))

        started = time.monotonic()
        results = asyncio.run(ask())
        wall = time.monotonic() - started
        metrics = httpx.get(url + "/metrics").json()
    finally:
        proc.kill()
        proc.wait()
    service = 0.0
    for p, r in zip(prompts, results):
        n = drawn_length(p, [30, 50, 70])
        assert r.content == long_answer(p, n) and len(r.content.split()) == n and r.finish_reason == "stop"
        service += n / tokens_per_s / scale
    assert metrics["completed"] == metrics["requests"] == 6 and metrics["busy_now"] == metrics["waiting"] == 0
    # Slot-time is at least what the answers needed, and no more than the slots could hold over the run.
    assert service <= metrics["busy_slot_s"] <= slots * wall
    # Six requests on two slots: four waited, so the run took at least three service rounds of the shortest.
    assert wall >= 3 * 30 / tokens_per_s / scale


def test_a_long_answer_is_cut_at_max_tokens_with_finish_reason_length(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("40\n")
    proc, url = spawn("--answer-lengths", str(lengths), "--time-scale", "1000", log_path=tmp_path / "server.log")
    try:
        body = httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 25}).json()
    finally:
        proc.kill()
        proc.wait()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["content"].split()) == 25
    assert choice["message"]["content"] == long_answer([{"role": "user", "content": "hi"}], 25)
