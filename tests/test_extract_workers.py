"""Extraction on two local Dask worker processes (prefect-dask) against the in-process path: the same
records bit for bit, each generation exactly once, two real worker processes, the disk budget held
across rounds while several shards are in flight, a crash between a worker's write and the flow's
commit repaired by the next run; and the worker-side target cache (one load per identity, checked).

The tiny random target (see helpers.make_tiny_target) keeps each worker's model load well under a
second; most of the time is the two worker processes importing torch and Prefect.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import tasks.extract.fill
from flows.extract import extract
from storage.datasets import file_sha256
from storage.lineage import LineageStore
from storage.shards import ShardStore
from tasks.extract import shard_job
from tasks.config import TargetConfig
from tasks.extract.hf_backend import RECORD_KEYS, ExtractSettings
from tasks.extract.plan import delete_consumed_shards, read_shard
from tasks.extract.shard_job import ShardJob, WorkerSpec, run_shard_job_on_worker
from tasks.model.target import load_configured_target
from tasks.extract.vocab import build_draft_vocab, save_vocab

from helpers import conversations, extract_config, import_generations
from test_extract_flow import assert_exactly_once, sample_rows

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`


def records_by_generation(workspace: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every stored record's tensors, keyed by generation id (read back through the checksums)."""
    store = LineageStore(workspace / "lineage.duckdb")
    gen_of = {r[4]: r[0] for r in sample_rows(store) if r[1] == "extracted"}
    shards = ShardStore(workspace / "shards", 1 << 40)
    out = {}
    for name, row in store.extraction.live_shards().items():
        records, ids, _ = read_shard(shards, name, row["sha256"])
        for sid, rec in zip(ids, records):
            out[gen_of[sid]] = {k: getattr(rec, k) for k in RECORD_KEYS if getattr(rec, k) is not None}
    return out


def test_two_workers_store_the_same_records_as_one_process(prefect_api, tmp_path, tiny_target):
    convs = conversations(12, seed=11)
    ws1, ws2 = tmp_path / "one", tmp_path / "two"
    for ws in (ws1, ws2):
        ws.mkdir()
        assert import_generations(ws, tmp_path, convs) == 12
    # fp8 + top-k: the option with the most tensors (scales, ids, log-probs, argmax bits)
    opts = {"storage": "fp8", "teacher": "topk", "topk": 8, "shard_bytes": 100_000}
    one = extract(extract_config(ws1, tiny_target, **opts))
    two = extract(extract_config(ws2, tiny_target, workers=2, **opts))

    assert (one.workers, two.workers) == (1, 2)
    assert one.worker_pids == [os.getpid()]
    # Two worker processes did the work, neither of them this one.
    assert len(two.worker_pids) == 2 and os.getpid() not in two.worker_pids
    assert two.shards_written >= 3 and two.stopped_by == "done"
    for s in (one, two):
        assert (s.extracted, s.quarantined, s.skipped, s.pending_at_start) == (12, 0, 0, 12)
    assert (two.tokens, two.masked_tokens, two.bytes_written) == (one.tokens, one.masked_tokens, one.bytes_written)
    store = LineageStore(ws2 / "lineage.duckdb")
    assert_exactly_once(ws2, store, 12)
    _, progress = store.reports.progress()
    assert next(r for r in progress if r[0] == "extract")[1:4] == (12, 0, 0)  # done, pending, failed

    a, b = records_by_generation(ws1), records_by_generation(ws2)
    assert sorted(a) == sorted(b) and len(a) == 12
    for gid in a:
        assert a[gid].keys() == b[gid].keys()
        for k in a[gid]:
            assert a[gid][k].dtype == b[gid][k].dtype
            assert torch.equal(a[gid][k].view(torch.uint8), b[gid][k].view(torch.uint8)), (gid, k)


