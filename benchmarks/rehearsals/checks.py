"""The scale rehearsal's checks after the run: slot use and ETA error from the timeline, lost or duplicated
generations from the lineage store and the Parquet files, and how long the user's lineage commands and
queries take at the mission's size.

Promises: every check reads what the run left (timeline, lineage, files) and changes nothing, except
`register_checkpoint_lineage`, which writes one synthetic training run and checkpoint through the store's
own methods so that lineage queries are timed on lineage of the mission's size.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks.rehearsals.processes import eagle3
from benchmarks.report import ROOT
from serving.scripted_server import long_answer
from storage.lineage import LineageStore
from storage.studies import README_OUTCOMES_SQL, StudyReads


def slot_use(timeline: Path, events: list[dict], slots_total: int) -> dict:
    """Busy slot-seconds over capacity, from the servers' own counters sampled each second.

    Each sampled second is one of: the outage (servers down), a restart gap (from a stage's kill or
    exit until the next process's first request reaches a server: the kill, Prefect's start-up,
    loading the pending prompts), or steady running. A killed client's in-flight requests still
    run to the end on the servers, so the first part of a gap can look busy: that work is wasted,
    and it is counted as busy. Utilisation is reported for the whole run, without the outage, and
    steady; with every restart gap's length.
    """
    samples = [json.loads(line) for line in timeline.read_text().splitlines()]
    outages, gap_events = [], []
    for e in events:
        if e["event"].startswith("outage begins"):
            outages.append([e["t"], float("inf")])
        elif e["event"].startswith("outage ends") and outages:
            outages[-1][1] = e["t"]
        elif e["event"] == "kill -9" or e["event"].startswith("exit") or (e["event"] == "start" and e["t"] == 0):
            gap_events.append(e["t"])
    acc = {k: [0.0, 0.0] for k in ("all", "no_outage", "steady", "outage", "restart_gap")}
    gaps = []
    prev = None
    gap_from, gap_requests = None, None  # an open gap: when it began, the servers' request count then
    for s in samples:
        t = s["t"]
        while gap_events and gap_events[0] <= t:
            t_gap = gap_events.pop(0)
            if gap_from is None:
                gap_from, gap_requests = t_gap, None
        ms = s.get("servers")
        up = bool(ms) and all(m is not None for m in ms)
        requests = sum(m["requests"] for m in ms) if up else None
        if gap_from is not None and up:
            if gap_requests is None or requests < gap_requests:  # first look, or servers restarted since
                gap_requests = requests
            elif requests > gap_requests:  # the new process's first request arrived
                gaps.append(t - gap_from)
                gap_from = None
        if prev is not None and up:
            total = sum(m["busy_slot_s"] for m in ms)
            b, dt = total - prev[1], t - prev[0]
            if b >= 0:
                kinds = ["all"]
                if any(a <= t <= z for a, z in outages):
                    kinds.append("outage")
                else:
                    kinds += ["no_outage", "restart_gap" if gap_from is not None else "steady"]
                for k in kinds:
                    acc[k][0] += b
                    acc[k][1] += dt * slots_total
        prev = (t, sum(m["busy_slot_s"] for m in ms)) if up else None
    out = {f"busy_over_capacity_{k}": (b / c if c else None) for k, (b, c) in acc.items()}
    out.update({f"seconds_{k}": c / slots_total for k, (_, c) in acc.items()})
    out["restart_gaps_s"] = gaps
    return out


def eta_error(timeline: Path, finished_at: float) -> list[dict]:
    out = []
    samples = [json.loads(line) for line in timeline.read_text().splitlines()]
    with_eta = [s for s in samples if s.get("eta_s") is not None and s.get("progress")]
    for frac in (0.1, 0.25, 0.5, 0.75, 0.9):
        for s in with_eta:
            p = s["progress"]
            total = (p["done"] or 0) + (p["pending"] or 0) + (p["failed"] or 0)
            if total and (p["done"] or 0) / total >= frac:
                predicted = s["t"] + s["eta_s"]
                out.append({"done": frac, "at_s": s["t"], "eta_s": s["eta_s"], "actual_remaining_s": finished_at - s["t"],
                            "error": (predicted - finished_at) / (finished_at - s["t"]) if finished_at > s["t"] else None})
                break
    return out


def verify(ws: Path, sample: int, seed: int) -> dict:
    reads = StudyReads(ws / "lineage.duckdb")
    kept = reads.kept_prompts()
    gens, distinct = reads.generation_counts()
    failed = reads.failed_prompts()
    pending = reads.progress("regenerate")["pending"]
    files = reads.generation_files()
    gen_dir = next((ws / "data" / "generations").iterdir())
    on_disk = {p.name for p in gen_dir.glob("*.parquet")}
    registered = {f for f, _ in files}
    rows_in_files, ids = 0, set()
    dup_rows = 0
    rng = random.Random(seed)
    checked, wrong = 0, 0
    for f in sorted(registered):
        t = pq.read_table(gen_dir / f, columns=["generation_id", "messages", "turns"] if sample else ["generation_id"])
        gid = t.column("generation_id").to_pylist()
        rows_in_files += len(gid)
        for g in gid:
            dup_rows += g in ids
            ids.add(g)
        if sample and rng.random() < sample / max(1, len(files)):  # whole files, at random, about `sample` of them
            for messages, turns in zip(t.column("messages").to_pylist(), t.column("turns").to_pylist()):
                ctx, n = [], 0
                for m in messages:
                    if m["role"] == "assistant":
                        want = long_answer(ctx, turns[n]["completion_tokens"])
                        checked += 1
                        wrong += m["content"] != want
                        n += 1
                    ctx.append({"role": m["role"], "content": m["content"]})
    return {"kept_prompts": kept, "generations": gens, "distinct_generations": distinct, "failed_prompts": failed,
            "pending": pending, "lost": kept - gens - failed if not pending else None,
            "duplicated_rows_in_lineage": gens - distinct, "rows_in_files": rows_in_files,
            "duplicated_rows_in_files": dup_rows, "files_registered": len(registered),
            "files_unregistered_on_disk": len(on_disk - registered), "answers_checked": checked, "answers_wrong": wrong}


def timed_cli(args: list[str], env: dict, repeats: int = 3) -> dict:
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        r = subprocess.run(eagle3(*args), cwd=ROOT, env=env, capture_output=True, text=True)
        walls.append(time.perf_counter() - t)
        if r.returncode:
            return {"error": (r.stdout + r.stderr)[-800:], "seconds": walls}
    return {"median_s": statistics.median(walls), "seconds": walls}


def timed_query(query: Callable[[], object], repeats: int = 3) -> float:
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        query()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def register_checkpoint_lineage(ws: Path) -> str:
    """Every generation as one extracted sample of one training run's round, and a checkpoint of it.

    Written through the store's own methods (as extract and train write them), so `eagle3 lineage`
    and `checkpoint_lineage` are timed on lineage of the mission's size; no states are computed.
    """
    store = LineageStore(ws / "lineage.duckdb")
    reads = StudyReads(store)
    if reads.has_checkpoint("rehearsal-ckpt"):
        return "rehearsal-ckpt"
    run_id = store.runs.begin("extract", {"rehearsal": True}, "rehearsal", None, None)
    rows = reads.generation_completion_tokens()
    shards = []
    per_shard = 2048
    for s in range(0, len(rows), per_shard):
        chunk = rows[s : s + per_shard]
        shard = f"rehearsal-{s // per_shard:05d}"
        shards.append(shard)
        tokens = sum(int(t) for _, t in chunk)
        store.extraction.write_batch(run_id, {"shard": shard, "extract_key": "rehearsal", "bytes": 0, "sha256": "-",
                                           "samples": len(chunk), "tokens": tokens, "masked_tokens": tokens}, [
            {"sample_id": hashlib.sha256(g.encode()).hexdigest()[:32], "generation_id": g, "extract_key": "rehearsal",
             "outcome": "extracted", "reason": None, "tokens": int(t), "masked_tokens": int(t), "truncated_tokens": 0,
             "id_check": "not_checked", "id_mismatch": None, "shard": shard, "shard_index": n}
            for n, (g, t) in enumerate(chunk)])
    store.runs.finish(run_id, "COMPLETED", {})
    run_id = store.runs.begin("train", {"rehearsal": True}, "rehearsal", None, None)
    store.training.register_run(run_id, {"run_name": "rehearsal", "mode": "offline", "extract_key": "rehearsal",
                                      "vocab_id": "rehearsal", "target": "moonshotai/Kimi-K2.5",
                                      "target_revision": "rehearsal", "draft_config": {}, "train_config": {}})
    store.training.write_round(run_id, "rehearsal", 0, shards, len(rows), 1, 1)
    store.checkpoints.register(run_id, {"checkpoint": "rehearsal-ckpt", "run_name": "rehearsal", "step": 1,
                                       "format": "sglang", "path": str(ws / "checkpoints" / "rehearsal"),
                                       "sha256": "-", "rounds": 1, "target": "moonshotai/Kimi-K2.5",
                                       "target_revision": "rehearsal", "aux_layer_ids": [1, 29, 57],
                                       "vocab_id": "rehearsal", "extract_key": "rehearsal"})
    store.runs.finish(run_id, "COMPLETED", {})
    return "rehearsal-ckpt"


def measure_queries(ws: Path, cfg: Path, env: dict) -> dict:
    ckpt = register_checkpoint_lineage(ws)
    reads = StudyReads(ws / "lineage.duckdb")
    db = ws / "lineage.duckdb"
    return {
        "lineage_db_bytes": db.stat().st_size + sum(p.stat().st_size for p in ws.glob("lineage.duckdb.wal")),
        "cli": {
            "status": timed_cli(["status", "-c", str(cfg)], env),
            f"lineage {ckpt}": timed_cli(["lineage", ckpt, "-c", str(cfg)], env),
            "sql (README example)": timed_cli(["sql", README_OUTCOMES_SQL, "-c", str(cfg)], env),
            "--help (start-up alone)": timed_cli(["--help"], env),
        },
        "query_s": {
            "progress view": timed_query(reads.progress),
            "checkpoint_lineage (count)": timed_query(lambda: reads.checkpoint_lineage_count(ckpt)),
            "README example": timed_query(lambda: reads.rows(README_OUTCOMES_SQL)),
        },
    }
