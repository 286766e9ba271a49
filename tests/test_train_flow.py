"""The train flow on a real Prefect API and DuckDB file, with a tiny random target: rounds consumed
and deleted, exports with lineage, kill -9 resume equals an uninterrupted run, two gloo processes
equal one process, online mode without disk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flows.extract import extract
from flows.train import train
from storage.datasets import file_sha256
from storage.lineage import LineageStore
from tasks.config import TrainConfig
from serving.sglang.export import check_sglang
from serving.vllm.export import check_speculators
from tasks.train.steps import MODEL_FILE, list_checkpoints

from helpers import conversations, extract_config, import_generations

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent


def train_config(workspace: Path, target: Path, **kw) -> TrainConfig:
    base = {"workspace": str(workspace), "run_name": "t", "target": {"model_path": str(target), "dtype": "float32",
            "device": "cpu"}, "ttt_steps": 3, "batch_tokens": 1024, "lr": 3e-3, "epochs": 2, "checkpoint_every": 3,
            "log_every": 1}
    return TrainConfig.model_validate({**base, **kw})


@pytest.fixture
def extracted(prefect_api, tmp_path, workspace, tiny_target) -> Path:
    import_generations(workspace, tmp_path, conversations(24, seed=11))
    s = extract(extract_config(workspace, tiny_target, draft_vocab_size=256, shard_bytes=150_000))
    assert s.extracted == 24 and s.shards_written >= 3
    return workspace


def test_a_round_learns_is_consumed_deleted_exported_and_traceable(extracted, tmp_path, tiny_target):
    ws = extracted
    store = LineageStore(ws / "lineage.duckdb")
    s = train(train_config(ws, tiny_target, epochs=8))
    assert s.stopped_by == "done" and s.rounds_done == 1 and s.resumed_from_step is None
    metrics = store.training.metrics("t")
    assert len(metrics) == s.step and [m["step"] for m in metrics] == list(range(1, s.step + 1))
    first, last = metrics[0], metrics[-1]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["accuracy"][0] > 20 / 256  # well above chance over the 256-token draft vocab
    assert 0 <= min(last["conditional_accuracy"]) and max(last["conditional_accuracy"]) <= 1
    _, states = store.reports.query_readonly("SELECT DISTINCT state, consumed_by FROM shards")
    assert states == [("deleted", "t")] and not list((ws / "shards").iterdir())
    assert not check_sglang(s.exports["sglang"]) and not check_speculators(s.exports["speculators"])
    assert Path(s.curves_png).stat().st_size > 1000
    # every exported checkpoint traces back to the samples, generations, prompts and source records
    _, lineage = store.reports.query_readonly(
        "SELECT format, count(DISTINCT sample_id), count(DISTINCT record_key) FROM checkpoint_lineage GROUP BY 1 ORDER BY 1")
    assert lineage == [("gguf", 24, 24), ("sglang", 24, 24), ("speculators", 24, 24)]
    # the llama.cpp GGUF: converted from the sglang export, layers named as llama.cpp captures them
    from serving.llamacpp.export import read_gguf_draft

    gguf = Path(s.exports["gguf"]) / "draft.gguf"
    assert read_gguf_draft(gguf).target_layers == [2, 4, 5]  # inputs of layers 2, 4, 5 = outputs of 1, 3, 4
    _, rows = store.reports.query_readonly("SELECT sha256, converter FROM checkpoints WHERE format = 'gguf'")
    assert rows == [(file_sha256(gguf), rows[0][1])] and rows[0][1].startswith("llama.cpp@")

    # the doctor passes the export, with the trained layers taken from lineage, and refuses the EAGLE flag
    from typer.testing import CliRunner

    from flows.cli import app

    draft = s.exports["sglang"]
    ok = CliRunner().invoke(app, ["doctor", draft, "--target", str(tiny_target), "-w", str(ws)])
    assert ok.exit_code == 0 and ok.stdout.startswith("PASS sglang") and "[1, 3, 4]" in ok.stdout
    launch = f"python -m sglang.launch_server --model-path {tiny_target} --speculative-algorithm EAGLE " \
             f"--speculative-draft-model-path {draft} --speculative-num-steps 3 --speculative-eagle-topk 1 " \
             "--speculative-num-draft-tokens 4"
    bad = CliRunner().invoke(app, ["doctor", draft, "--target", str(tiny_target), "-w", str(ws), "--launch", launch])
    assert bad.exit_code == 1 and "launch_algorithm: --speculative-algorithm EAGLE" in bad.output

    assert train(train_config(ws, tiny_target)).stopped_by == "no_data"  # nothing new to train on
    # the next round: more generations, extracted, then the same run continues from its checkpoint
    import_generations(ws, tmp_path, conversations(8, seed=12), name="more")
    assert extract(extract_config(ws, tiny_target, draft_vocab_size=256, shard_bytes=150_000)).extracted == 8
    again = train(train_config(ws, tiny_target, epochs=8))
    assert again.resumed_from_step == s.step and again.rounds_done == 2 and again.step > s.step
    _, rounds = store.reports.query_readonly("SELECT round, samples FROM train_rounds ORDER BY round")
    assert rounds == [(0, 24), (1, 8)]


def test_a_draft_started_from_the_target_head_checkpoints_the_targets_rows_and_final_norm(extracted, tiny_target):
    from transformers import AutoModelForCausalLM

    ws = extracted
    # one step at a tiny rate: Adam moves each weight by about the rate, so the start shows through
    s = train(train_config(ws, tiny_target, init="target_head", max_steps=1, lr=1e-7, warmup_steps=0))
    assert s.stopped_by == "max_steps" and s.step == 1
    _, weights = _final_weights(ws)
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    rows = weights["d2t"] + torch.arange(weights["d2t"].numel())
    torch.testing.assert_close(weights["lm_head.weight"], target.lm_head.weight.detach()[rows], rtol=0, atol=1e-5)
    torch.testing.assert_close(weights["norm.weight"], target.model.norm.weight.detach(), rtol=0, atol=1e-5)
    # lineage records how the draft started
    _, recorded = LineageStore(ws / "lineage.duckdb").reports.query_readonly(
        "SELECT json_extract_string(train_config, '$.init') FROM train_runs WHERE run_name = 't'")
    assert recorded == [("target_head",)]


def _cli_config(ws: Path, cfg: TrainConfig, path: Path) -> Path:
    data = cfg.model_dump(mode="json")
    data.pop("workspace")
    path.write_text(yaml.safe_dump({"workspace": str(ws), "train": data}))
    return path


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _final_weights(ws: Path) -> tuple[str, dict]:
    last = list_checkpoints(ws / "checkpoints" / "t")[-1]
    return last.name, load_file(last / MODEL_FILE)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_kill_9_then_resume_equals_an_uninterrupted_run(extracted, tmp_path, tiny_target, optimizer):
    ws_a, ws_b = extracted, tmp_path / "copy"
    shutil.copytree(ws_a, ws_b)
    cfg = train_config(ws_a, tiny_target, epochs=4, checkpoint_every=2, optimizer=optimizer)
    cmd = [sys.executable, "-m", "flows.cli", "train", "-c"]
    a = subprocess.run(cmd + [str(_cli_config(ws_a, cfg, tmp_path / "a.yaml"))], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert a.returncode == 0, a.stderr[-3000:]

    b_cfg = _cli_config(ws_b, cfg.model_copy(update={"workspace": str(ws_b)}), tmp_path / "b.yaml")
    ckpts = ws_b / "checkpoints" / "t"
    kills = 0
    for wanted in (1, 3):  # kill after the first checkpoint, then again after a later one
        proc = subprocess.Popen(cmd + [str(b_cfg)], env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if len(list(ckpts.glob("step-*"))) and int(max(ckpts.glob("step-*")).name[5:]) >= 2 * wanted:
                break
            time.sleep(0.02)
        time.sleep(0.3)  # mid-step, between checkpoints
        proc.send_signal(signal.SIGKILL)  # a no-op if the run has already ended
        kills += proc.wait(timeout=30) == -signal.SIGKILL  # counted only where the kill landed
    assert kills >= 1
    b = subprocess.run(cmd + [str(b_cfg)], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stderr[-3000:]
    name_a, wa = _final_weights(ws_a)
    name_b, wb = _final_weights(ws_b)
    assert name_a == name_b and wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].equal(wb[k]), k  # bitwise: same batches, same order, same optimizer state
    sa, sb = (LineageStore(w / "lineage.duckdb") for w in (ws_a, ws_b))
    ma, mb = sa.training.metrics("t"), sb.training.metrics("t")
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]


def test_two_gloo_processes_match_one_process_accumulating(extracted, tmp_path, tiny_target):
    ws_one, ws_two = extracted, tmp_path / "ddp"
    shutil.copytree(ws_one, ws_two)
    one = _cli_config(ws_one, train_config(ws_one, tiny_target, grad_accum=2, epochs=2), tmp_path / "one.yaml")
    two = _cli_config(ws_two, train_config(ws_two, tiny_target, grad_accum=1, epochs=2), tmp_path / "two.yaml")
    r1 = subprocess.run([sys.executable, "-m", "flows.cli", "train", "-c", str(one)], env=_env(), cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                         str(_free_port()), "-m", "flows.cli", "train", "-c", str(two)], env=_env(), cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    assert r2.returncode == 0, (r2.stdout + r2.stderr)[-4000:]
    n1, w1 = _final_weights(ws_one)
    n2, w2 = _final_weights(ws_two)
    assert n1 == n2
    for k in w1:
        assert (w1[k].double() - w2[k].double()).abs().max() < 1e-5, k  # same update; only the summation order differs
    _, by = LineageStore(ws_two / "lineage.duckdb").reports.query_readonly("SELECT count(*) FROM runs WHERE flow = 'train'")
    assert by == [(1,)]  # one flow run (rank 0); the other rank writes nothing


def _free_port() -> int:
    from serving.llamacpp.server import free_port

    return free_port()


def test_each_round_is_benchmarked_on_heldout_chat_and_the_curve_grows(extracted, tmp_path, tiny_target):
    """Held-out chat prompts in the workspace become the benchmark domain heldout_chat; after each training
    round the new export's acceptance lands on the curve against the conversations trained on so far."""
    import json

    from flows.benchmark import benchmark
    from flows.discover import discover
    from tasks.config import BenchConfig, DiscoverConfig

    ws = extracted
    # round 2's conversations are imported first: an imports-only regenerate cannot run once prompts are pending
    import_generations(ws, tmp_path, conversations(12, seed=12), name="more")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c["messages"][0]["content"]}]}) + "\n"
                             for c in conversations(12, seed=99)))
    d = discover(DiscoverConfig.model_validate({
        "workspace": str(ws), "sources": [{"name": "chat", "kind": "file", "path": str(chats)}],
        "decontaminate": {"enabled": False}, "heldout": {"fraction": 0.5, "cap": 3}}))
    assert d.outcomes["heldout"] == 3 and d.reconciles
    target = {"model_path": str(tiny_target), "dtype": "float32", "device": "cpu"}
    bench = BenchConfig(workspace=str(ws), target=target, prompts_per_domain=1, max_new_tokens=8, draft_tokens=2)
    s1 = train(train_config(ws, tiny_target, epochs=1))
    b1 = benchmark(bench)
    assert {r["domain"] for r in b1.rows} == {"humaneval", "heldout_chat", "all"}
    assert extract(extract_config(ws, tiny_target, draft_vocab_size=256, shard_bytes=150_000)).extracted == 12
    s2 = train(train_config(ws, tiny_target, epochs=1))
    assert s2.rounds_done == 2
    b2 = benchmark(bench)
    store = LineageStore(ws / "lineage.duckdb")
    points = [p for p in store.benchmarks.acceptance_curve() if p["drafter"] == "eagle3" and p["domain"] == "heldout_chat"]
    assert [(p["checkpoint"], p["training_conversations"]) for p in points] == [
        (b1.checkpoint, 24), (b2.checkpoint, 36)]
    assert b1.checkpoint == f"t/sglang-step-{s1.step:08d}" and b2.checkpoint == f"t/sglang-step-{s2.step:08d}"
    assert 0 < points[0]["training_tokens"] < points[1]["training_tokens"]
    assert all(1.0 <= p["acceptance_length"] <= 3.0 for p in points)
    assert Path(b2.curve_png) == ws / "reports" / "acceptance_curve.png" and Path(b2.curve_png).stat().st_size > 5000


