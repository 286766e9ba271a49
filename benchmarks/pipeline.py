"""The pipeline against the alternative a user would pick: the same stages run one command at a time.

Both sides run the same small slice of the embedded default (real ShareGPT records, the llama.cpp
server on SmolLM2, SmolLM2 hidden states, training, the HumanEval benchmark) in fresh workspaces on
the same Prefect API: `eagle3 run` once, against `eagle3 discover`, `regenerate`, `extract`,
`train`, `bench` in sequence (one process each, as the README's stage commands). Reports the wall
seconds of each side, per stage where the pipeline records them, and the ratio; then a second
`eagle3 run` on the finished workspace (the cost of "resume when everything is done").

    .venv/bin/python -m benchmarks.pipeline [--records 12] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


from benchmarks.report import ROOT, load, table
from serving.llamacpp.server import free_port
from storage.studies import StudyReads


def config(ws: Path, path: Path, records: int, max_tokens: int) -> Path:
    path.write_text(yaml.safe_dump({
        "workspace": str(ws),
        "discover": {"sources": [{"name": "sharegpt", "kind": "sharegpt_package", "limit": records}]},
        "regenerate": {"target_model": "SmolLM2-135M-Instruct", "embedded_server": {"port": free_port(), "n_ctx": 2048},
                       "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "repeat_penalty": 1.0}},
        "extract": {"max_length": 512, "draft_vocab_size": 1024, "disk_budget_bytes": 64 * 2**20,
                    "shard_bytes": 8 * 2**20},
        "train": {"run_name": "bench", "ttt_steps": 3, "epochs": 1, "batch_tokens": 1024, "lr": 3e-4},
        "benchmark": {"draft_tokens": 3, "max_new_tokens": 16, "prompts_per_domain": 2},
    }))
    return path


def cli(cfg: Path, *args: str) -> float:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "flows.cli", *args, "-c", str(cfg)], cwd=ROOT, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(f"eagle3 {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=24)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    print(f"load before: {load()}")
    # the stage commands one by one, first (so the GGUF conversion cache is warm for both sides)
    steps_cfg = config(tmp / "steps", tmp / "steps.yaml", a.records, a.max_tokens)
    per_stage = {s: cli(steps_cfg, s) for s in ("discover", "regenerate", "extract", "train", "bench")}
    steps_total = sum(per_stage.values())

    run_cfg = config(tmp / "run", tmp / "run.yaml", a.records, a.max_tokens)
    run_total = cli(run_cfg, "run")
    again = cli(run_cfg, "run")
    stages = StudyReads(tmp / "run" / "lineage.duckdb").first_completed_summary("pipeline")["stages"]
    inside = {s["stage"].split(" ")[0].replace("benchmark", "bench"): s["seconds"] for s in stages}
    rows = [[s, f"{per_stage[s]:.1f}", f"{inside.get(s, 0):.1f}"] for s in per_stage]
    rows.append(["total (wall, process start included)", f"{steps_total:.1f}", f"{run_total:.1f}"])
    table(f"pipeline vs stage commands: {a.records} ShareGPT records, answers <= {a.max_tokens} tokens, load {load()}",
          ["stage", "one command per stage (s)", "eagle3 run, inside the flow (s)"], rows)
    table("ratios", ["what", "value"], [
        ["eagle3 run / stage commands (wall)", f"{run_total / steps_total:.2f}x"],
        ["eagle3 run again on a finished workspace (s)", f"{again:.1f}"],
        ["... / first run", f"{again / run_total:.2f}x"],
    ])


if __name__ == "__main__":
    main()
