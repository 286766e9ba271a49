"""vLLM serving our EAGLE-3 draft: its API and counters, what it says it loaded, and the benchmark on a real vLLM.

The first tests read recorded vLLM 0.32 output (stream events, start-up log lines) and need no server.
The rest start vLLM's CPU build (`make vllm`, .venv-vllm) on a tiny random Llama (float32, head size 64,
which vLLM's CPU attention takes) with a draft trained here: the benchmark flow with `engines: [vllm]`
(baseline, the draft, vLLM's n-gram method; lossless; acceptance from vLLM's own counters within 10%
of the offline evaluator on the same prompts), and the doctor's live check, which starts vLLM on the
export and names an export whose aux layer ids are shifted by one. No timing is asserted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from serving.bench.results import BaselineSpeculates, BenchmarkError, LevelResult, RequestMetrics, SpecMetricsMissing
from serving.vllm.doctor_live import loaded_checks
from serving.bench.engines import pass_order, vllm_engine_configs, vllm_sweep_configs
from serving.bench.online import ServerConfig, vllm_completion
from serving.vllm.extract_server import VllmEngineArgs, VllmServer, intel_openmp_preload
from serving.vllm.server import LoadedDraft, VllmSpecServer, VllmSpeculation, read_loaded_draft
from storage.lineage import LineageStore

from helpers import conversations, extract_config, import_generations, make_tiny_target

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

SPEC = ServerConfig("eagle3-k3", speculative=True, api="vllm", num_draft_tokens=3)
BASE = ServerConfig("baseline", api="vllm")


def _events(ids: list[list[int]], finish: str = "length", metrics: dict | None = None) -> list[dict]:
    chunks = [{"choices": [{"index": 0, "text": "x", "token_ids": part, "finish_reason": None}]} for part in ids]
    chunks[-1]["choices"][0]["finish_reason"] = finish
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": sum(map(len, ids))}}
    if metrics is not None:
        usage["metrics"] = {"speculative_decoding": metrics}
    return chunks + [usage]


def _metrics(hist: list[int]) -> dict:
    accepted = sum(j * n for j, n in enumerate(hist))
    return {"mean_acceptance_length": 1 + accepted / sum(hist), "acceptance_histogram": hist,
            "num_spec_steps": sum(hist), "num_accepted_draft_tokens": accepted, "num_draft_tokens": 3 * sum(hist),
            "num_spec_tokens": 3}


def test_vllm_completion_reads_ids_tokens_and_vllms_own_counters():
    # 12 tokens: 1 from the prefill, then 5 verify rounds accepting 0, 1, 3, 0, 2 drafts (+1 each) = 1 + 6 + 5
    events = _events([[5], [6, 7], [8, 9, 10, 11], [12], [13, 14, 15, 16]], metrics=_metrics([2, 1, 1, 1]))
    done = vllm_completion(events, SPEC, "here")
    assert done["output_ids"] == tuple(range(5, 17)) and done["completion_tokens"] == 12
    assert done["draft_n_accepted"] == 6 and done["draft_n"] == 15 and done["spec_steps"] == 5
    assert done["spec_verify_ct"] == 12 - 1 - 6  # forwards after the prefill, as the offline evaluator counts them
    assert done["acceptance_histogram"] == (2, 1, 1, 1) and done["finish_reason"] == "length"

    plain = vllm_completion(_events([[5, 6]], finish="stop"), BASE, "here")
    assert plain["spec_verify_ct"] is None and plain["output_ids"] == (5, 6)
    with pytest.raises(BaselineSpeculates, match="declared the baseline"):
        vllm_completion(events, BASE, "here")
    with pytest.raises(SpecMetricsMissing, match="per-request-spec-decode-metrics"):
        vllm_completion(_events([[5, 6]]), SPEC, "here")
    with pytest.raises(BenchmarkError, match="ended before the request finished"):
        vllm_completion(_events([[5, 6]], metrics=_metrics([1, 0, 0, 0]))[:-1], SPEC, "here")


def test_acceptance_by_position_from_the_histograms():
    def req(i: int, hist: tuple[int, ...]) -> RequestMetrics:
        return RequestMetrics("eagle3-k3", 1, i, 10, 0.1, 1.0, 5, None, "length", "usage", 15, 4, (1,) * 10, hist)

    level = LevelResult("eagle3-k3", True, 1, 2.0, (req(0, (2, 1, 1, 1)), req(1, (4, 0, 0, 1))))
    # 10 drafted rounds: position 0 accepted in 4 of them, position 1 in 3, position 2 in 2
    assert level.position_accept_rate == [0.4, 0.3, 0.2]
    assert level.to_row()["accept_rate_by_position"] == [0.4, 0.3, 0.2]
    assert LevelResult("b", False, 1, 1.0, ()).position_accept_rate is None


# vLLM 0.32's start-up lines (CPU runner, Eagle3 speculators draft) as they appear in its log.
LOG = """INFO 12-02 10:00:01 [cpu_model_runner.py:75] Loading drafter model...
INFO 12-02 10:00:02 [llm_base_proposer.py:1445] Detected EAGLE model without its own embed_tokens in the checkpoint. Sharing target model embedding weights with the draft model.
INFO 12-02 10:00:02 [llm_base_proposer.py:1541] Detected EAGLE model with distinct lm_head weights. Keeping separate lm_head weights from the target model.
INFO 12-02 10:00:02 [gpu_model_runner.py:5243] Using auxiliary layers from speculative config: (2, 15, 27)
"""


def test_what_vllm_says_it_loaded_against_the_trained_layers():
    loaded = read_loaded_draft(LOG)
    assert loaded == LoadedDraft((2, 15, 27), True, True, True)
    checks = loaded_checks(loaded, [1, 14, 26], "lineage")
    assert all(c.ok for c in checks), checks
    assert "outputs of layers [1, 14, 26]" in checks[0].message

    shifted = loaded_checks(read_loaded_draft(LOG.replace("(2, 15, 27)", "(1, 14, 26)")), [1, 14, 26])
    assert not shifted[0].ok and "shifted by -1" in shifted[0].message
    assert "eagle_aux_hidden_state_layer_ids = [2, 15, 27]" in shifted[0].message
    assert "shifted by +1" in loaded_checks(read_loaded_draft(LOG.replace("(2, 15, 27)", "(3, 16, 28)")),
                                            [1, 14, 26])[0].message

    default = LOG.replace("Using auxiliary layers from speculative config", "Using model's default auxiliary layers")
    assert "DEFAULT" in loaded_checks(read_loaded_draft(default), [1, 14, 26])[0].message
    shared_head = LOG.replace("Detected EAGLE model with distinct lm_head weights. Keeping separate lm_head weights "
                              "from the target model.", "Sharing target model lm_head weights with the draft model.")
    head = loaded_checks(read_loaded_draft(shared_head), [1, 14, 26])[2]
    assert not head.ok and "TARGET's lm_head" in head.message
    silent = loaded_checks(read_loaded_draft("INFO nothing about a drafter"), [1, 14, 26])
    assert not any(c.ok for c in silent)  # a line vLLM did not print is never a pass
    unknown = loaded_checks(loaded, None)[0]
    assert unknown.ok and unknown.warning


def test_vllm_speculation_flags_and_configs(tmp_path):
    draft = tmp_path / "draft"
    spec = VllmSpeculation("eagle3", 2, draft)
    assert spec.config() == {"method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": 2}
    assert VllmSpeculation("ngram", 3, prompt_lookup_max=4).config() == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    with pytest.raises(ValueError, match="needs draft folder"):
        VllmSpeculation("eagle3", 2)
    configs = vllm_engine_configs(draft, [1, 3], True, 2)
    assert [(c.label, c.drafter, c.k) for c in configs] == [
        ("baseline", "baseline", None), ("eagle3-k1", "eagle3", 1), ("eagle3-k3", "eagle3", 3), ("ngram-k2", "ngram", 2)]

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    server = VllmSpecServer(VllmEngineArgs(model=tmp_path / "target", python=Path("/bin/true")), speculation=spec)
    argv = server.command()
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "eagle3"
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert "--no-enable-prefix-caching" in argv
    with pytest.raises(FileNotFoundError, match="speculators format"):
        server.check_before_start()  # the draft folder does not exist: refused before any process starts
    assert "--speculative-config" not in VllmSpecServer(VllmEngineArgs(model=tmp_path / "target")).command()


def test_the_goal_sweep_serves_several_drafts_and_every_ngram_window(tmp_path):
    """Issue 42's sweep: each draft at each k, the n-gram at each k and window; labels unique, flags per config."""
    drafts = {"ours": tmp_path / "a", "speculators": tmp_path / "b"}
    configs = vllm_sweep_configs(drafts, [1, 2], [1, 3], [(1, 3), (2, 4)])
    assert [c.label for c in configs] == [
        "baseline", "eagle3-ours-k1", "eagle3-ours-k2", "eagle3-speculators-k1", "eagle3-speculators-k2",
        "ngram-k1", "ngram-k3", "ngram-k1-2:4", "ngram-k3-2:4"]
    by = {c.label: c.speculation for c in configs}
    assert by["eagle3-speculators-k2"].config()["model"] == str(drafts["speculators"].resolve())
    assert by["ngram-k3-2:4"].config() == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                           "prompt_lookup_max": 4}
    with pytest.raises(ValueError, match="twice"):
        vllm_sweep_configs({}, [], [3, 3], [(1, 3)])


