"""The mission's run at its real size, rehearsed on one machine: 10 sources, 1M+ records, 88K prompts.

Real parts wherever they can run here: `eagle3 discover` and `eagle3 regenerate` as the user runs
them (one process each, on a local Prefect API), the lineage DuckDB file, the generation Parquet
files. The target cannot run here, so the baseline servers are `serving.scripted_server` processes
on loopback that answer like a TP-8 Kimi-K2.5 SGLang server: each request holds one of S slots
for (answer length / 90 tok/s), answer lengths drawn from ShareGPT's real answers (characters / 4),
5% of requests faulted (500, 429 with Retry-After, connection reset, malformed or cut bodies, a
few hangs), requests beyond S queued. Time is compressed by `--time-scale F`: servers run F times
faster, and the client's time-based settings (backoff, timeouts, probe interval, outage window)
are divided by F too, so the ratios between them are the production config's.

Phases (each resumable; rerun the same command to continue):
1. sources: 10 catalogs in the formats users bring, 1M+ records (benchmarks/rehearsals/sources.py).
2. discover: `eagle3 discover` on all 10; wall time and peak memory (RSS of the process tree).
3. regenerate: `eagle3 regenerate` under a supervisor that kill -9s it `--kills` times at random
   moments and restarts it, stops every server for a 10-minute outage (compressed) and restarts
   the stage when it gives up on the outage; the servers' slot use is sampled every second.
4. verify and measure: lost / duplicated generations from the lineage store and every Parquet
   file, answers checked against the scripted servers' deterministic ones, the `progress` ETA
   against the actual finish, `eagle3 status`, `eagle3 sql` (README's example) and
   `eagle3 lineage` latency at this size (the checkpoint's lineage is registered through the
   store's own writes, every generation in one training run, since training here is not the point).

    .venv/bin/python -m benchmarks.rehearsals.scale                       # the full rehearsal (~1 h)
    .venv/bin/python -m benchmarks.rehearsals.scale --records 60000 --kills 2 --time-scale 200  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path

import yaml

from benchmarks.rehearsals.checks import eta_error, measure_queries, slot_use, verify
from benchmarks.rehearsals.processes import Servers, eagle3, start_stage
from benchmarks.rehearsals.sources import SOURCES, build_sources
from benchmarks.report import ROOT
from flows.prefect_api import start_local_api
from serving.llamacpp.server import free_port
from storage.studies import StudyReads

KIMI_TOKENS_PER_S = 90.0
FAULTS = {"fail-500": 0.02, "fail-429": 0.015, "reset": 0.0075, "malformed": 0.004, "truncated": 0.0033,
          "hang": 0.0002}  # 5% in all


# ---------------------------------------------------------------- config


def write_config(ws: Path, path: Path, endpoints: list[str], scale: float, slots: int, headroom: int) -> None:
    src_dir = ws / "sources"
    sources = []
    for name, file, fmt, _ in SOURCES:
        if file is None:
            sources.append({"name": name, "kind": "sharegpt_package"})
        else:
            sources.append({"name": name, "kind": "file", "path": str(src_dir / file), "format": fmt})
    path.write_text(yaml.safe_dump({
        "workspace": str(ws),
        "discover": {  # configs/kimi-k25.yaml's discover, on these sources
            "seed": 0, "sources": sources,
            "near_dedupe": {"shingle": "word", "ngram": 5, "num_perm": 128, "threshold": 0.8},
            "decontaminate": {"ngram": 13, "humaneval": True},
            "heldout": {"fraction": 0.01, "cap": 256},
            "write_batch_records": 20_000,
        },
        "regenerate": {  # configs/kimi-k25.yaml's regenerate, time-based settings divided by the scale
            "target_model": "moonshotai/Kimi-K2.5", "target_revision": "rehearsal", "served_model": "kimi-k2.5",
            "chat_template_id": "kimi-k2.5-hf-template", "mode": "all", "reasoning": "save",
            "sampling": {"temperature": 0.0, "max_tokens": 4096, "repeat_penalty": None},
            "endpoints": [{"url": u, "max_concurrency": slots + headroom} for u in endpoints],
            "retry": {"max_attempts": 8, "backoff_base_s": 0.5 / scale, "backoff_max_s": 60 / scale,
                      "read_timeout_s": 1800 / scale, "probe_interval_s": 10 / scale,
                      "outage_window_s": 300 / scale, "eject_after_failures": 5},
            "write_batch": 256,
        },
    }, sort_keys=False))


# ---------------------------------------------------------------- 3. regenerate under a supervisor


def progress_row(reads: StudyReads) -> dict | None:
    try:
        return reads.progress("regenerate")
    except Exception:  # the writer holds the file a moment; the next sample reads it
        return None


def supervise_regenerate(ws: Path, cfg: Path, env: dict, servers: Servers, kills: int, outage_s: float,
                         expected_s: float, rng: random.Random, timeline: Path) -> dict:
    reads = StudyReads(ws / "lineage.duckdb")
    kill_at = sorted(rng.uniform(0.05, 0.9) * expected_s for _ in range(kills))
    outage_at = 0.45 * expected_s
    events, runs = [], []
    t0 = time.monotonic()
    run = None
    next_progress = 0.0
    outage_until = None
    with open(timeline, "a") as tl:
        while True:
            now = time.monotonic() - t0
            if run is None:
                run = start_stage(eagle3("regenerate", "-c", str(cfg)), env, ws / "logs" / "regenerate.log")
                events.append({"t": now, "event": "start"})
            if outage_until is None and now >= outage_at:
                servers.kill()
                outage_until = now + outage_s
                events.append({"t": now, "event": "outage begins (every server killed)"})
            elif outage_until is not None and outage_until > 0 and now >= outage_until:
                servers.start()
                outage_until = -1.0
                events.append({"t": now, "event": "outage ends (servers restarted)"})
            if kill_at and now >= kill_at[0] and run.proc.poll() is None:
                kill_at.pop(0)
                os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait()
                runs.append({"ended": "kill -9", "seconds": time.monotonic() - run.started, "peak_rss": run.peak_rss,
                             "cpu_s": run.cpu_s})
                events.append({"t": now, "event": "kill -9"})
                run = None
                continue
            run.sample()
            rc = run.proc.poll()
            if rc is not None:
                runs.append({"ended": f"exit {rc}", "seconds": time.monotonic() - run.started,
                             "peak_rss": run.peak_rss, "cpu_s": run.cpu_s})
                events.append({"t": now, "event": f"exit {rc}"})
                run = None
                row = progress_row(reads)
                if rc == 0 and row is not None and not row["pending"]:
                    break
                time.sleep(1.0)  # a stage that gave up (an outage) is restarted, as a scheduler would
                continue
            sample = {"t": round(now, 2), "servers": servers.metrics() if servers.procs else None}
            if now >= next_progress:
                row = progress_row(reads)
                if row is not None:
                    sample["progress"] = {k: (str(v) if k == "eta" else v) for k, v in row.items()
                                          if k in ("done", "pending", "failed", "tokens", "rate_per_s", "eta")}
                    sample["eta_s"] = row["eta"].total_seconds() if row.get("eta") is not None else None
                next_progress = now + 15.0
            tl.write(json.dumps(sample, default=str) + "\n")
            tl.flush()
            time.sleep(1.0)
    return {"seconds": time.monotonic() - t0, "runs": runs, "events": events}


# ---------------------------------------------------------------- report


def gb(n: float) -> str:
    # Both units: the figures were once labelled GB while in GiB (7% apart at 4 GB).
    return f"{n / 2**30:.2f} GiB ({n / 1e9:.2f} GB)"


def report(state: dict) -> str:
    """The rehearsal as the tables benchmarks/README.md shows."""
    src, disc, reg, ver, qs = (state.get(k, {}) for k in ("sources", "discover", "regenerate", "verify", "queries"))
    out = ["| records in | kept | held out | exact dup | near dup | contaminated | quarantined | reconciles |",
           "|---:|---:|---:|---:|---:|---:|---:|---|"]
    o = disc.get("outcomes", {})
    total = sum(o.values())
    out.append(f"| {total:,} | {o.get('kept', 0):,} | {o.get('heldout', 0):,} | {o.get('exact_duplicate', 0):,} | "
               f"{o.get('near_duplicate', 0):,} | {o.get('contaminated', 0):,} | {o.get('quarantined', 0):,} | "
               f"{'yes' if total == src.get('records') else 'NO'} ({src.get('records', 0):,} written) |")
    out += ["", "| measure | value | target |", "|---|---:|---|"]
    rows = [
        ("discover: wall, CPU", f"{disc.get('seconds', 0):.0f} s, {disc.get('cpu_s', 0):.0f} s", ""),
        ("discover: peak memory (process tree)", gb(disc.get("peak_rss", 0)), ""),
    ]
    if reg:
        su = reg["slot_use"]
        kills = sum(1 for r in reg["runs"] if r["ended"] == "kill -9")
        gave_up = sum(1 for r in reg["runs"] if r["ended"] not in ("kill -9", "exit 0"))
        rows += [
            ("regenerate: prompts, requests, faults injected",
             f"{ver.get('kept_prompts', 0):,}, {reg['server_requests']:,}, {reg['server_faults']:,} "
             f"({reg['server_faults'] / max(1, reg['server_requests']):.1%})", ""),
            ("regenerate: wall (compressed x{:g}); unscaled".format(reg["scale"]),
             f"{reg['seconds'] / 60:.1f} min; {reg['seconds'] * reg['scale'] / 3600:.1f} h", "< 1 h"),
            ("kill -9 of the stage; stops on the outage (restarted)", f"{kills}; {gave_up}", ">= 5 kills"),
            ("lost generations", f"{ver.get('lost')}", "0"),
            ("duplicated generations (lineage; Parquet rows)",
             f"{ver.get('duplicated_rows_in_lineage')}; {ver.get('duplicated_rows_in_files')}", "0"),
            ("failed prompts (recorded with reason)", f"{ver.get('failed_prompts')}", ""),
            ("uncommitted files left on disk", f"{ver.get('files_unregistered_on_disk')}", "0"),
            ("answers checked against the server's / wrong",
             f"{ver.get('answers_checked', 0):,} / {ver.get('answers_wrong')}", "0 wrong"),
            ("client CPU per request", f"{reg['client_cpu_ms_per_request']:.2f} ms", ""),
            ("server slots busy, steady running", f"{su['busy_over_capacity_steady']:.3f}", ">= 0.95"),
            ("server slots busy, whole run without the outage", f"{su['busy_over_capacity_no_outage']:.3f}", ""),
            ("start-up and restart gaps (start, kill or exit to the next first request)",
             ", ".join(f"{g:.1f}" for g in su["restart_gaps_s"]) + " s", ""),
            ("regenerate: peak memory (process tree)", gb(reg["peak_rss"]), ""),
        ]
        for e in reg["eta"]:
            rows.append((f"`progress` ETA error at {e['done']:.0%} done",
                         f"{e['error']:+.0%} (ETA {e['eta_s']:.0f} s, actual {e['actual_remaining_s']:.0f} s)", ""))
    if qs:
        rows.append(("lineage database", gb(qs["lineage_db_bytes"]), ""))
        for name, r in qs["cli"].items():
            rows.append((f"`eagle3 {name}` wall", f"{r['median_s']:.2f} s" if "median_s" in r else "error", "< 2 s"))
        for name, sec in qs["query_s"].items():
            rows.append((f"query alone: {name}", f"{sec:.3f} s", ""))
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out)


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workspace", type=Path, default=ROOT / "runs" / "rehearsal")
    ap.add_argument("--records", type=int, default=1_050_000, help="records in the 10 sources together")
    ap.add_argument("--servers", type=int, default=2, help="scripted TP-8 servers")
    ap.add_argument("--slots", type=int, default=8, help="requests each server runs at once")
    ap.add_argument("--headroom", type=int, default=4, help="the client's max_concurrency over the slots")
    ap.add_argument("--time-scale", type=float, default=40.0, help="servers and client settings run this much faster")
    ap.add_argument("--kills", type=int, default=6, help="kill -9s of the regenerate stage")
    ap.add_argument("--outage-s", type=float, default=600.0, help="outage length before compression")
    ap.add_argument("--verify-files", type=int, default=40, help="generation files whose answers are checked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "scale_rehearsal.jsonl")
    ap.add_argument("--report", action="store_true", help="print the tables of the workspace's finished phases, and stop")
    args = ap.parse_args()
    if args.report:
        state = json.loads((args.workspace / "rehearsal.json").read_text())
        if "regenerate" in state and (args.workspace / "timeline.jsonl").exists():  # slot use as this code counts it
            reg = state["regenerate"]
            reg["slot_use"] = slot_use(args.workspace / "timeline.jsonl", reg["events"], reg["servers"] * reg["slots"])
        print(report(state))
        return 0

    ws = args.workspace.resolve()
    (ws / "logs").mkdir(parents=True, exist_ok=True)
    state_path = ws / "rehearsal.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}

    def save() -> None:
        state_path.write_text(json.dumps(state, indent=1, default=str))

    if "sources" not in state:
        t = time.perf_counter()
        state["sources"] = build_sources(ws / "sources", args.records, args.seed)
        state["sources"]["seconds"] = time.perf_counter() - t
        save()
    print("sources:", json.dumps(state["sources"]), flush=True)

    api_url, api_proc = start_local_api(ws / "prefect", port=free_port())
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PYTHONPATH": str(ROOT)}
    scale = args.time_scale
    ports = state.setdefault("ports", [free_port() for _ in range(args.servers)])
    faults = [x for name, share in FAULTS.items() for x in (f"--{name}", str(share))]
    servers = Servers(ports, ["--answer-lengths", str(ws / "sources" / "answer_lengths.txt"),
                              "--tokens-per-s", str(KIMI_TOKENS_PER_S), "--slots", str(args.slots),
                              "--time-scale", str(scale), "--retry-after", str(2.0 / scale), "--hang-s", "2400",
                              "--model", "kimi-k2.5", *faults], ws / "logs")
    cfg = ws / "rehearsal.yaml"
    write_config(ws, cfg, servers.urls, scale, args.slots, args.headroom)
    try:
        if "discover" not in state:
            run = start_stage(eagle3("discover", "-c", str(cfg)), env, ws / "logs" / "discover.log")
            while run.proc.poll() is None:
                run.sample()
                time.sleep(0.5)
            if run.proc.returncode:
                raise SystemExit(f"discover failed; see {ws / 'logs' / 'discover.log'}")
            reads = StudyReads(ws / "lineage.duckdb")
            state["discover"] = {"seconds": time.monotonic() - run.started, "peak_rss": run.peak_rss,
                                 "cpu_s": run.cpu_s, "outcomes": reads.outcome_counts(),
                                 "source_reads": reads.source_reads()}
            save()
        print("discover:", json.dumps(state["discover"], default=str), flush=True)

        if "regenerate" not in state:
            kept = StudyReads(ws / "lineage.duckdb").kept_records()
            lengths = [int(x) for x in (ws / "sources" / "answer_lengths.txt").read_text().split()]
            turns_per_prompt = 2.6  # measured below from the generations; this only sizes the plan
            expected = kept * turns_per_prompt * statistics.fmean(lengths) / KIMI_TOKENS_PER_S / scale / (
                args.servers * args.slots)
            print(f"regenerate: {kept} prompts, about {expected / 60:.0f} min at scale {scale:g} "
                  f"({expected * scale / 3600:.1f} h unscaled)", flush=True)
            servers.start()
            timeline = ws / "timeline.jsonl"
            timeline.unlink(missing_ok=True)
            sup = supervise_regenerate(ws, cfg, env, servers, args.kills, args.outage_s / scale, expected,
                                       random.Random(args.seed), timeline)
            final = servers.metrics()
            servers.kill()
            incarnations = [t["metrics"] for t in servers.totals]
            answered = sum(m["completed"] for inc in incarnations for m in inc if m)
            requests = sum(m["requests"] for inc in incarnations for m in inc if m)
            faults_n = sum(m["faults"] for inc in incarnations for m in inc if m)
            cpu = sum(r["cpu_s"] for r in sup["runs"])
            state["regenerate"] = {
                **sup, "expected_s": expected, "scale": scale, "servers": args.servers, "slots": args.slots,
                "server_requests": requests, "server_answers": answered, "server_faults": faults_n,
                "client_cpu_s": cpu, "client_cpu_ms_per_request": 1000 * cpu / max(1, requests),
                "peak_rss": max(r["peak_rss"] for r in sup["runs"]),
                "slot_use": slot_use(timeline, sup["events"], args.servers * args.slots),
                "eta": eta_error(timeline, sup["seconds"]), "final_metrics": final,
            }
            save()
        print("regenerate:", json.dumps({k: v for k, v in state["regenerate"].items() if k != "events"},
                                        default=str)[:3000], flush=True)

        if "verify" not in state:
            state["verify"] = verify(ws, args.verify_files, args.seed)
            save()
        print("verify:", json.dumps(state["verify"]), flush=True)
        if "queries" not in state:
            state["queries"] = measure_queries(ws, cfg, env)
            save()
        print("queries:", json.dumps(state["queries"], default=str), flush=True)
    finally:
        if servers.procs:
            servers.kill()
        if api_proc is not None:
            os.killpg(api_proc.pid, signal.SIGTERM)
    print(report(state))
    state["date"] = time.strftime("%Y-%m-%d")
    state["args"] = {k: str(v) for k, v in vars(args).items()}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(state, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
