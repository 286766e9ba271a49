"""The `probe` flow: the latest export's acceptance per cluster, for acceptance-aware selection.

Orchestration only: pick the latest SGLang export in lineage, skip it if this tagger already probed
it, load the target and the draft (the serving contract check first, in `load_draft_for_target`),
measure (tasks/evaluate/probe.py) and store the rows in `probe_results`, with a Prefect table artifact. The
next `regenerate` with `selection: acceptance` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.runinfo import lineage_run
from storage.lineage import LineageError, LineageStore
from tasks.config import ProbeConfig
from tasks.discover.domains import TAGGER


@dataclass
class ProbeSummary:
    probe_id: str | None = None
    export_dir: str | None = None
    skipped: str | None = None
    rows: list[dict] = field(default_factory=list)


@flow(name="probe", log_prints=True)
def probe(config: ProbeConfig) -> ProbeSummary:
    """Measure the latest export's acceptance per cluster on held-out prompts the benchmark does not use."""
    logger = get_run_logger()
    store = LineageStore(Path(config.workspace) / "lineage.duckdb")
    with lineage_run(store, "probe", config) as run:
        summary = _probe(config, store, run.run_id, logger)
        run.summary = {"probe_id": summary.probe_id, "export_dir": summary.export_dir, "skipped": summary.skipped}
    return summary


def _probe(config: ProbeConfig, store: LineageStore, run_id: str, logger) -> ProbeSummary:
    from tasks.evaluate.offline import load_draft_for_target
    from tasks.evaluate.probe import measure_probe, probe_sets
    from tasks.model.target import load_configured_target

    row = store.checkpoints.find(fmt="sglang")
    if row is None:
        raise LineageError("no exported draft to probe: run `eagle3 train` first")
    summary = ProbeSummary(export_dir=row["path"])
    already = store.selection.probed(row["path"], TAGGER)
    if already:
        summary.skipped = f"export {row['path']} already probed ({already})"
        summary.probe_id, summary.rows = already, store.selection.latest_probe(TAGGER, already)  # that probe's, not a newer one's
        logger.info(summary.skipped)
        return summary
    sets = probe_sets(store.selection.heldout_tagged(TAGGER), config.skip_first, config.per_cluster)
    if not sets:
        summary.skipped = (f"no held-out prompt past the benchmark's first {config.skip_first}: hold out more "
                           "(discover.heldout) to probe")
        logger.warning(summary.skipped)
        return summary
    t = config.target
    model, tokenizer, identity = load_configured_target(t.gguf, t.model_path, t.revision, t.trust_remote_code, t.dtype,
                                                        t.device)
    draft = load_draft_for_target(row["path"], model)
    summary.rows = measure_probe(model, tokenizer, identity.chat_template, draft, sets, config.draft_tokens,
                                 config.max_new_tokens, row["path"], row["checkpoint"], run_id)
    summary.probe_id = summary.rows[0]["probe_id"]
    store.selection.write_probe(summary.rows)
    create_table_artifact(key="probe-acceptance", table=[
        {"cluster": r["cluster"], "prompts": r["prompts"], "acceptance": r["acceptance"], "k": r["k"]}
        for r in summary.rows], description=f"probe {summary.probe_id} of {row['path']}: acceptance per cluster")
    for r in summary.rows:
        logger.info("cluster %-12s %d prompt(s): acceptance %s", r["cluster"], r["prompts"],
                    "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}")
    return summary
