"""serving.bench.online against real processes on loopback.

The baseline path runs against the real llama.cpp server on SmolLM2 (OpenAI streaming API, one
request at a time, as that server serves). The speculative path runs against the scripted server in
its SGLang mode: `/generate` streams SSE events whose final `meta_info` carries `completion_tokens`
and `spec_verify_ct` for a scripted acceptance length, and time per verify round is scripted, so the
expected acceptance and break-even numbers are known. Timing asserts are ratios with wide margins.
"""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest

from serving.llamacpp.server import LlamaCppServer
from serving.bench.online import (AcceptanceTooLow, BaselineSpeculates, OnlineBenchResult, ServerConfig,
                                  SpecMetricsMissing, break_even, plot_throughput, probe_acceptance,
                                  run_online_benchmark)
from serving.scripted_server import spawn
from tasks.model.target import smollm2_gguf_path

MAX_NEW = 20  # divisible by the scripted acceptance lengths below: exact expected values


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """Scripted SGLang-like servers, one process each: a baseline and speculative configs."""
    logs = tmp_path_factory.mktemp("scripted")
    specs = {
        "baseline": ["--step-latency", "0.01"],
        "spec-2.5": ["--spec-accept-length", "2.5", "--step-latency", "0.015"],
        "spec-1.25": ["--spec-accept-length", "1.25", "--step-latency", "0.015"],
        "spec-1.0": ["--spec-accept-length", "1.0", "--spec-num-draft-tokens", "5"],
        "fast-2.5": ["--spec-accept-length", "2.5"],
        "no-verify-ct": ["--spec-accept-length", "2.5", "--spec-missing-verify-ct"],
    }
    procs: list[subprocess.Popen] = []
    urls = {}
    try:
        for name, args in specs.items():
            proc, urls[name] = spawn("--answer-tokens", "64", *args, log_path=logs / f"{name}.log")
            procs.append(proc)
        yield urls
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def prompts(n: int, tag: str = "p") -> list[str]:
    return [f"<|im_start|>user\n{tag} question {i}<|im_end|>\n<|im_start|>assistant\n" for i in range(n)]


# ---------------------------------------------------------------- baseline: the real llama.cpp server


@pytest.mark.slow  # starts a server: not in `make test-fast`
@pytest.mark.timeout(120)
def test_baseline_on_the_real_llama_cpp_server(tmp_path):
    chat = [{"role": "user", "content": "Name three colours."}]
    rendered = "<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n"
    # One thread: llama.cpp's worker threads spin, and two of them on a busy 2-core machine stall each other.
    with LlamaCppServer(smollm2_gguf_path(), n_threads=1, log_path=tmp_path / "llama.log") as server:
        cfg = ServerConfig("llama.cpp", url=server.base_url, api="openai", extra_body={"repeat_penalty": 1.0})
        result = run(run_online_benchmark(None, [chat, rendered], [cfg], [1], 16, warmup=0), 90)
        # The server's own count for the chat prompt (non-streaming usage), to check the stream count.
        body = {"messages": chat, "max_tokens": 16, "temperature": 0.0, "repeat_penalty": 1.0}
        usage = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]

    (level,) = result.levels
    assert level.config == "llama.cpp" and level.concurrency == 1 and not level.speculative
    assert [r.prompt_index for r in level.requests] == [0, 1]
    for r in level.requests:
        assert 0 < r.completion_tokens <= 16
        assert r.tokens_source in ("usage", "stream_chunks")
        assert r.finish_reason in ("length", "stop")
        assert r.finish_reason != "length" or r.completion_tokens == 16
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s
        assert r.spec_verify_ct is None and r.accept_length is None
    assert level.requests[0].completion_tokens == usage["completion_tokens"]
    assert level.output_tok_s > 0 and level.wall_s >= max(r.latency_s for r in level.requests)
    (row,) = result.to_rows()
    assert row["speedup_vs_baseline"] == 1.0 and row["accept_len_token_weighted"] is None
    assert row["ttft_p50_ms"] <= row["ttft_p90_ms"] and row["latency_p50_ms"] > 0


