"""Servers: the real llama.cpp server on SmolLM2 (start, serve, stop, failures), its agreement with the
transformers target, and the production baseline command lines."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from serving.client import Endpoint, ServerPool
from serving.llamacpp.server import LlamaCppServer, ServerStartError, port_free
from serving.launch import BaselineSpec, kimi_k25_baseline, validate_baseline_command
from serving.sglang.server import sglang_baseline_command
from serving.vllm.server import vllm_baseline_command
from tasks.model.target import greedy_generate, load_target, smollm2_gguf_path

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

GGUF = smollm2_gguf_path()
# One conversion per machine, shared across runs (the first takes ~20 s; later loads < 1 s).
TARGET_CACHE = Path(tempfile.gettempdir()) / "eagle3-test-targets"


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaCppServer(GGUF, port=0, n_ctx=2048, n_threads=2, log_path=log) as s:
        yield s


def _chat(server: LlamaCppServer, messages: list[dict], max_tokens: int, **extra) -> dict:
    body = {"messages": messages, "temperature": 0, "repeat_penalty": 1.0, "max_tokens": max_tokens, **extra}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


# ---- the llama.cpp server ------------------------------------------------------------------------

def test_chat_completion_over_http(server):
    assert server.port != 0 and server.base_url == f"http://127.0.0.1:{server.port}" and server.healthy()
    r = _chat(server, [{"role": "user", "content": "Name the largest ocean on Earth."}], 24)
    choice, usage = r["choices"][0], r["usage"]
    assert isinstance(choice["message"]["content"], str) and "Pacific" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    assert usage["prompt_tokens"] > 20 and 0 < usage["completion_tokens"] <= 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_ctrl_c_stops_the_server_and_propagates(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with LlamaCppServer(GGUF, log_path=tmp_path / "s.log") as s:
            pid, port = s.pid, s.port
            assert _alive(pid) and s.healthy()
            raise KeyboardInterrupt
    assert not _alive(pid) and s.proc is None
    assert port_free("127.0.0.1", port)
    s.stop()  # a second stop is a no-op


def test_a_killed_parent_takes_its_server_along(tmp_path):
    code = ("import sys, time\nfrom serving.llamacpp.server import LlamaCppServer\n"
            f"s = LlamaCppServer({str(GGUF)!r}, log_path={str(tmp_path / 's.log')!r})\n"
            "s.start()\nprint(s.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    try:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        os.kill(parent.pid, signal.SIGKILL)  # no cleanup code runs in the parent
        parent.wait()
        assert _wait_gone(pid, 15), f"server {pid} outlived its killed parent"
    finally:
        parent.kill()


def test_a_bad_gguf_fails_with_the_log_tail(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4092))
    log = tmp_path / "s.log"
    log.write_text("an earlier run's line\n")  # logs are appended to: only this start's lines belong in the error
    s = LlamaCppServer(bad, log_path=log)
    with pytest.raises(ServerStartError) as e:
        s.start()
    message = str(e.value)
    assert "exited with code" in message and str(log) in message
    assert "exiting due to model loading error" in message  # the server's own words, from its log
    assert "earlier run" not in message
    assert s.proc is None


def test_a_server_that_never_becomes_healthy_is_stopped(tmp_path):
    s = LlamaCppServer(GGUF, log_path=tmp_path / "s.log", startup_timeout_s=0.01)
    spawned = []
    real_healthy = s.healthy
    s.healthy = lambda: bool(spawned.append(s.pid)) or real_healthy()
    with pytest.raises(ServerStartError, match="did not answer .*/health within 0 s"):
        s.start()
    assert spawned and not _alive(spawned[0]) and s.proc is None


def test_a_missing_gguf_or_a_busy_port_fail_before_starting(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF"):
        LlamaCppServer(tmp_path / "none.gguf").start()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        # a server already there would answer the health probe of ours: refuse before spawning
        with pytest.raises(ServerStartError, match="already in use"):
            LlamaCppServer(GGUF, port=busy.getsockname()[1], log_path=tmp_path / "s.log").start()


# ---- agreement with the transformers target ------------------------------------------------------

# Q4_1 weights are used as they are by llama.cpp (with 8-bit quantised activations in its dot
# products), and dequantised exactly to float32 by transformers (the target below is float32, never
# the default bf16, whose greedy path and margins depend on the CPU's bf16 rounding): the two
# log-probabilities of a token differ by up to ~0.25 nats (measured), so greedy choices can flip
# wherever the target's top two are near-tied. What must hold is therefore: (1) every token the
# server chose is within MARGIN_NATS of the target's best choice given the same context (a
# repetition penalty of 1.1, llama.cpp's default, misses it by 1.3-1.8 nats on two of these prompts);
# (2) the two greedy outputs agree at least up to the first position where the target's top two
# are closer than MARGIN_NATS: before it a flip is impossible unless something other than arithmetic
# differs. The prompts are chosen so that (2) covers >= 8 leading tokens each (float32: 11, 9, 8;
# the margins before those positions are >= 1.17 nats, far from MARGIN_NATS on any CPU).
MARGIN_NATS = 1.0
AGREEMENT_PROMPTS = ["How do I make a cup of tea?", "Name the largest ocean on Earth.",
                     "What is the chemical symbol for gold?"]
MIN_REQUIRED_PREFIX = 8
MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    # float32, never the default bf16: a bf16 greedy path (and its top-two margins) depends on the
    # CPU's bf16 rounding (AMX/AVX-512-BF16 or not), so the prefix that must agree would too.
    return load_target(cache_dir=TARGET_CACHE, dtype=torch.float32)


def _served(server, messages: list[dict], max_new: int, repeat_penalty: float):
    """The server's greedy answer, token-exact: the prompt ids it was given and the ids it sampled
    (the path regenerate uses), so nothing here rests on re-tokenising text."""
    async def ask():
        async with ServerPool([Endpoint(server.base_url, max_concurrency=1, kind="llamacpp")]) as pool:
            return await pool.chat(messages, temperature=0.0, max_tokens=max_new, repeat_penalty=repeat_penalty)
    return asyncio.run(ask())


def _agreement(server, target, prompt: str, repeat_penalty: float) -> dict:
    """Agreed greedy prefix, the prefix that must agree, and the largest gap of a served token."""
    model, tokenizer = target
    messages = [{"role": "user", "content": prompt}]
    r = _served(server, messages, MAX_NEW, repeat_penalty)
    ours = greedy_generate(model, tokenizer, messages, MAX_NEW)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert r.prompt_token_ids == list(ids)  # the server's template and tokenizer give our ids exactly
    served_full = list(r.completion_token_ids)  # ends with the end-of-turn id when it stopped: stopping must agree too
    if r.finish_reason == "stop":
        assert served_full[-1] == tokenizer.eos_token_id, r
    served = served_full[:-1] if r.finish_reason == "stop" else served_full
    agreed = next((i for i, (a, b) in enumerate(zip(served, ours)) if a != b), min(len(served), len(ours)))
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids + served_full])).logits[0, len(ids) - 1:-1].float(), -1)
        gaps = lp.max(-1).values - lp[torch.arange(len(served_full)), torch.tensor(served_full)]
        ours_lp = torch.log_softmax(model(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1].float(), -1)
    top2 = ours_lp.topk(2, -1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    required = next((i for i, m in enumerate(margins) if m < MARGIN_NATS), len(margins))
    return {"prompt": prompt, "agreed": agreed, "length": len(ours), "required": required,
            "max_gap": float(gaps.max())}


def test_greedy_agrees_with_the_transformers_target(server, target):
    results = [_agreement(server, target, p, repeat_penalty=1.0) for p in AGREEMENT_PROMPTS]
    print("\n" + "\n".join(f"{a['prompt']!r}: agreed {a['agreed']}/{a['length']} tokens, required {a['required']}, "
                            f"largest gap {a['max_gap']:.3f} nats" for a in results))
    for a in results:
        assert a["max_gap"] < MARGIN_NATS, a
        assert a["required"] >= MIN_REQUIRED_PREFIX, f"the prompt no longer tests a prefix: {a}"
        assert a["agreed"] >= a["required"], a


def test_the_agreement_check_catches_a_repetition_penalty(server, target):
    # llama.cpp's default repeat_penalty (1.1) changes the distribution; the check must see it.
    prompts = [AGREEMENT_PROMPTS[0], AGREEMENT_PROMPTS[2]]  # the two it changes within MAX_NEW tokens
    results = [_agreement(server, target, p, repeat_penalty=1.1) for p in prompts]
    print("\n" + "\n".join(f"repeat_penalty 1.1, {a['prompt']!r}: agreed {a['agreed']}, "
                            f"largest gap {a['max_gap']:.3f} nats" for a in results))
    assert max(a["max_gap"] for a in results) >= MARGIN_NATS, results


# ---- production baselines ------------------------------------------------------------------------

def test_kimi_baseline_commands():
    spec = kimi_k25_baseline(port=30000)
    assert sglang_baseline_command(spec) == [
        "python3", "-m", "sglang.launch_server", "--model-path", "moonshotai/Kimi-K2.5", "--tp", "8",
        "--host", "127.0.0.1", "--port", "30000", "--trust-remote-code",
        "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2"]
    assert vllm_baseline_command(spec) == [
        "vllm", "serve", "moonshotai/Kimi-K2.5", "--tensor-parallel-size", "8", "--host", "127.0.0.1",
        "--port", "30000", "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2",
        "--reasoning-parser", "kimi_k2"]
    assert validate_baseline_command(sglang_baseline_command(spec), "sglang", trust_remote_code=True) == []
    assert validate_baseline_command(vllm_baseline_command(spec), "vllm", trust_remote_code=True) == []
    plain = BaselineSpec("/models/llama", gpus=2, context_length=8192, mem_fraction=0.85)
    assert "--trust-remote-code" not in sglang_baseline_command(plain)
    assert sglang_baseline_command(plain)[-4:] == ["--context-length", "8192", "--mem-fraction-static", "0.85"]
    assert vllm_baseline_command(plain)[-4:] == ["--max-model-len", "8192", "--gpu-memory-utilization", "0.85"]
    assert validate_baseline_command(vllm_baseline_command(plain), "vllm", gpus=2) == []


SGLANG = ["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--tp", "8"]
VLLM = ["vllm", "serve", "/m", "--tensor-parallel-size", "8"]


@pytest.mark.parametrize("argv,engine,kwargs,expected", [
    (SGLANG + ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3"], "sglang", {},
     ["--speculative-algorithm, --speculative-num-steps: a baseline must not speculate"]),
    (VLLM + ['--speculative-config={"method": "eagle3"}'], "vllm", {}, ["--speculative-config: a baseline must not"]),
    (VLLM + ["--speculative_config", "{}"], "vllm", {}, ["--speculative-config: a baseline must not"]),
    (VLLM + ["--num-speculative-tokens", "5"], "vllm", {}, ["--num-speculative-tokens: a baseline must not"]),
    (["python3", "-m", "sglang.launch_server", "--tp", "8"], "sglang", {}, ["no model path: give --model-path"]),
    (["vllm", "serve", "--tensor-parallel-size", "8"], "vllm", {}, ["no model path"]),
    (["vllm", "serve", "--model", "/m", "-tp", "8"], "vllm", {}, []),
    (["sglang", "serve", "--model-path", "/m", "--tensor-parallel-size", "8"], "sglang", {}, []),
    (SGLANG, "sglang", {"gpus": 4}, ["tensor-parallel size 8 does not match the 4 GPU(s)"]),
    (["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--tp-size=4"], "sglang", {},
     ["tensor-parallel size 4 does not match the 8 GPU(s)"]),
    (["python3", "-m", "sglang.launch_server", "--model-path", "/m"], "sglang", {},
     ["no tensor-parallel size: the server would use 1 GPU"]),
    (SGLANG + ["--trust-remote-code"], "sglang", {}, ["--trust-remote-code is set but"]),
    (SGLANG + ["--trust-remote-code"], "sglang", {"trust_remote_code": True}, []),
    (SGLANG + ["--disable-cuda-graph"], "sglang", {}, ["--disable-cuda-graph: the baseline must run as production"]),
    (VLLM + ["--enforce-eager"], "vllm", {}, ["--enforce-eager: the baseline must run as production"]),
    (SGLANG, "vllm", {}, ["the command does not start vllm", "no model path", "no tensor-parallel size"]),
    (SGLANG + ["--config", "c.yaml"], "sglang", {}, ["--config: settings inside a config file"]),
])
def test_validate_baseline_command(argv, engine, kwargs, expected):
    problems = validate_baseline_command(argv, engine, **kwargs)
    assert len(problems) == len(expected), problems
    for line, start in zip(problems, expected):
        assert line.startswith(start), (line, start)
