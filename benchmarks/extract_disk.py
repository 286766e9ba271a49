"""Part 3 of the extraction benchmark (benchmarks/extract.py): peak disk of the real `extract` flow against its
budget, round after round, the shard folder polled every 5 ms (temporaries included).

Promises: the flow runs as a user runs it (its own config, lineage and shard store); between rounds the
written shards are marked read and deleted as a training run would, and the next pending sample's shard
size is reported so a round that stopped on the budget can be checked to have stopped only when it must.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from storage.shards import ShardStore
from tasks.extract.hf_backend import ExtractSettings
from tasks.extract.plan import predicted_shard_bytes
from tasks.ids import generation_id, sample_id
from tasks.model.target import TargetIdentity

class FolderPeak:
    """A thread that polls a folder's total file bytes (temporaries included) and keeps the max."""

    def __init__(self, folder: Path, every_s: float = 0.005) -> None:
        self.folder, self.every, self.peak = folder, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _size(self) -> int:
        total = 0
        try:
            with os.scandir(self.folder) as it:
                for e in it:
                    try:
                        if e.is_file():
                            total += e.stat().st_size
                    except FileNotFoundError:
                        pass
        except FileNotFoundError:
            pass
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._size())
            time.sleep(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._size())


def run_flow_rounds(records: list, tokens_of_prompt: dict[str, int], data_bytes: int, largest_sample_bytes: int,
                    budget_share: float, tmp: Path, identity: TargetIdentity, hidden_size: int,
                    max_length: int, prefect_home: Path | None) -> dict:
    """Part 3: the extract flow round after round under a disk budget, each round's shards consumed and
    deleted as training would; `prefect_home`: start a local Prefect API there (else PREFECT_API_URL's)."""
    from flows.extract import extract
    from flows.prefect_api import api_healthy, start_local_api
    from flows.regenerate import regenerate
    from storage.lineage import LineageStore
    from storage.studies import StudyReads
    from tasks.config import ExtractConfig, RegenerateConfig
    from tasks.extract.plan import delete_consumed_shards

    url = os.environ["PREFECT_API_URL"]
    proc = None
    t0 = time.perf_counter()
    if prefect_home is not None:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        url, proc = start_local_api(prefect_home, port)
        how = f"local server started in {time.perf_counter() - t0:.1f}s (PREFECT_HOME {prefect_home})"
    else:
        if not api_healthy(url):
            raise RuntimeError(f"PREFECT_API_URL={url} does not answer /health")
        how = "existing PREFECT_API_URL"
    print(f"Prefect API {url}: {how}", flush=True)
    try:
        ws = tmp / "flow-ws"
        ws.mkdir()
        src = tmp / "sharegpt-head.jsonl"
        src.write_text("".join(json.dumps(r.data) + "\n" for r in records))
        t1 = time.perf_counter()
        reg = regenerate(RegenerateConfig(workspace=str(ws), target_model=identity.name,
                                          target_revision=identity.revision,
                                          imports=[{"name": "sharegpt-head", "path": str(src)}]))
        print(f"imported {reg.imported} finished generations from {len(records)} ShareGPT records "
              f"in {time.perf_counter() - t1:.1f}s", flush=True)
        budget = max(int(data_bytes * budget_share), int(largest_sample_bytes * 1.25))
        shard_bytes = budget // 4
        cfg = ExtractConfig.model_validate({"workspace": str(ws), "max_length": max_length,
                                            "disk_budget_bytes": budget, "shard_bytes": shard_bytes})
        store = LineageStore(ws / "lineage.duckdb")
        shard_dir = ws / "shards"
        shards = ShardStore(shard_dir, budget)

        def next_shard_bytes(ekey: str, settings: ExtractSettings) -> int | None:
            """The shard the head of the pending queue would need on its own (what the planner checks),
            from this benchmark's own rendering of the same conversation."""
            for gid, params_key, _ in store.extraction.pending_generations(ekey, cfg.generation_params_keys, None):
                n = next((t for p, t in tokens_of_prompt.items() if generation_id(p, params_key) == gid), None)
                if n is not None:  # None: a conversation that yields no sample (the flow skips it too)
                    return predicted_shard_bytes([n], [sample_id(gid, ekey)], ekey, settings, hidden_size)
            return None

        rows = []
        for rnd in range(1, 51):
            w0 = time.perf_counter()
            with FolderPeak(shard_dir) as poll:
                s = extract(cfg)
            wall = time.perf_counter() - w0
            live = store.extraction.live_shards()
            rows.append({"round": rnd, "shards": s.shards_written, "samples": s.extracted, "tokens": s.tokens,
                         "flow_peak": s.peak_disk_bytes, "polled_peak": poll.peak, "used_end": shards.used_bytes(),
                         "stopped_by": s.stopped_by, "seconds": wall, "next_bytes": None})
            if s.stopped_by != "budget":
                break
            if s.shards_written == 0:
                raise RuntimeError(f"round {rnd} stopped on the budget without writing a shard: budget too small")
            settings = ExtractSettings(aux_layer_ids=s.aux_layer_ids, teacher=cfg.teacher, topk=cfg.topk,
                                       storage=cfg.storage)
            rows[-1]["next_bytes"] = next_shard_bytes(s.extract_key, settings)
            store.extraction.mark_shards_read("bench-train", sorted(live), epoch=0)
            deleted = delete_consumed_shards(store, shards)
            assert len(deleted) == len(live) and shards.used_bytes() == 0, (deleted, live)
        reads = StudyReads(store)
        return {"budget": budget, "shard_bytes": shard_bytes, "rounds": rows, "imported": reg.imported,
                "outcomes": reads.sample_outcomes(), "duplicate_samples": reads.duplicate_samples()}
    finally:
        if proc is not None:
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=10)
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