def test_odd_passes_run_the_configs_in_reverse_after_the_baseline():
    configs = vllm_sweep_configs({"ours": Path("/d")}, [1, 2], [3], [(1, 3), (2, 4)])
    labels = [c.label for c in configs]
    assert [c.label for c in pass_order(configs, 0)] == labels
    again = [c.label for c in pass_order(configs, 1)]
    assert again[0] == labels[0] == "baseline" and again[1:] == labels[:0:-1]
    assert [c.label for c in pass_order(configs, 2)] == labels


# ---------------------------------------------------------------- a real vLLM

@pytest.fixture(scope="module")
def vllm_target(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny-vllm-target"), hidden_size=128, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def trained(vllm_target, tmp_path_factory, prefect_api):
    """A draft trained on the tiny target, exported for SGLang and vLLM (speculators); its workspace."""
    from flows.extract import extract
    from flows.train import train
    from tasks.config import TrainConfig

    tmp = tmp_path_factory.mktemp("vllm-serving")
    ws = tmp / "ws"
    import_generations(ws, tmp, conversations(16, seed=5))
    extract(extract_config(ws, vllm_target, draft_vocab_size=256, shard_bytes=150_000))
    target = {"model_path": str(vllm_target), "dtype": "float32", "device": "cpu"}
    s = train(TrainConfig.model_validate({"workspace": str(ws), "run_name": "t", "target": target, "ttt_steps": 2,
                                          "batch_tokens": 1024, "lr": 3e-3, "epochs": 2, "checkpoint_every": 50,
                                          "export_formats": ["sglang", "speculators"]}))
    return ws, target, Path(s.exports["speculators"])


def test_vllm_servers_preload_the_environments_intel_openmp_as_vllms_cpu_build_asks(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("")
    assert intel_openmp_preload(python, "") == ""  # a GPU build: no libiomp5 in the environment, nothing added
    assert intel_openmp_preload(python, "/x/libjemalloc.so") == "/x/libjemalloc.so"
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    iomp = str(venv / "lib" / "libiomp5.so")
    assert intel_openmp_preload(python, "") == iomp
    assert intel_openmp_preload(python, "/x/libtcmalloc_minimal.so.4") == f"/x/libtcmalloc_minimal.so.4:{iomp}"
    assert intel_openmp_preload(python, "/opt/libiomp5.so") == "/opt/libiomp5.so"  # the user's own wins

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    server = VllmServer(VllmEngineArgs(model=tmp_path, python=python))
    assert server.environment()["LD_PRELOAD"] == iomp
    monkeypatch.setenv("LD_PRELOAD", "/x/libtcmalloc_minimal.so.4")
    assert server.environment()["LD_PRELOAD"] == f"/x/libtcmalloc_minimal.so.4:{iomp}"


@pytest.mark.timeout(1200)
def test_benchmark_flow_serves_the_draft_on_vllm(trained):
    from flows.benchmark import benchmark
    from flows.tables import serving_view
    from tasks.config import BenchConfig

    ws, target, export = trained
    serving = {"engines": ["vllm"], "draft_tokens": [2], "ngram_tokens": 2, "concurrency": [1, 2],
               "max_new_tokens": 16, "recheck_baseline": False,
               "vllm": {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 2}}
    cfg = BenchConfig(workspace=str(ws), target=target, prompts_per_domain=3, max_new_tokens=16, draft_tokens=2,
                      baselines=False, serving=serving)
    b = benchmark(cfg)
    assert b.draft_speculators == str(export) and b.draft_gguf is None
    configs = ["baseline", "eagle3-k2", "ngram-k2"]
    assert [(r["engine"], r["config"], r["concurrency"]) for r in b.serving_rows] == [
        ("vllm", c, n) for c in configs for n in (1, 2)]
    by = {(r["config"], r["concurrency"]): r for r in b.serving_rows}
    eagle = by["eagle3-k2", 1]
    assert eagle["server_build"].startswith("vllm-") and eagle["draft_n"] > 0 and eagle["verify_rounds"] > 0
    assert len(eagle["accept_rate_by_position"]) == 2  # from vLLM's own acceptance histograms
    # greedy: the draft changes how fast, never what (the same ids as vLLM's baseline, prompt by prompt)
    assert eagle["lossless_identical"] == eagle["lossless_total"] == 3, eagle["lossless"]
    assert by["baseline", 1]["acceptance"] is None
    # vLLM's acceptance on the same prompts agrees with the offline evaluator's (the draft as trained, in torch)
    line = b.serving_lines[-1]
    assert line.startswith("vLLM: online vs offline acceptance at k=2, same prompts: vLLM"), line
    assert "(within 10%)" in line, line
    assert any(line.startswith("vLLM: concurrency 1: on vLLM the EAGLE-3 draft is") for line in b.serving_lines)
    assert Path(b.serving_pngs["vllm"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    store = LineageStore(ws / "lineage.duckdb")
    _, stored = store.reports.query_readonly(
        f"SELECT config_label, concurrency, acceptance_by_position, server_build FROM benchmark_results "
        f"WHERE bench_id = '{b.bench_id}' AND kind = 'serving' ORDER BY config_label, concurrency")
    assert [(r[0], r[1]) for r in stored] == sorted((f"vllm/{c}", n) for c in configs for n in (1, 2))
    report = store.reports.pipeline("t")["serving"]
    assert sorted(serving_view(report)[1]) == sorted(serving_view(b.serving_rows)[1])
    assert [r for r in report if r.get("offline_agreement")][0]["offline_agreement"]["within_tolerance"] is True


@pytest.mark.timeout(900)
def test_the_doctor_starts_vllm_and_names_ids_shifted_by_one(trained, vllm_target, tmp_path):
    from serving.doctor import run_doctor

    _, _, export = trained
    report = run_doctor(export, vllm_target, engine="vllm", live=True)
    live = {c.name: c for c in report.checks if c.name.startswith("vllm_loaded_")}
    assert sorted(live) == ["vllm_loaded_aux_layers", "vllm_loaded_embeddings", "vllm_loaded_lm_head"]
    assert report.passed, report.failure_lines()
    assert "the trained layers" in live["vllm_loaded_aux_layers"].message

    shifted = tmp_path / "shifted"
    shutil.copytree(export, shifted)
    config = json.loads((shifted / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    (shifted / "config.json").write_text(json.dumps(config))
    bad = run_doctor(shifted, vllm_target, engine="vllm", live=True)
    aux = next(c for c in bad.checks if c.name == "vllm_loaded_aux_layers")
    assert not aux.ok and "shifted by -1" in aux.message, aux.message
