"""The `train` flow: the EAGLE-3 draft trained on the next rounds of extracted shards (or online).

Orchestration only: one training per workspace at a time, the run's lineage row, progress, table
and markdown (PNG curves) artifacts. The training itself (resume, rounds, epochs, checkpoints,
exports, freeing consumed shards) is `run_training` in tasks/train/loop.py: under torchrun rank 0
runs this flow and the other ranks call `run_training` directly (flows/cli.py).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)

from flows.runinfo import lineage_run
from storage.lineage import LineageStore
from storage.locks import stage_lock
from tasks.config import TrainConfig
from tasks.train.loop import TrainSummary, dist_from_env, run_training


@flow(name="train", log_prints=True)
def train(config: TrainConfig) -> TrainSummary:
    """Train (or continue training) the named EAGLE-3 draft on the next round of shards."""
    logger = get_run_logger()
    ws = Path(config.workspace)
    with stage_lock(ws, "train"):
        store = LineageStore(ws / "lineage.duckdb")
        with lineage_run(store, "train", config) as run:
            dist = dist_from_env()
            summary = run_training(config, store, run.run_id, dist, logger, _progress_artifact() if dist.main else None)
            run.summary = asdict(summary)
    _artifacts(summary, store)
    return summary


def _progress_artifact() -> Callable[[float], None]:
    """The Prefect progress artifact of the run's training steps, as the loop's progress callback."""
    artifact_id = create_progress_artifact(0.0, key="train-progress", description="train: steps of the round")
    return lambda percent: update_progress_artifact(artifact_id, progress=percent)


def curves_png(metrics: list[dict], path: Path) -> Path:
    """Loss and per-step accuracy curves of a run, as a PNG a person can glance at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    ax1.plot(steps, [m["loss"] for m in metrics])
    ax1.set_title("weighted TTT loss")
    ax1.set_xlabel("step")
    k = len(metrics[0]["accuracy"])
    for i in range(k):
        ax2.plot(steps, [m["accuracy"][i] for m in metrics], label=f"step {i}")
        ax3.plot(steps, [m["conditional_accuracy"][i] for m in metrics], label=f"step {i}")
    ax2.set_title("accuracy per TTT step")
    ax3.set_title("conditional accuracy (predicts acceptance)")
    for ax in (ax2, ax3):
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _artifacts(summary: TrainSummary, store: LineageStore) -> None:
    metrics = store.training.metrics(summary.run_name)
    table = [{"what": k, "value": json.dumps(v) if isinstance(v, (list, dict)) else v}
             for k, v in asdict(summary).items()]
    create_table_artifact(key="train-summary", table=table, description=f"train run {summary.run_name}")
    if metrics:
        path = curves_png(metrics, store.path.parent / "reports" / "train" / f"{summary.run_name}-curves.png")
        summary.curves_png = str(path)
        data = base64.b64encode(path.read_bytes()).decode()
        create_markdown_artifact(key="train-curves", markdown=f"# {summary.run_name}\n\n"
                                 f"![loss and accuracy curves](data:image/png;base64,{data})\n\nPNG: `{path}`")
