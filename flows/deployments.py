"""Prefect deployments of every flow and of the pipeline, as `eagle3 serve` registers them.

Owns the deployment names, their default parameters (the config file's sections, editable in the
Prefect UI's run form, which is rendered from the flows' typed parameters) and their schedules
(the nightly pipeline cron and any per-stage crons of `schedule:`). Promises: one deployment per
flow with a section in the config, plus `pipeline/<name>`; re-registering updates them in place.
"""

from __future__ import annotations

from prefect.schedules import Cron

from tasks.config import PipelineConfig


def _flows() -> dict:
    # imported here: building a deployment list should not cost every CLI command these imports
    from flows.benchmark import benchmark
    from flows.discover import discover
    from flows.extract import extract
    from flows.pipeline import pipeline
    from flows.regenerate import regenerate
    from flows.train import train

    return {"discover": discover, "regenerate": regenerate, "extract": extract, "train": train,
            "benchmark": benchmark, "pipeline": pipeline}


DESCRIPTIONS = {
    "discover": "Read the source catalog; keep new, clean, unique, uncontaminated prompts.",
    "regenerate": "Answer pending prompts with the target through the baseline server, exactly once.",
    "extract": "Tokenise with the serving template; fill the disk budget with hidden-state shards.",
    "train": "Train the EAGLE-3 draft on the next round of shards; export; free the shards.",
    "benchmark": "Check the serving contract, then measure acceptance against the baselines.",
    "pipeline": "Every stage in order, resuming from lineage: the nightly batch.",
}


def build_deployments(config: PipelineConfig, name: str) -> list:
    """RunnerDeployments named `<flow>/<name>` with the config's sections as default parameters."""
    flows = _flows()
    sched = config.schedule
    sections = {"discover": config.discover, "regenerate": config.regenerate, "extract": config.extract,
                "train": config.train, "benchmark": config.bench_section(), "pipeline": config}
    out = []
    for stage, section in sections.items():
        if section is None:
            continue
        cron = sched.cron if stage == "pipeline" else sched.stage_crons.get(stage)
        out.append(flows[stage].to_deployment(
            name=name,
            parameters={"config": section.model_dump(mode="json")},
            description=DESCRIPTIONS[stage],
            tags=["eagle3", f"workspace:{config.workspace}"],
            schedules=[Cron(cron, timezone=sched.timezone)] if cron else None,
        ))
    return out