def test_a_speculative_config_must_speak_generate():
    cfg = ServerConfig("eagle3-over-openai", speculative=True, url="http://127.0.0.1:9", api="openai")
    with pytest.raises(ValueError, match="eagle3-over-openai.*spec_verify_ct"):
        run(run_online_benchmark(None, ["x"], [cfg], [1], 8))


# ---------------------------------------------------------------- speculative metrics (scripted SGLang)


def test_token_weighted_acceptance_equals_the_scripted_value(scripted):
    cfg = ServerConfig("eagle3", speculative=True, url=scripted["fast-2.5"])
    result = run(run_online_benchmark(None, prompts(6), [cfg], [1, 3], MAX_NEW))
    assert [lv.concurrency for lv in result.levels] == [1, 3]
    for lv in result.levels:
        assert len(lv.requests) == 6 and lv.completion_tokens == 6 * MAX_NEW
        assert lv.spec_verify_ct == 6 * 8  # 20 tokens / 2.5 per round
        assert lv.accept_length_token_weighted == 2.5
        assert lv.accept_length_request_mean == 2.5
        assert all(r.tokens_source == "meta_info" and r.ttft_s <= r.latency_s for r in lv.requests)
        assert lv.spec_accept_rate_mean == pytest.approx((2.5 - 1) / 3)  # SGLang's formula with 4 draft tokens
    row = result.to_rows()[0]
    assert row["accept_len_token_weighted"] == 2.5 and row["accept_len_request_mean"] == 2.5


def test_per_request_mean_is_reported_apart_from_the_token_weighted_value(scripted):
    # One long request accepting 4 tokens per round, one short (stops after 4 tokens) accepting 1.
    uneven = ["long answer accept=4.0", "short answer accept=1.0 len=4"]
    cfg = ServerConfig("eagle3", speculative=True, url=scripted["fast-2.5"])
    (lv,) = run(run_online_benchmark(None, uneven, [cfg], [2], MAX_NEW, warmup=0)).levels
    assert [(r.completion_tokens, r.spec_verify_ct) for r in lv.requests] == [(20, 5), (4, 4)]
    assert lv.accept_length_token_weighted == pytest.approx(24 / 9)
    assert lv.accept_length_request_mean == pytest.approx((4.0 + 1.0) / 2)
    row = lv.to_row()
    assert row["accept_len_token_weighted"] == round(24 / 9, 3) and row["accept_len_request_mean"] == 2.5


def test_a_missing_spec_verify_ct_is_an_error_naming_the_config(scripted):
    cfg = ServerConfig("eagle3-k4", speculative=True, url=scripted["no-verify-ct"])
    with pytest.raises(SpecMetricsMissing, match=r"'eagle3-k4'.*spec_verify_ct") as ei:
        run(run_online_benchmark(None, prompts(3), [cfg], [1], MAX_NEW))
    assert "1.0" not in str(ei.value)


def test_a_baseline_that_speculates_is_an_error(scripted):
    cfg = ServerConfig("baseline", speculative=False, url=scripted["fast-2.5"])
    with pytest.raises(BaselineSpeculates, match="'baseline'.*spec_verify_ct"):
        run(run_online_benchmark(None, prompts(2), [cfg], [1], MAX_NEW))


def test_message_lists_need_the_template_for_generate(scripted):
    chat = [[{"role": "user", "content": "hello"}]]
    cfg = ServerConfig("eagle3", speculative=True, url=scripted["fast-2.5"])
    with pytest.raises(ValueError, match="render="):
        run(run_online_benchmark(None, chat, [cfg], [1], MAX_NEW))

    def render(messages) -> str:
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"

    (lv,) = run(run_online_benchmark(None, chat, [cfg], [1], MAX_NEW, render=render)).levels
    assert lv.accept_length_token_weighted == 2.5


# ---------------------------------------------------------------- the acceptance probe


