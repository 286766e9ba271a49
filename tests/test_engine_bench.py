"""The serving benchmark on a real engine: llama.cpp's llama-server, started and stopped by the test.

The llama.cpp API of serving/bench/online.py (streaming /completion, token ids in and out, the draft
counters of `timings`) against real servers on SmolLM2: the baseline and llama.cpp's n-gram drafting
on prompts that ask the model to copy text (so n-gram lookup drafts and the counters appear); the
declared-speculative and declared-baseline errors on real servers; the lossless check (greedy ids of
the n-gram server equal the baseline's at concurrency 1). Then the benchmark flow end to end on a
tiny slice: a tiny random target converted to GGUF, a draft trained and exported (GGUF included) by
the train flow, served by llama-server at two draft lengths, rows in benchmark_results, the plot,
the verdict and the online vs offline agreement line. No timing is asserted: the machine is shared.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from serving.bench.results import LevelResult, RequestMetrics
from serving.llamacpp.server import LlamaCppServer
from serving.bench.engines import (LlamaCppEngine, compare_outputs, engine_configs, plot_engine_benchmark,
                                  run_engine_benchmark)
from serving.bench.online import (BaselineSpeculates, BenchmarkError, ServerConfig, SpecMetricsMissing,
                                  llamacpp_completion, run_online_benchmark)
from storage.lineage import LineageError, LineageStore
from tasks.model.target import load_target, smollm2_gguf_path

from helpers import TARGET_CACHE, conversations, extract_config, import_generations

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

MAX_NEW = 24
COPY = ("Copy this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n")
TEXTS = [COPY, "Repeat exactly: one two three four five six seven eight nine ten, one two three four five six "
               "seven eight nine ten.", COPY.replace("add", "plus").replace("sub", "minus")]


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    """Chat prompts as token ids, rendered with SmolLM2's template (ChatML) the way the benchmark renders them."""
    _, tokenizer = load_target(cache_dir=TARGET_CACHE)
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def ngram_bench(prompt_ids, tmp_path_factory):
    """Baseline and ngram-simple at k=3 on SmolLM2, concurrency 1 and 2 (one thread each: the machine is shared)."""
    logs = tmp_path_factory.mktemp("engine-logs")
    return run_engine_benchmark(LlamaCppEngine(smollm2_gguf_path(), parallel=2, n_threads=1), prompt_ids,
                                draft_tokens=(), ngram="ngram-simple", ngram_k=3, concurrency=[1, 2],
                                max_new_tokens=MAX_NEW, log_dir=logs)


