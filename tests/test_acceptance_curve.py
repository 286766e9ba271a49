"""The acceptance curve: the view against cumulative training data, its PNG, `eagle3 status`, and the
pipeline's benchmark after every round."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from typer.testing import CliRunner

from storage.lineage import LineageStore
from tasks.evaluate.curve import acceptance_curve_png

DRAFTERS = ("eagle3", "eagle3-final-state-only", "prompt-lookup")
DOMAINS = ("heldout_chat", "humaneval", "all")


def _train_run(store: LineageStore, run_id: str, name: str, mode: str) -> None:
    store.training.register_run(run_id, {"run_name": name, "mode": mode, "extract_key": "e", "vocab_id": "v",
                                      "target": "tiny", "target_revision": "r", "draft_config": {},
                                      "train_config": {"epochs": 1}})


def _metric(step: int, round_index: int, tokens: int) -> dict:
    return {"step": step, "round": round_index, "epoch": 0, "lr": 1e-3, "loss": 1.0, "step_loss": [1.0],
            "accuracy": [0.1], "conditional_accuracy": [0.1], "tokens": tokens, "grad_norm": 1.0}


def _checkpoint(store: LineageStore, run_id: str, name: str, step: int, rounds: int, tmp: Path) -> str:
    ckpt = f"{name}/sglang-step-{step:08d}"
    store.checkpoints.register(run_id, {"checkpoint": ckpt, "run_name": name, "step": step, "format": "sglang",
                                       "path": str(tmp / ckpt), "sha256": "x", "rounds": rounds, "target": "tiny",
                                       "target_revision": "r", "aux_layer_ids": [0, 1, 2], "vocab_id": "v",
                                       "extract_key": "e"})
    return ckpt


def _bench(store: LineageStore, run_id: str, bench_id: str, ckpt: str, values: dict[str, float],
           drafters=DRAFTERS) -> None:
    store.benchmarks.write_results(run_id, [{
        "bench_id": bench_id, "checkpoint": ckpt, "kind": "offline", "config_label": "chain k=3", "drafter": d,
        "domain": dom, "concurrency": None, "requests": 2, "completion_tokens": 24, "verify_rounds": 12,
        "acceptance_token_weighted": values[d] + (0.5 if dom == "humaneval" else 0.0),
        "acceptance_request_mean": None, "acceptance_by_position": [0.5], "output_tok_s": None, "ttft_p50_s": None,
        "details": {}} for d in drafters for dom in DOMAINS])


def curve_workspace(tmp_path: Path, final_state_rows: bool = True) -> tuple[Path, list[str]]:
    """Three offline rounds of run `t` (5, 7, 11 conversations) and two online rounds of run `o`,
    benchmarked out of order, one checkpoint twice (the newer measurement counts)."""
    ws = tmp_path / "ws"
    store = LineageStore(ws / "lineage.duckdb")
    run_id = store.runs.begin("train", {}, "h", None, None)
    _train_run(store, run_id, "t", "offline")
    store.training.write_metrics(run_id, "t", [_metric(2, 0, 180), _metric(4, 0, 400), _metric(9, 1, 1000),
                                            _metric(15, 2, 1900)])
    ckpts = []
    for r, (samples, step) in enumerate([(5, 4), (7, 9), (11, 15)]):
        store.training.write_round(run_id, "t", r, [f"s{r}"], samples, 1, step)
        ckpts.append(_checkpoint(store, run_id, "t", step, r + 1, tmp_path))
    _train_run(store, run_id, "o", "online")
    store.training.write_metrics(run_id, "o", [_metric(3, 0, 300), _metric(6, 1, 700)])
    store.training.write_round(run_id, "o", 0, [], 10, 1, 3)
    store.training.write_round(run_id, "o", 1, [], 14, 1, 6)  # an online round covers every generation so far
    online = _checkpoint(store, run_id, "o", 6, 2, tmp_path)
    drafters = DRAFTERS if final_state_rows else ("eagle3", "prompt-lookup")
    values = lambda ours, final: {"eagle3": ours, "eagle3-final-state-only": final, "prompt-lookup": 1.4}  # noqa: E731
    _bench(store, run_id, "b2", ckpts[1], values(1.2, 1.1), drafters)
    _bench(store, run_id, "b1", ckpts[0], values(1.0, 0.9), drafters)
    _bench(store, run_id, "b1-again", ckpts[0], values(1.05, 0.95), drafters)
    _bench(store, run_id, "bo", online, values(1.15, 1.0), drafters)
    _bench(store, run_id, "b3", ckpts[2], values(1.3, 1.2), drafters)
    return ws, ckpts


def test_the_view_gives_acceptance_against_cumulative_training_data_in_order(tmp_path):
    ws, ckpts = curve_workspace(tmp_path)
    cols, rows = LineageStore(ws / "lineage.duckdb").reports.query_readonly("SELECT * FROM acceptance_curve")
    assert cols[:6] == ["checkpoint", "run_name", "step", "rounds", "training_tokens", "training_conversations"]
    points = [dict(zip(cols, r)) for r in rows]
    assert len(points) == 4 * len(DRAFTERS) * len(DOMAINS)  # one per checkpoint, drafter, domain: no re-measure twice
    ours = [(p["checkpoint"], p["training_tokens"], p["training_conversations"], p["acceptance_length"])
            for p in points if p["run_name"] == "t" and p["drafter"] == "eagle3" and p["domain"] == "heldout_chat"]
    assert ours == [(ckpts[0], 400, 5, 1.05), (ckpts[1], 1000, 12, 1.2), (ckpts[2], 1900, 23, 1.3)]
    for run in ("o", "t"):  # the view's own order is cumulative within each training run
        tokens = [p["training_tokens"] for p in points if p["run_name"] == run]
        assert tokens == sorted(tokens)
    online = {(p["training_tokens"], p["training_conversations"]) for p in points if p["run_name"] == "o"}
    assert online == {(700, 14)}  # not 10 + 14: the second online round trained on the first one's conversations too


def test_the_png_shows_the_curve_with_both_references(tmp_path):
    ws, _ = curve_workspace(tmp_path)
    png = tmp_path / "curve.png"
    plot = acceptance_curve_png(LineageStore(ws / "lineage.duckdb").benchmarks.acceptance_curve(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert plot.domain == "heldout_chat" and plot.config_label == "chain k=3"
    assert plot.series["t"] == [(400, 5, 1.05), (1000, 12, 1.2), (1900, 23, 1.3)]
    assert plot.references == {"prompt-lookup": 1.4, "eagle3-final-state-only": 1.2}  # newest measurement's

    ws2, _ = curve_workspace(tmp_path / "no-final", final_state_rows=False)
    plot = acceptance_curve_png(LineageStore(ws2 / "lineage.duckdb").benchmarks.acceptance_curve(), tmp_path / "c2.png")
    assert plot.references == {"prompt-lookup": 1.4} and (tmp_path / "c2.png").exists()
    assert acceptance_curve_png([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_status_prints_the_latest_point(tmp_path):
    from flows.cli import app

    ws, ckpts = curve_workspace(tmp_path)
    out = CliRunner().invoke(app, ["status", "-w", str(ws)], env={"COLUMNS": "120"})
    assert out.exit_code == 0, out.output
    text = out.output
    assert "acceptance curve, latest point" in text
    tail = " ".join(text[text.index("acceptance curve, latest point"):].split())  # the title may wrap
    assert f"{ckpts[2]} (1,900 training tokens, 23 conversations), heldout_chat, chain k=3" in tail
    tail = text[text.index("acceptance curve, latest point"):]
    for drafter, value in (("eagle3 ", "1.30"), ("prompt-lookup", "1.40"), ("eagle3-final-state-only", "1.20")):
        line = next(li for li in tail.splitlines() if drafter in li)
        assert value in line, line
    as_json = CliRunner().invoke(app, ["status", "-w", str(ws), "--format", "json"])
    assert "acceptance curve" not in as_json.output  # json stays one parsable table


def test_the_pipeline_benchmarks_each_rounds_export_when_asked(prefect_api, tmp_path):
    """The round loop with stand-in stages: with benchmark.every_round, each round that exported is
    benchmarked right after its training; a checkpoint already measured is skipped, not measured twice."""
    from flows.pipeline import PipelineSummary, _rounds, ensure_concurrency_limits
    from tasks.config import PipelineConfig

    cfg = PipelineConfig.model_validate({"workspace": str(tmp_path), "extract": {}, "train": {"run_name": "r"},
                                         "benchmark": {"every_round": True}})
    sizes = ensure_concurrency_limits(cfg.resources, None)
    extracts = iter([("budget", 3), ("budget", 2), ("done", 1)])
    exports = iter([{"sglang": "a"}, {}, {"sglang": "c"}])  # round 2 exported nothing (say, a max_steps stop later)
    calls, measured = [], set()
    latest = {"checkpoint": None}

    def stage(name, fn, config):
        calls.append(name)
        if name.startswith("extract"):
            stopped, shards = next(extracts)
            return SimpleNamespace(stopped_by=stopped, shards_written=shards)
        if name.startswith("train"):
            e = next(exports)
            if e:
                latest["checkpoint"] = f"r/{e['sglang']}"
            return SimpleNamespace(stopped_by="done", shards_deleted=2, exports=e)
        measured.add(latest["checkpoint"])
        return SimpleNamespace(acceptance={})

    store = SimpleNamespace(checkpoints=SimpleNamespace(find=lambda *a, **k: dict(latest)),
                            benchmarks=SimpleNamespace(completed=lambda ckpt, h: "old" if ckpt in measured else None))
    skips = []
    summary = PipelineSummary("x", str(tmp_path), "")
    _rounds(cfg, sizes, summary, stage, SimpleNamespace(info=lambda *a: None), store,
            lambda name, why: skips.append(name))
    assert calls == ["extract (round 1)", "train (round 1)", "benchmark (round 1)", "extract (round 2)",
                     "train (round 2)", "extract (round 3)", "train (round 3)", "benchmark (round 3)"]
    assert measured == {"r/a", "r/c"} and skips == []

    off = cfg.model_copy(update={"benchmark": cfg.benchmark.model_copy(update={"every_round": False})})
    extracts, exports, calls = iter([("done", 1)]), iter([{"sglang": "d"}]), []
    _rounds(off, sizes, PipelineSummary("y", str(tmp_path), ""), stage, SimpleNamespace(info=lambda *a: None), store,
            lambda name, why: None)
    assert calls == ["extract (round 1)", "train (round 1)"]