def test_online_mode_trains_without_writing_shards(prefect_api, tmp_path, workspace, tiny_target):
    import_generations(workspace, tmp_path, conversations(10, seed=13))
    # a budget too small for any shard: extract only builds and registers the draft vocab
    s = extract(extract_config(workspace, tiny_target, draft_vocab_size=256, disk_budget_bytes=1))
    assert s.stopped_by == "budget" and s.shards_written == 0
    t = train(train_config(workspace, tiny_target, mode="online", epochs=2))
    assert t.mode == "online" and t.step > 0 and t.rounds_done == 1 and t.shards_trained == 0
    assert not list((workspace / "shards").iterdir())
    assert not check_sglang(t.exports["sglang"])


def test_online_micro_batches_whose_samples_are_all_quarantined_are_skipped_and_counted(
        prefect_api, tmp_path, workspace, tiny_target, monkeypatch):
    import tasks.train.loop as ft
    from tasks.extract.hf_backend import Quarantined

    import_generations(workspace, tmp_path, conversations(10, seed=13))
    s = extract(extract_config(workspace, tiny_target, draft_vocab_size=256, disk_budget_bytes=1))
    assert s.shards_written == 0
    calls = {"n": 0, "refused": 0, "samples": 0}
    real_build = ft.build_extractor

    def build(*a, **kw):
        inner = real_build(*a, **kw)

        class EveryOtherRefused:  # the extractor quarantines every sample of every other micro-batch
            def extract(self, samples):
                calls["n"] += 1
                calls["samples"] += len(samples)
                if calls["n"] % 2 == 0:
                    calls["refused"] += len(samples)
                    return [Quarantined(i, "non-finite hidden state (test)") for i in range(len(samples))]
                return inner.extract(samples)
        return EveryOtherRefused()

    monkeypatch.setattr(ft, "build_extractor", build)
    t = train(train_config(workspace, tiny_target, mode="online", epochs=2, batch_tokens=512))
    skipped = calls["n"] // 2
    assert skipped >= 2 and t.rounds_done == 1
    assert t.skipped_micro_batches == skipped and t.quarantined_samples == calls["refused"]
    assert t.step == calls["n"] - skipped  # one optimizer step per trained micro-batch (grad_accum 1)
    assert t.last_loss is not None and t.last_loss == t.last_loss  # finite, not an error
    assert not check_sglang(t.exports["sglang"])
    store = LineageStore(workspace / "lineage.duckdb")
    assert [m["step"] for m in store.training.metrics("t")] == list(range(1, t.step + 1))