def run(coro, timeout_s: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


# ---------------------------------------------------------------- the llama.cpp API on real servers


@pytest.mark.timeout(240)
def test_llamacpp_api_reports_tokens_ids_and_draft_counters(ngram_bench, tmp_path):
    result = ngram_bench.result
    assert [(lv.config, lv.concurrency) for lv in result.levels] == [
        ("baseline", 1), ("baseline", 2), ("ngram-simple-k3", 1), ("ngram-simple-k3", 2)]
    for lv in result.levels:
        assert [r.prompt_index for r in lv.requests] == [0, 1, 2]
        for r in lv.requests:
            assert r.tokens_source == "timings" and 0 < r.completion_tokens <= MAX_NEW
            assert r.finish_reason in ("eos", "limit")
            # ASCII answers: every generated id was streamed (the stop id included, as predicted_n counts it)
            assert len(r.output_ids) == r.completion_tokens
            assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s
    for lv in result.levels[:2]:  # the baseline reports no draft counters and no verify rounds
        assert lv.draft_n is None and lv.spec_verify_ct is None and lv.accept_length_token_weighted is None
    ngram = result.level("ngram-simple-k3", 1)
    assert ngram.draft_n > 0 and 0 < ngram.draft_n_accepted <= ngram.draft_n  # copying: n-gram lookup drafts
    for r in ngram.requests:  # target forwards after the prefill = generated - 1 - accepted drafts
        assert r.spec_verify_ct == r.completion_tokens - 1 - r.draft_n_accepted
    assert ngram.accept_length_token_weighted == pytest.approx(ngram.completion_tokens / ngram.spec_verify_ct)
    assert ngram.accept_length_token_weighted > 1.1
    assert ngram.draft_accept_rate == pytest.approx(ngram.draft_n_accepted / ngram.draft_n)

    rows = ngram_bench.rows()
    assert all(r["server_build"].startswith("b") for r in rows)
    by = {(r["config"], r["concurrency"]): r for r in rows}
    assert by["baseline", 1]["speedup_vs_baseline"] == 1.0 and by["baseline", 1]["lossless"] is None
    # the baseline ran again after the n-gram server: its speed is recorded, its greedy ids are the first run's
    assert by["baseline", 1]["baseline_recheck_tok_s"] > 0 and by["baseline", 1]["baseline_recheck_identical"]
    assert by["ngram-simple-k3", 1]["accept_needed"] is not None  # break-even from the measured round cost
    assert by["ngram-simple-k3", 1]["ttft_p50_ms"] <= by["ngram-simple-k3", 1]["ttft_p90_ms"]
    png = plot_engine_benchmark(rows, tmp_path / "serving.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(240)
def test_greedy_ngram_output_is_the_baselines_token_for_token(ngram_bench):
    check = ngram_bench.report("ngram-simple-k3").lossless
    assert (check.identical, check.total, check.first_divergence) == (3, 3, None)
    assert [c.concurrency for c in ngram_bench.report("ngram-simple-k3").batched] == [2]  # information only
    base = ngram_bench.result.level("baseline", 1)
    ngram = ngram_bench.result.level("ngram-simple-k3", 1)
    assert [r.output_ids for r in ngram.requests] == [r.output_ids for r in base.requests]
    lines = ngram_bench.verdict()
    assert any(line.startswith("lossless at concurrency 1") and "ngram-simple-k3 3/3" in line for line in lines)
    assert not any("NOT LOSSLESS" in line for line in lines)


@pytest.mark.timeout(180)
def test_a_declared_baseline_that_drafts_and_a_declared_drafter_that_does_not_are_errors(prompt_ids, tmp_path):
    # The same flags the benchmark gives its n-gram server (draft length 3, lookup 3).
    (ngram,) = [c for c in engine_configs(None, (), "ngram-simple", 3) if c.speculation is not None]
    with LlamaCppServer(smollm2_gguf_path(), n_threads=1, speculation=ngram.speculation,
                        log_path=tmp_path / "ngram.log") as server:
        cfg = ServerConfig("baseline", url=server.base_url, api="llamacpp")
        with pytest.raises(BaselineSpeculates, match=r"'baseline'.*timings.draft_n"):
            run(run_online_benchmark(None, prompt_ids[:1], [cfg], [1], MAX_NEW, warmup=0))
    with LlamaCppServer(smollm2_gguf_path(), n_threads=1, log_path=tmp_path / "plain.log") as server:
        cfg = ServerConfig("eagle3-k3", speculative=True, url=server.base_url, api="llamacpp")
        with pytest.raises(SpecMetricsMissing, match=r"'eagle3-k3'.*no response carries timings.draft_n") as ei:
            run(run_online_benchmark(None, prompt_ids[:1], [cfg], [1], 8, warmup=0))
        assert "1.0" not in str(ei.value)
        # an n-gram config that found nothing to draft on a short answer is not an error when its
        # speculation was verified at start (expect_drafts=False): its acceptance is what it is
        cfg = ServerConfig("ngram-simple-k3", speculative=True, url=server.base_url, api="llamacpp",
                           expect_drafts=False)
        (lv,) = run(run_online_benchmark(None, prompt_ids[:1], [cfg], [1], 8, warmup=0)).levels
        assert lv.draft_n == 0 and lv.spec_verify_ct == lv.completion_tokens - 1


# ---------------------------------------------------------------- the parts, on recorded events


def _events(ids: list[int], timings: dict, stop_type: str = "limit") -> list[dict]:
    return ([{"content": "x", "tokens": [t], "stop": False} for t in ids]
            + [{"content": "", "tokens": [], "stop": True, "stop_type": stop_type, "timings": timings}])


def test_llamacpp_completion_from_recorded_events():
    spec = ServerConfig("eagle3-k2", speculative=True, api="llamacpp")
    done = llamacpp_completion(_events([5, 6, 7, 8, 9], {"predicted_n": 5, "draft_n": 6, "draft_n_accepted": 2}), spec)
    assert done == {"completion_tokens": 5, "spec_verify_ct": 2, "draft_n": 6, "draft_n_accepted": 2,
                    "finish_reason": "limit", "output_ids": (5, 6, 7, 8, 9)}
    # llama.cpp leaves the counters out when nothing was drafted: 0, and every forward a plain step
    done = llamacpp_completion(_events([5, 6, 2], {"predicted_n": 3}, "eos"), spec)
    assert (done["draft_n"], done["draft_n_accepted"], done["spec_verify_ct"]) == (0, 0, 2)
    base = ServerConfig("baseline", api="llamacpp")
    assert llamacpp_completion(_events([5], {"predicted_n": 1}), base)["spec_verify_ct"] is None
    with pytest.raises(BaselineSpeculates, match="draft_n=4"):
        llamacpp_completion(_events([5, 6], {"predicted_n": 2, "draft_n": 4, "draft_n_accepted": 1}), base)
    with pytest.raises(BenchmarkError, match="ended before the request finished"):
        llamacpp_completion(_events([5, 6], {"predicted_n": 2})[:-1], spec)


def _level(config: str, outputs: list[list[int]], concurrency: int = 1) -> LevelResult:
    reqs = tuple(RequestMetrics(config, concurrency, i, len(ids), 0.1, 0.2, None, None, "limit", "timings",
                                output_ids=tuple(ids)) for i, ids in enumerate(outputs))
    return LevelResult(config, False, concurrency, 1.0, reqs)


def test_the_lossless_check_counts_and_names_the_first_divergence():
    base = _level("baseline", [[1, 2, 3], [4, 5, 6], [7, 8]])
    same = compare_outputs(_level("eagle3-k2", [[1, 2, 3], [4, 5, 6], [7, 8]]), base)
    assert same.passed and same.summary() == "3/3"
    diff = compare_outputs(_level("eagle3-k2", [[1, 2, 3], [4, 9, 6], [7, 8, 1]]), base)
    assert (diff.identical, diff.total) == (1, 3) and not diff.passed
    assert diff.first_divergence == "prompt 1, new token 1: 9 instead of 5"
    assert diff.summary() == "1/3 (first divergence: prompt 1, new token 1: 9 instead of 5)"


def test_llamacpp_configs_and_their_speculation_flags():
    configs = engine_configs(Path("d.gguf"), [1, 3], "ngram-mod", 4)
    assert [(c.label, c.drafter, c.k) for c in configs] == [
        ("baseline", "baseline", None), ("eagle3-k1", "eagle3", 1), ("eagle3-k3", "eagle3", 3),
        ("ngram-mod-k4", "ngram-mod", 4)]
    assert not any(a.startswith("--spec-ngram") for a in configs[1].speculation.args())
    assert configs[3].speculation.args()[-4:] == ["--spec-ngram-mod-n-max", "4", "--spec-ngram-mod-n-min", "1"]
    assert engine_configs(None, [], "ngram-simple", 3)[1].speculation.args()[-4:] \
        == ["--spec-ngram-simple-size-m", "3", "--spec-ngram-simple-size-n", "3"]
    with pytest.raises(ValueError, match="needs the draft GGUF"):
        engine_configs(None, [1], None)


# ---------------------------------------------------------------- the benchmark flow, end to end


@pytest.fixture(scope="module")
def tiny_target_gguf(tiny_target, tmp_path_factory) -> Path:
    """The tiny random target converted to a float32 GGUF by the pinned llama.cpp converter."""
    from serving.llamacpp.export import llamacpp_converter

    script, _ = llamacpp_converter()
    out = tmp_path_factory.mktemp("tiny-gguf") / "target.gguf"
    done = subprocess.run([sys.executable, str(script), str(tiny_target), "--outfile", str(out), "--outtype", "f32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.mark.timeout(900)
def test_benchmark_flow_serves_the_exported_draft_on_llama_server(prefect_api, tmp_path, workspace, tiny_target,
                                                                  tiny_target_gguf):
    from flows.benchmark import benchmark
    from flows.tables import serving_view
    from flows.extract import extract
    from flows.train import train
    from tasks.config import BenchConfig, TrainConfig

    ws = workspace
    import_generations(ws, tmp_path, conversations(16, seed=5))
    extract(extract_config(ws, tiny_target, draft_vocab_size=256, shard_bytes=150_000))
    target = {"model_path": str(tiny_target), "dtype": "float32", "device": "cpu"}
    s = train(TrainConfig.model_validate({"workspace": str(ws), "run_name": "t", "target": target, "ttt_steps": 2,
                                          "batch_tokens": 1024, "lr": 3e-3, "epochs": 2, "checkpoint_every": 50}))
    assert "gguf" in s.exports

    serving = {"target_gguf": str(tiny_target_gguf), "draft_tokens": [1, 2], "ngram": "ngram-simple",
               "ngram_tokens": 2, "parallel": 2, "n_threads": 1, "concurrency": [1, 2], "max_new_tokens": 16}
    cfg = BenchConfig(workspace=str(ws), target=target, prompts_per_domain=2, max_new_tokens=16, draft_tokens=2,
                      baselines=False, serving=serving)
    b = benchmark(cfg)
    assert b.draft_gguf == str(Path(s.exports["gguf"]) / "draft.gguf")
    configs = ["baseline", "eagle3-k1", "eagle3-k2", "ngram-simple-k2"]
    assert [(r["config"], r["concurrency"]) for r in b.serving_rows] == [(c, n) for c in configs for n in (1, 2)]
    by = {(r["config"], r["concurrency"]): r for r in b.serving_rows}
    for k in (1, 2):
        row = by[f"eagle3-k{k}", 1]
        assert row["draft_n"] > 0 and row["acceptance"] >= 1.0 and row["verify_rounds"] > 0
        # greedy: the draft changes how fast, never what (the same ids as the baseline, prompt by prompt)
        assert row["lossless_identical"] == row["lossless_total"] == 2, row["lossless"]
    assert by["eagle3-k1", 2]["lossless_informational"] and not by["eagle3-k1", 1]["lossless_informational"]
    assert any(line.startswith("llama.cpp: concurrency 1: on llama.cpp the EAGLE-3 draft is") for line in b.serving_lines)
    assert b.serving_lines[-1].startswith("llama.cpp: online vs offline acceptance at k=2, same prompts: llama-server")
    assert Path(b.serving_png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    store = LineageStore(ws / "lineage.duckdb")
    _, stored = store.reports.query_readonly(
        f"SELECT config_label, drafter, concurrency, output_tok_s > 0, ttft_p90_s >= ttft_p50_s, server_build, "
        f"acceptance_token_weighted IS NOT NULL FROM benchmark_results WHERE bench_id = '{b.bench_id}' "
        f"AND kind = 'serving' ORDER BY config_label, concurrency")
    assert [(r[0], r[2]) for r in stored] == sorted((f"llamacpp/{c}", n) for c in configs for n in (1, 2))
    assert all(r[3] and r[4] and r[5].startswith("b") for r in stored)
    assert all(r[6] == (r[1] != "baseline") for r in stored)
    # `eagle3 run` prints the same table from the store (the latest serving benchmark of the checkpoint)
    report = store.reports.pipeline("t")["serving"]
    assert sorted(serving_view(report)[1]) == sorted(serving_view(b.serving_rows)[1])
    assert [r for r in report if r.get("offline_agreement")][0]["offline_agreement"]["k"] == 2

    # without a GGUF export of the checkpoint, the serving benchmark says what is missing before measuring
    for p in Path(s.exports["gguf"]).iterdir():
        p.unlink()
    with pytest.raises(LineageError, match=r"benchmark.serving: the draft GGUF .*draft.gguf does not exist"):
        benchmark(cfg)