def test_two_workers_hold_the_disk_budget_and_survive_a_crash_between_write_and_commit(
        prefect_api, tmp_path, workspace, tiny_target, monkeypatch):
    n = import_generations(workspace, tmp_path, conversations(16, seed=12))
    # ~130 KB a sample: shards of one or two samples, about nine samples a round (each run with
    # workers starts its own two processes: ~10 s on two cores, so few runs).
    budget = 1_200_000
    cfg = extract_config(workspace, tiny_target, workers=2, disk_budget_bytes=budget, shard_bytes=280_000)
    store = LineageStore(workspace / "lineage.duckdb")
    shards = ShardStore(workspace / "shards", budget)

    # The real peak: a thread polls the folder (temporaries included) while the workers write.
    peak, stop = [0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], shards.used_bytes())
            except FileNotFoundError:  # a temporary renamed between listing and stat
                pass
            stop.wait(0.005)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        # 1. The flow dies after a worker wrote its second shard, before committing it.
        real_commit, commits = tasks.extract.fill._commit, []

        def dying_commit(*args, **kwargs):
            commits.append(1)
            if len(commits) == 2:
                raise RuntimeError("simulated crash between shard write and lineage commit")
            return real_commit(*args, **kwargs)

        monkeypatch.setattr(tasks.extract.fill, "_commit", dying_commit)
        with pytest.raises(RuntimeError, match="simulated crash"):
            extract(cfg)
        monkeypatch.setattr(tasks.extract.fill, "_commit", real_commit)
        assert len(store.extraction.live_shards()) == 1
        assert len(list(shards.folder.iterdir())) >= 2  # the uncommitted file(s) the workers left

        # 2. The next run removes them, extracts their samples again, and stops at the budget.
        first = extract(cfg)
        assert first.removed_leftovers >= 1
        assert first.stopped_by == "budget" and first.shards_written >= 3 and len(first.worker_pids) == 2
        assert first.peak_disk_bytes <= budget and shards.used_bytes() <= budget
        assert_exactly_once(workspace, store, len(sample_rows(store)))
        round_one = set(store.extraction.live_shards())

        # 3. A training run reads the round and frees it; the next extract continues and finishes.
        store.extraction.mark_shards_read("train-test", sorted(round_one), epoch=0)
        assert len(delete_consumed_shards(store, shards)) == len(round_one)
        last = extract(cfg)
        assert last.stopped_by == "done" and last.peak_disk_bytes <= budget and shards.used_bytes() <= budget
        assert not set(store.extraction.live_shards()) & round_one
    finally:
        stop.set()
        watcher.join()
    assert peak[0] <= budget, f"the shard folder reached {peak[0]} B, budget {budget} B"
    rows = sample_rows(store)
    assert len(rows) == len({r[0] for r in rows}) == n  # every generation exactly once across rounds
    assert {r[1] for r in rows} == {"extracted"}
    assert_exactly_once_in_lineage(store, n)


def assert_exactly_once_in_lineage(store: LineageStore, n: int) -> None:
    """Across rounds (deleted shards included): every extracted sample has one (shard, slot), none shared."""
    _, rows = store.reports.query_readonly("SELECT shard, shard_index FROM samples WHERE outcome = 'extracted'")
    assert len(rows) == len(set(rows)) == n


def test_a_worker_loads_its_target_once_and_refuses_another_one(tmp_path, tiny_target, monkeypatch):
    """The worker-side cache, in this process (no cluster): one load per identity, checked."""
    target = TargetConfig(model_path=str(tiny_target), dtype="float32", device="cpu")
    _, tokenizer, identity = load_configured_target(None, str(tiny_target), dtype="float32", device="cpu")
    counts = torch.zeros(len(tokenizer), dtype=torch.int64).numpy()
    counts[:64] = 1
    vocab_path = save_vocab(build_draft_vocab(counts, 32), tmp_path / "vocab.safetensors")
    settings = ExtractSettings(aux_layer_ids=[1, 3, 4])
    spec = WorkerSpec(target=target, backend="hf", settings=settings, max_batch_tokens=256,
                      vocab_path=str(vocab_path), vocab_sha256=file_sha256(vocab_path),
                      identity=(identity.name, identity.revision, identity.template_id), threads=1)
    loads = []
    real = shard_job.load_configured_target

    def counting(*a, **k):
        loads.append(a)
        return real(*a, **k)

    monkeypatch.setattr(shard_job, "load_configured_target", counting)
    monkeypatch.setattr(shard_job, "_EXTRACTORS", {})
    threads = torch.get_num_threads()
    try:
        for i in range(2):
            job = ShardJob(name=f"w-{i}.safetensors", extract_key="k", settings=settings, sample_ids=[f"s{i}"],
                           samples=[([1, 2, 3, 4 + i], [0, 1, 1, 1])])
            out = run_shard_job_on_worker(spec, str(tmp_path / "shards"), 1 << 30, job)
            assert out.pid == os.getpid() and out.kept == [0] and out.reasons == [None] and out.shard.bytes > 0
        assert len(loads) == 1 and len(shard_job._EXTRACTORS) == 1 and torch.get_num_threads() == 1

        # Another model under the flow's expectations (a worker seeing a different file): refused.
        wrong = WorkerSpec(**{**spec.__dict__, "identity": (identity.name, "other-revision", identity.template_id)})
        with pytest.raises(RuntimeError, match="the flow tokenised for"):
            run_shard_job_on_worker(wrong, str(tmp_path / "shards"), 1 << 30, job)
        assert len(loads) == 2 and not shard_job._EXTRACTORS  # the old target was released first
    finally:
        torch.set_num_threads(threads)