def test_benchmark_checks_the_contract_first_then_reports_acceptance_with_baselines(extracted, tmp_path, tiny_target):
    from safetensors.torch import save_file

    from flows.benchmark import ContractFailed, benchmark
    from tasks.config import BenchConfig

    ws = extracted
    s = train(train_config(ws, tiny_target, epochs=4))
    target = {"model_path": str(tiny_target), "dtype": "float32", "device": "cpu"}
    b = benchmark(BenchConfig(workspace=str(ws), target=target, prompts_per_domain=2, max_new_tokens=12, draft_tokens=3))
    assert b.doctor.startswith("PASS sglang") and b.checkpoint == f"t/sglang-step-{s.step:08d}"
    assert set(b.acceptance) == {"eagle3", "eagle3-final-state-only", "prompt-lookup"}
    assert all(v is None or 1.0 <= v <= 4.0 for v in b.acceptance.values())
    assert b.lossless_checked > 0  # every output was checked equal to the target's greedy output
    _, rows = LineageStore(ws / "lineage.duckdb").reports.query_readonly(
        "SELECT count(*), count(DISTINCT drafter) FROM benchmark_results WHERE bench_id = ? AND checkpoint = ?"
        .replace("?", "'{}'").format(b.bench_id, b.checkpoint))
    assert rows[0][1] == 3 and rows[0][0] >= 6  # per drafter: all domains and humaneval
    assert Path(b.plot_png).stat().st_size > 1000

    # a draft whose decoder keys SGLang would skip (layers.0.*) is refused before any number is produced
    broken = tmp_path / "broken"
    shutil.copytree(s.exports["sglang"], broken)
    weights = load_file(broken / "model.safetensors")
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}, broken / "model.safetensors")
    with pytest.raises(ContractFailed, match="layers.0"):
        benchmark(BenchConfig(workspace=str(ws), target=target, checkpoint=str(broken), prompts_per_domain=1))

    # online: a baseline and a speculative SGLang-like server (real processes on loopback); the probe,
    # every concurrency level and break-even land in the same table as the offline numbers
    from serving.scripted_server import spawn

    procs = []
    try:
        base_proc, base_url = spawn("--answer-tokens", "24", "--step-latency", "0.01")
        procs.append(base_proc)
        spec_proc, spec_url = spawn("--answer-tokens", "24", "--step-latency", "0.015", "--spec-accept-length", "2.5")
        procs.append(spec_proc)
        low_proc, low_url = spawn("--answer-tokens", "24", "--spec-accept-length", "1.0", "--spec-num-draft-tokens", "4")
        procs.append(low_proc)
        online = {"baseline": {"label": "baseline", "url": base_url, "speculative": False},
                  "speculative": [{"label": "eagle3-k4", "url": spec_url}], "concurrency": [1, 2],
                  "max_new_tokens": 24, "probe_prompts": 4}
        cfg = BenchConfig(workspace=str(ws), target=target, prompts_per_domain=2, max_new_tokens=8, draft_tokens=2,
                          baselines=False, online=online)
        on = benchmark(cfg)
        assert {(r["config"], r["concurrency"]) for r in on.online_rows} == {
            ("baseline", 1), ("baseline", 2), ("eagle3-k4", 1), ("eagle3-k4", 2)}
        spec_rows = [r for r in on.online_rows if r["config"] == "eagle3-k4"]
        assert all(r["accept_len_token_weighted"] == pytest.approx(2.5, abs=0.2) for r in spec_rows)
        assert on.break_even and all(b["beats_baseline"] for b in on.break_even)
        _, kinds = LineageStore(ws / "lineage.duckdb").reports.query_readonly(
            f"SELECT kind, count(*) FROM benchmark_results WHERE bench_id = '{on.bench_id}' GROUP BY 1 ORDER BY 1")
        assert kinds == [("offline", 2), ("online", 4)]
        # a launch that does not speculate (acceptance ~1.0: the EAGLE flag) stops the benchmark with the causes
        low = {**online, "speculative": [{"label": "wrong-flag", "url": low_url, "num_draft_tokens": 4}]}
        from serving.bench.online import AcceptanceTooLow

        with pytest.raises(AcceptanceTooLow, match="EAGLE3"):
            benchmark(cfg.model_copy(update={"online": BenchConfig.model_validate({"online": low}).online}))
    finally:
        for p in procs:
            p.kill()
