"""The regenerate flow against real server processes: faults, exactly-once resume, imports, flags."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from flows.discover import discover
from flows.regenerate import regenerate
from serving.llamacpp.server import free_port
from serving.scripted_server import answer_for
from storage.generations import Generations
from storage.lineage import LineageStore
from tasks.config import DiscoverConfig, RegenerateConfig
from tasks.regenerate.answers import flags_for, generation_id

pytestmark = pytest.mark.slow  # starts servers, vLLM or `eagle3` processes: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = []
        for t in range(rng.choice([1, 1, 2, 3])):
            turns += [{"from": "human", "value": f"prompt {i} turn {t} {rng.random():.6f}"},
                      {"from": "gpt", "value": f"original answer {i}.{t}"}]
        out.append({"id": f"c{i}", "conversations": turns})
    return out


def discover_prompts(ws: Path, tmp: Path, rows: list[dict]) -> list[tuple[str, list[dict]]]:
    (tmp / "prompts.json").write_text(json.dumps(rows))
    discover(DiscoverConfig.model_validate({
        "workspace": str(ws), "sources": [{"name": "p", "kind": "file", "path": str(tmp / "prompts.json")}],
        "decontaminate": {"enabled": False}, "near_dedupe": {"enabled": False}}))
    return LineageStore(ws / "lineage.duckdb").generations.pending_prompts("none", True, None)


def expected_all_mode(messages: list[dict], max_tokens: int) -> list[dict]:
    """What mode `all` must produce against the scripted server: its answer to each context."""
    ctx, out = [], []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            continue
        ctx.append({"role": m["role"], "content": m["content"]})
        out.append({"role": m["role"], "content": m["content"]})
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] == "user" and nxt != "user":
            text, _ = answer_for(ctx, max_tokens)
            if any("EMPTY" in c["content"] for c in ctx):  # the scripted server's empty-answer marker
                text = ""
            ctx.append({"role": "assistant", "content": text})
            out.append({"role": "assistant", "content": text})
    return out


def regen_config(ws: Path, urls: list[str], **extra) -> RegenerateConfig:
    return RegenerateConfig.model_validate({
        "workspace": str(ws), "target_model": "scripted", "target_revision": "r1",
        "endpoints": [{"url": u, "max_concurrency": 4} for u in urls],
        "sampling": {"max_tokens": 64},
        "retry": {"max_attempts": 6, "backoff_base_s": 0.02, "backoff_max_s": 0.2, "read_timeout_s": 1.0,
                  "connect_timeout_s": 1.0, "probe_interval_s": 0.5},
        "write_batch": 16,
        **extra,
    })


def generated(ws: Path) -> dict[str, dict]:
    """Every generation in the registered Parquet files, by prompt id (asserting no duplicates)."""
    store = LineageStore(ws / "lineage.duckdb")
    _, files = store.reports.query_readonly("SELECT file, params_key FROM generation_files")
    rows = []
    for name, key in files:
        rows += pq.read_table(ws / "data" / "generations" / key / name).to_pylist()
    ids = [r["generation_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a generation was written twice"
    return {r["prompt_id"]: r for r in rows}


def test_faulty_servers_every_prompt_generated_or_failed_with_reason(prefect_api, scripted, tmp_path, workspace):
    rows = conversations(60) + [{"id": "poison", "conversations": [{"from": "human", "value": "POISON pill"}]},
                                {"id": "empty", "conversations": [{"from": "human", "value": "say nothing EMPTY"}]}]
    prompts = discover_prompts(workspace, tmp_path, rows)
    faulty = scripted("--fail-500", "0.08", "--fail-429", "0.04", "--retry-after", "0.05", "--hang", "0.02",
                      "--hang-s", "3", "--reset", "0.03", "--malformed", "0.03", "--truncated", "0.03", "--seed", "3")
    healthy = scripted()
    cfg = regen_config(workspace, [faulty, healthy])
    summary = regenerate(cfg)
    assert summary.generated + summary.failed == len(prompts) == summary.pending_at_start
    assert summary.failed == 1

    gens = generated(workspace)
    store = LineageStore(workspace / "lineage.duckdb")
    _, fails = store.reports.query_readonly("SELECT p.messages[1].content, f.reason, f.attempts FROM generation_failures f JOIN prompts p USING (prompt_id)")
    assert fails == [("POISON pill", fails[0][1], 6)] and "HTTP 500" in fails[0][1]
    for prompt_id, messages in prompts:
        if "POISON" in messages[0]["content"]:
            assert prompt_id not in gens
            continue
        g = gens[prompt_id]
        assert [{"role": m["role"], "content": m["content"]} for m in g["messages"]] == expected_all_mode(messages, 64)
        assert g["generation_id"] == generation_id(prompt_id, summary.params_key)
        assert all(t["finish_reason"] == "stop" and t["endpoint"] in (faulty, healthy) for t in g["turns"])
    empty = next(g for g in gens.values() if "EMPTY" in g["messages"][0]["content"])
    assert empty["flags"] == ["empty"]
    _, flagged = store.reports.query_readonly("SELECT count(*) FROM generations WHERE len(flags) > 0")
    assert flagged == [(1,)]

    # A rerun generates nothing; --retry-failed retries only the failure (which fails again).
    again = regenerate(cfg)
    assert again.pending_at_start == 0 and again.generated == 0
    retried = regenerate(cfg.model_copy(update={"retry_failed": True}))
    assert retried.pending_at_start == 1 and retried.failed == 1
    assert store.reports.query_readonly("SELECT count(*) FROM generation_failures")[1] == [(2,)]
    _, prog = store.reports.query_readonly("SELECT done, pending, failed, tokens > 0 FROM progress WHERE stage = 'regenerate'")
    assert prog == [(len(prompts) - 1, 0, 1, True)]


def test_mode_last_keeps_original_context_and_length_is_flagged(prefect_api, scripted, tmp_path, workspace):
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "orig"},
                                           {"from": "human", "value": "second"}, {"from": "gpt", "value": "orig2"}]}]
    [(pid, messages)] = discover_prompts(workspace, tmp_path, rows)
    url = scripted()
    summary = regenerate(regen_config(workspace, [url], mode="last", sampling={"max_tokens": 5}))
    g = generated(workspace)[pid]
    text, finish = answer_for([{"role": m["role"], "content": m["content"]} for m in messages], 5)
    assert [m["content"] for m in g["messages"]] == ["first", "orig", "second", text]
    assert finish == "length" and g["flags"] == ["length"]
    assert summary.flagged_length == 1


def test_flags_for():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]
    assert flags_for(msgs, [{"finish_reason": "length"}], True) == ["empty", "length"]
    assert flags_for(msgs, [{"finish_reason": "length"}], False) == ["empty"]
    assert flags_for([{"role": "assistant", "content": "x"}], [{"finish_reason": "stop"}], True) == []


def test_reasoning_disable_is_sent_to_the_server(prefect_api, tmp_path, workspace):
    from tasks.regenerate.answers import request_params

    cfg = regen_config(workspace, ["http://127.0.0.1:1"], reasoning="disable")
    assert request_params(cfg)["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in request_params(regen_config(workspace, ["http://127.0.0.1:1"]))


def test_imports_skip_the_server_and_pass_discover_checks(prefect_api, scripted, tmp_path, workspace):
    from tasks.discover.decontaminate import humaneval_items

    imported = [
        {"messages": [{"role": "user", "content": "imported question"}, {"role": "assistant", "content": "target answer"}],
         "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]},
        {"messages": [{"role": "user", "content": "Complete: " + humaneval_items()[0].text},
                      {"role": "assistant", "content": "code"}]},  # contaminated: not imported
        {"messages": [{"role": "user", "content": "no answer yet"}]},  # a prompt only: regenerated
        {"oops": 1},  # quarantined
    ]
    path = tmp_path / "seed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in imported))
    url = scripted()
    cfg = regen_config(workspace, [url], imports=[{"name": "seed", "path": str(path)}])
    summary = regenerate(cfg)
    assert summary.imported == 1 and summary.generated == 1
    gens = generated(workspace)
    imp = next(g for g in gens.values() if g["origin"] == "import")
    assert imp["input_ids"] == [1, 2, 3, 4, 5] and imp["messages"][-1]["content"] == "target answer"
    store = LineageStore(workspace / "lineage.duckdb")
    _, outs = store.reports.query_readonly("SELECT record_key, outcome FROM record_outcomes WHERE source = 'import:seed' ORDER BY 1")
    assert outs == [("L1", "kept"), ("L2", "contaminated"), ("L3", "kept"), ("L4", "quarantined")]
    _, lin = store.reports.query_readonly("SELECT origin, completion_tokens, has_token_ids FROM generations ORDER BY origin")
    assert lin[0] == ("import", 3, True)
    assert regenerate(cfg).imported == 0  # importing again adds nothing

    # Imports only, with a prompt pending ("no answer yet" got its answer above; a new one has not):
    # the run imports and stops, leaving the prompt for a run with a server.
    (tmp_path / "more.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "still unanswered"}]}) + "\n")
    only = regen_config(workspace, [], imports=[{"name": "more", "path": str(tmp_path / "more.jsonl")}])
    s = regenerate(only)
    assert (s.imported, s.generated, s.pending_at_start) == (0, 0, 1)


def test_kill_9_five_times_then_resume_gives_exactly_the_expected_generations(prefect_api, scripted, tmp_path, workspace):
    prompts = discover_prompts(workspace, tmp_path, conversations(150, seed=5))
    url = scripted("--latency", "0.1", "--fail-500", "0.05")
    cfg = regen_config(workspace, [url], write_batch=4).model_dump(mode="json")
    cfg["endpoints"][0]["max_concurrency"] = 2
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({"workspace": str(workspace), "discover": {
        "sources": [{"name": "p", "kind": "file", "path": str(tmp_path / "prompts.json")}]}, "regenerate": cfg}))
    store = LineageStore(workspace / "lineage.duckdb")
    rng = random.Random(11)
    partial = []
    for target in (15, 40, 65, 90, 115):
        p = subprocess.Popen([sys.executable, "-m", "flows.cli", "regenerate", "--config", str(cfg_path)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None:
            if store.reports.query_readonly("SELECT count(*) FROM generations")[1][0][0] >= target:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.3))  # anywhere: mid-request, mid-file-write, mid-commit
        # send_signal, not os.kill(p.pid): a run that already ended was reaped by poll(), and its pid
        # is no longer ours to signal (ProcessLookupError, or another process's pid)
        p.send_signal(signal.SIGKILL)
        p.wait()
        partial.append(store.reports.query_readonly("SELECT count(*) FROM generations")[1][0][0])
    assert partial[-1] < len(prompts), "the kills must land before the work is done"
    out = subprocess.run([sys.executable, "-m", "flows.cli", "regenerate", "--config", str(cfg_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    gens = generated(workspace)
    key = next(iter(gens.values()))["params_key"]
    assert set(gens) == {pid for pid, _ in prompts}
    assert {g["generation_id"] for g in gens.values()} == {generation_id(pid, key) for pid, _ in prompts}
    _, n = store.reports.query_readonly("SELECT count(*), count(DISTINCT generation_id), count(DISTINCT prompt_id) FROM generations")
    assert n == [(len(prompts), len(prompts), len(prompts))]
    # nothing left on disk that the lineage store does not know
    on_disk = {p.name for p in (workspace / "data" / "generations" / key).iterdir()}
    assert on_disk == {f for (f,) in store.reports.query_readonly("SELECT file FROM generation_files")[1]}


def test_sglang_generate_returns_token_ids(scripted):
    import asyncio

    from serving.client import Endpoint, ServerPool

    url = scripted()

    async def main():
        async with ServerPool([Endpoint(url)]) as pool:
            return await pool.request({"text": "hello", "sampling_params": {"max_new_tokens": 4}}, path="/generate")

    r = asyncio.run(main())
    expected = [int(x, 16) for x in answer_for([{"role": "user", "content": "hello"}], 1 << 30)[0].split()][:4]
    assert r.completion_token_ids == expected and r.finish_reason == "length" and r.completion_tokens == 4


def test_api_key_from_a_prefect_secret_block(prefect_api):
    from prefect.blocks.system import Secret

    from serving.client import Endpoint, resolve_api_key

    Secret(value="sk-from-block-123").save("eagle3-test-key", overwrite=True)
    ep = Endpoint("http://127.0.0.1:1", api_key_secret_block="eagle3-test-key")
    assert resolve_api_key(ep) == "sk-from-block-123"
    assert "sk-from" not in repr(ep)


def test_a_pool_uses_the_secret_block_key(prefect_api, scripted):
    import asyncio

    from prefect.blocks.system import Secret

    from serving.client import Endpoint, ServerPool

    Secret(value="sk-pool-456").save("eagle3-pool-key", overwrite=True)
    url = scripted()

    async def main():
        async with ServerPool([Endpoint(url, api_key_secret_block="eagle3-pool-key")]) as pool:
            return pool._headers(pool._states[0]), await pool.chat([{"role": "user", "content": "hi"}])

    headers, r = asyncio.run(main())
    assert headers == {"Authorization": "Bearer sk-pool-456"} and r.content


def test_baseline_launch_command_is_printed_and_validated(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "flows.cli", "regenerate", "--config", "configs/kimi-k25.yaml",
                         "--print-baseline-command"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split()[:3] == ["python3", "-m", "sglang.launch_server"] and "--tp 8" in ok.stdout
    assert "speculative" not in ok.stdout
    cfg = yaml.safe_load((ROOT / "configs" / "kimi-k25.yaml").read_text())
    cfg["regenerate"]["baseline_launch"]["extra_args"] = ["--speculative-algorithm", "EAGLE3"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "regenerate", "--config", str(bad), "--print-baseline-command"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "speculative" in out.stderr.lower()


def test_regenerate_with_the_embedded_llama_cpp_server(prefect_api, tmp_path, workspace):
    """The demo's path: the real llama-server on SmolLM2 (two slots), started and stopped by the flow;
    token-exact, so the extract stage's id check sees `match`, and the server's build is in lineage."""
    from tasks.extract.chat import tokenise_generation
    from tasks.model.target import gguf_revision, load_target, smollm2_gguf_path

    rows = [{"id": "a", "conversations": [{"from": "human", "value": "Name a colour."}]},
            {"id": "b", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "x"},
                                          {"from": "human", "value": "Now say bye."}]}]
    prompts = discover_prompts(workspace, tmp_path, rows)
    cfg = RegenerateConfig.model_validate({
        "workspace": str(workspace), "target_model": "SmolLM2-135M-Instruct",
        "embedded_server": {"port": free_port(), "n_ctx": 1024},
        "sampling": {"temperature": 0.0, "max_tokens": 12, "repeat_penalty": 1.0}})
    summary = regenerate(cfg)
    assert summary.generated == 2 and summary.failed == 0
    gens = generated(workspace)
    two_turn = gens[next(pid for pid, m in prompts if len(m) == 3)]
    assert [m["role"] for m in two_turn["messages"]] == ["user", "assistant", "user", "assistant"]
    assert all(m["content"].strip() for m in two_turn["messages"])
    assert two_turn["target_revision"] == gguf_revision(smollm2_gguf_path())
    assert two_turn["template_id"].startswith("sha256:")
    assert all(t["completion_tokens"] and t["completion_tokens"] <= 12 for t in two_turn["turns"])
    assert all(len(t["completion_token_ids"]) == t["completion_tokens"] and t["prompt_token_ids"]
               for g in gens.values() for t in g["turns"])
    _, tokenizer = load_target()
    checks = [tokenise_generation(tokenizer, g["messages"], g["turns"][-1], 4096) for g in gens.values()]
    assert [c.id_check for c in checks] == ["match", "match"], [c.mismatch for c in checks]
    _, lineage = LineageStore(workspace / "lineage.duckdb").reports.query_readonly(
        "SELECT DISTINCT has_token_ids, server_build FROM generations")
    assert len(lineage) == 1 and lineage[0][0] is True and lineage[0][1].startswith("llama.cpp b")
    # the server is gone once the flow returns
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{cfg.embedded_server.port}/v1/models", timeout=2)


def test_an_import_interrupted_before_its_commit_is_redone(prefect_api, scripted, tmp_path, workspace, monkeypatch):
    path = tmp_path / "seed.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    cfg = regen_config(workspace, [scripted()], imports=[{"name": "seed", "path": str(path)}])
    real = Generations.write

    def crash(self, *a, **kw):
        raise RuntimeError("power cut")

    monkeypatch.setattr(Generations, "write", crash)
    with pytest.raises(Exception, match="power cut"):
        regenerate(cfg)
    monkeypatch.setattr(Generations, "write", real)
    summary = regenerate(cfg)
    assert summary.imported == 1  # the records were not marked seen without their generation
    assert summary.requeued_files == 1  # the file written before the crash was removed