def test_the_probe_raises_with_the_likely_causes_at_acceptance_one(scripted):
    with pytest.raises(AcceptanceTooLow) as ei:
        run(probe_acceptance(scripted["spec-1.0"], prompts(25), threshold=1.3, num_draft_tokens=5))
    err, message = ei.value, str(ei.value)
    assert err.measured == 1.0 and err.threshold == 1.3 and len(err.result.requests) == 20
    for needle in ("--speculative-algorithm EAGLE3", "midlayer", "eagle_config", "off by one", "d2t",
                   "template", "0.20", "1/num_draft_tokens", "token-weighted"):
        assert needle in message, needle


def test_the_probe_passes_at_acceptance_two_and_a_half(scripted):
    level = run(probe_acceptance(scripted["fast-2.5"], prompts(20), threshold=1.3, max_new_tokens=MAX_NEW))
    assert level.accept_length_token_weighted == 2.5 and len(level.requests) == 20


def test_the_probe_refuses_a_server_that_does_not_speculate(scripted):
    with pytest.raises(SpecMetricsMissing):
        run(probe_acceptance(scripted["baseline"], prompts(20), max_new_tokens=4))


# ---------------------------------------------------------------- break-even and the plot


def test_break_even_is_consistent_with_the_measured_speedup(scripted, tmp_path):
    # Baseline: 10 ms per token. Speculative: 15 ms per verify round, so break-even is ~1.5 tokens
    # per round: 2.5 beats it, 1.25 does not.
    configs = [ServerConfig("baseline", url=scripted["baseline"]),
               ServerConfig("eagle3-2.5", speculative=True, url=scripted["spec-2.5"]),
               ServerConfig("eagle3-1.25", speculative=True, url=scripted["spec-1.25"])]
    result = run(run_online_benchmark(None, prompts(8), configs, [1, 4], MAX_NEW))
    report = result.break_even()
    by = {(b.config, b.concurrency): b for b in report.items}
    assert set(by) == {(c, n) for c in ("eagle3-2.5", "eagle3-1.25") for n in (1, 4)}
    for b in report.items:
        assert 1.1 < b.needed_accept_length < 2.2, b
        assert b.predicted_speedup == pytest.approx(b.measured_accept_length / b.needed_accept_length)
        assert b.beats_baseline == (b.speedup > 1) == (b.predicted_speedup > 1), b
    for n in (1, 4):
        assert by["eagle3-2.5", n].measured_accept_length == 2.5 and by["eagle3-2.5", n].speedup > 1.2
        assert by["eagle3-1.25", n].measured_accept_length == 1.25 and by["eagle3-1.25", n].speedup < 1
    # The standalone form with the baseline's tokens/s gives the same numbers.
    base_tok_s = {n: result.level("baseline", n).output_tok_s for n in (1, 4)}
    again = break_even(base_tok_s, [result.level("eagle3-2.5", 1)])
    assert again.items[0] == by["eagle3-2.5", 1]
    rows = report.to_rows()
    assert {"accept_len_measured_token_weighted", "accept_len_needed", "speedup"} <= set(rows[0])

    speedups = {(r["config"], r["concurrency"]): r["speedup_vs_baseline"] for r in result.to_rows()}
    assert speedups["baseline", 4] == 1.0 and speedups["eagle3-2.5", 4] > 1

    png = plot_throughput(result, tmp_path / "plots" / "tok_s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_runs_of_one_config_each_combine(scripted):
    base = run(run_online_benchmark(scripted["baseline"], prompts(2), [ServerConfig("baseline")], [1], MAX_NEW))
    spec = run(run_online_benchmark(scripted["spec-2.5"], prompts(2), [ServerConfig("eagle3", True)], [1], MAX_NEW))
    combined = OnlineBenchResult.combine([base, spec])
    assert combined.configs == ["baseline", "eagle3"]
    (b,) = combined.break_even().items
    assert b.config == "eagle3" and b.measured_accept_length == 2.5
