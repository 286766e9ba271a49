"""The selection study's bookkeeping (benchmarks/studies/selection.py) and the answer cache it runs arms
through (benchmarks/studies/answer_cache.py, a real process on loopback in front of a scripted server)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.studies.scaling_results import append_result, ratio_interval
from benchmarks.studies.selection import ARMS, arm_config, merge_points, plot, ratio_cell, report, tokens_to_reach
from serving.llamacpp.server import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_tokens_to_reach_interpolates_in_log_size_and_says_when_never():
    curve = [(25_000, 1.40), (12_500, 1.30), (50_000, 1.60)]
    assert tokens_to_reach(curve, 1.30) == 12_500
    assert tokens_to_reach(curve, 1.50) == pytest.approx(2 ** ((15 + 16) / 2) * 25_000 / 2 ** 15, rel=1e-9)
    assert tokens_to_reach(curve, 1.35) == pytest.approx(12_500 * 2 ** 0.5)
    assert tokens_to_reach(curve, 1.61) is None
    assert tokens_to_reach([(10_000, 2.0)], 1.5) == 10_000


def test_the_ratio_interval_is_a_paired_bootstrap_over_prompts():
    # prompt p: [completion tokens, verify rounds]; the draft accepts 1.2-1.6 where lookup accepts 1.3
    draft = {f"p{i}": [60 + 4 * i, 50] for i in range(11)}
    lookup = {f"p{i}": [65, 50] for i in range(11)}
    lo, hi = ratio_interval(draft, lookup)
    point = (sum(t for t, _ in draft.values()) / 550) / 1.3
    assert lo < point < hi and hi - lo > 0.02
    assert ratio_interval(draft, lookup) == (lo, hi)  # seeded: the same report every time
    # the same prompts for both sides: a draft that always equals lookup has no spread at all
    assert ratio_interval(lookup, lookup) == (1.0, 1.0)
    # a prompt only one side decoded is left out, and nothing to pair gives no interval
    assert ratio_interval({**draft, "extra": [1000, 1]}, lookup) == (lo, hi)
    assert ratio_interval(draft, None) is None and ratio_interval({"a": [1, 1]}, {"a": [1, 1]}) is None
    # more prompts, narrower
    many = {f"q{i}": v for i, v in enumerate(list(draft.values()) * 9)}
    lo9, hi9 = ratio_interval(many, {key: [65, 50] for key in many})
    assert hi9 - lo9 < (hi - lo) / 2
    # the report's cell: the ratio, then its interval when the point recorded its prompts
    row = {"eagle3_heldout_chat": point * 1.3, "lookup_heldout_chat": 1.3,
           "eagle3_heldout_chat_per_request": draft, "lookup_heldout_chat_per_request": lookup}
    assert ratio_cell(row, "heldout_chat", "lookup") == f"{point:.2f} ({lo:.2f}-{hi:.2f})"
    assert ratio_cell({k: v for k, v in row.items() if "per_request" not in k}, "heldout_chat", "lookup") == \
        f"{point:.2f}"


def test_each_arm_gets_its_workspace_selection_seed_and_the_proxy():
    from tasks.config import load_config

    cfg = load_config(ROOT / "benchmarks" / "studies" / "selection.yaml")
    arms = {a: arm_config(cfg, Path("/tmp/sel"), a, "http://127.0.0.1:1", "rev", "tmpl") for a in ARMS}
    for arm, c in arms.items():
        assert {c.workspace, c.regenerate.workspace, c.extract.workspace, c.train.workspace,
                c.probe.workspace} == {f"/tmp/sel/{arm}"}
        assert c.regenerate.embedded_server is None and c.regenerate.endpoints[0].url == "http://127.0.0.1:1"
        assert c.regenerate.selection == ARMS[arm]["selection"] and c.train.run_name == arm
        assert (c.regenerate.target_revision, c.regenerate.chat_template_id) == ("rev", "tmpl")
    assert arms["uniform-seed1"].train.seed == 1 and arms["uniform"].train.seed == arms["acceptance"].train.seed != 1
    # everything that decides the data is the same in every arm: the comparison is the selection alone
    same = lambda c: (c.discover.model_dump(exclude={"workspace"}), c.extract.model_dump(exclude={"workspace"}))  # noqa: E731
    assert same(arms["uniform"]) == same(arms["acceptance"]) == same(arms["uniform-seed1"])
    # the study is one recipe (bf16) on every machine; the f32 arm changes the target's dtype in every stage
    for arm, c in arms.items():
        want = "float32" if arm.startswith("uniform-f32") or arm == "recipe-data" else "bfloat16"
        assert {c.extract.target.dtype, c.train.target.dtype, c.benchmark.target.dtype, c.probe.target.dtype} == {want}
    # the steps arm is uniform-f32 with the recipe's optimizer steps changed, and nothing else
    steps, f32 = arms["uniform-f32-steps"], arms["uniform-f32"]
    assert (steps.train.epochs, steps.train.batch_tokens) == (4, 2048) != (f32.train.epochs, f32.train.batch_tokens)
    assert same(steps) == same(f32) and steps.regenerate.selection == f32.regenerate.selection == "uniform"
    # the recipe study's data: the 1-epoch arm's recipe with its shards kept for the recipe arms to train on
    data, one = arms["recipe-data"], arms["uniform-f32-1epoch"]
    assert not data.train.delete_consumed and one.train.delete_consumed
    assert data.train.model_dump(exclude={"workspace", "run_name", "delete_consumed"}) == \
        one.train.model_dump(exclude={"workspace", "run_name", "delete_consumed"})
    assert same(data) == same(one)


def test_the_report_compares_arms_with_the_noise_floor(tmp_path):
    results = tmp_path / "selection.jsonl"
    for arm, size, chat, he in (("uniform", 12_500, 1.30, 1.10), ("uniform", 25_000, 1.40, 1.12),
                                ("acceptance", 12_500, 1.30, 1.10), ("acceptance", 25_000, 1.45, 1.20),
                                ("uniform-seed1", 12_500, 1.31, 1.09)):
        append_result(results, {"arm": arm, "size": size, "k": 3, "train_tokens": size, "eagle3_heldout_chat": chat,
                                "lookup_heldout_chat": 1.2, "final_heldout_chat": 1.25, "eagle3_humaneval": he,
                                "lookup_humaneval": 1.3, "regen_completion_tokens": size, "regen_generations": 10,
                                "cluster_mix": {"code": 2, "general": 8}})
    text = report(results)
    assert "| 25,000 | acceptance | 1.45 | 1.21 | 1.16 | 1.20 | 0.92 | 25,000 | 10 | 20.0% |" in text
    assert "size 12,500: heldout_chat: acceptance - uniform 0.000 (noise floor |seed1 - uniform| 0.010)" in text
    assert "heldout_chat: the uniform arm's best 1.400 (at 25,000 tokens); the acceptance arm reaches it at" in text
    # an arm read against another than uniform: the steps arm against uniform-f32
    for arm, size, chat in (("uniform-f32", 12_500, 1.30), ("uniform-f32", 25_000, 1.40),
                            ("uniform-f32-steps", 12_500, 1.38), ("uniform-f32-steps", 25_000, 1.50)):
        append_result(results, {"arm": arm, "size": size, "k": 3, "train_tokens": size, "eagle3_heldout_chat": chat,
                                "eagle3_humaneval": 1.1})
    text = report(results)
    assert "size 25,000: heldout_chat: uniform-f32-steps - uniform-f32 0.100 (noise floor" in text
    assert ("heldout_chat: the uniform-f32 arm's best 1.400 (at 25,000 tokens); the uniform-f32-steps arm reaches it "
            "at 14,031 tokens (56% of uniform-f32's)") in text
    assert "acceptance - uniform" in text  # the acceptance arm's lines stay
    # from-scratch drafts on an arm's data (--controls, --ablate): a row each, the ablation read against the control
    for arm, chat in (("uniform-f32-steps scratch", 1.40), ("uniform-f32-steps scratch extract.draft_vocab_file=v", 1.37)):
        append_result(results, {"arm": arm, "size": 50_000, "k": 3, "train_tokens": 50_000, "eagle3_heldout_chat": chat,
                                "eagle3_humaneval": 1.2})
    text = report(results)
    assert "| 50,000 | uniform-f32-steps scratch | 1.40 |" in text
    assert ("size 50,000: heldout_chat: uniform-f32-steps scratch extract.draft_vocab_file=v - uniform-f32-steps "
            "scratch -0.030") in text


def test_the_plot_draws_every_arm_that_has_points(tmp_path, monkeypatch):
    # A plot that listed its arms by hand drew nothing for a new arm (uniform-f32's first run).
    from matplotlib.figure import Figure

    results = tmp_path / "selection.jsonl"
    for i, arm in enumerate(ARMS):
        for size in (12_500, 25_000):
            append_result(results, {"arm": arm, "size": size, "k": 3, "train_tokens": size, "lookup_heldout_chat": 1.3,
                                    "eagle3_heldout_chat": 1.1 + i / 100, "eagle3_humaneval": 1.1 + i / 100})
    labels: list[set[str]] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (
        labels.extend({line.get_label() for line in ax.get_lines()} for ax in fig.axes), save(fig, *a, **kw))[1])
    assert plot(results, tmp_path / "selection.png").is_file()
    assert len(labels) == 2 and all(set(ARMS) <= panel for panel in labels)


def test_the_answer_cache_answers_a_repeated_greedy_request_once(scripted, tmp_path):
    upstream = scripted()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.studies.answer_cache", "--upstream", upstream,
                             "--port", str(port), "--cache", str(tmp_path / "cache")], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        req = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
               "temperature": 0}
        first = httpx.post(url + "/v1/chat/completions", json=req, timeout=10)
        again = httpx.post(url + "/v1/chat/completions", json=req, timeout=10)
        sampled = httpx.post(url + "/v1/chat/completions", json={**req, "temperature": 0.7}, timeout=10)
        assert first.status_code == again.status_code == sampled.status_code == 200
        assert first.content == again.content
        assert len(list((tmp_path / "cache").rglob("*.json"))) == 1  # the sampled request was not cached
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert json.loads(out.strip().splitlines()[-1]) == {"hits": 1, "misses": 1, "passed": 2}  # /health + sampled


def test_a_packed_cache_seeds_another_machines_cache_with_the_same_answers(tmp_path):
    from benchmarks.studies.answer_cache import pack, unpack

    cache = tmp_path / "a"
    for key, answer in (("ab12", '{"content": "x"}'), ("cd34", '{"content": "y"}')):
        (cache / key[:2]).mkdir(parents=True)
        (cache / key[:2] / f"{key}.json").write_text(answer)
    archive = tmp_path / "answers.jsonl.gz"
    assert pack(cache, archive) == 2
    other = tmp_path / "b"
    (other / "cd").mkdir(parents=True)
    (other / "cd" / "cd34.json").write_text('{"content": "y"}')
    assert unpack(archive, other) == 1 and unpack(archive, other) == 0  # only what it lacks
    assert (other / "ab" / "ab12.json").read_text() == '{"content": "x"}'
    before = archive.read_bytes()
    pack(cache, archive)
    assert archive.read_bytes() == before  # the same cache packs the same bytes


def test_a_run_on_a_fresh_machine_adds_its_points_to_the_kept_ones_and_keeps_the_earlier_machines(tmp_path):
    from benchmarks.studies.scaling_results import load_results

    kept, measured = tmp_path / "kept.jsonl", tmp_path / "measured.jsonl"
    for arm, size, acc in (("uniform", 12_500, 1.10), ("acceptance", 12_500, 1.11)):
        append_result(kept, {"arm": arm, "size": size, "k": 3, "eagle3_heldout_chat": acc, "run_name": arm})
    # this machine measured uniform again and a new arm; the earlier acceptance point is not in its file
    for arm, size, acc in (("uniform", 12_500, 1.11), ("uniform-head", 12_500, 1.06)):
        append_result(measured, {"arm": arm, "size": size, "k": 3, "eagle3_heldout_chat": acc, "run_name": arm})
    assert merge_points(measured, kept) == 2
    assert merge_points(measured, kept) == 0  # a second merge adds nothing
    points = {key: r["eagle3_heldout_chat"] for key, r in load_results(kept).items()}
    assert points == {"uniform/12500/k3": 1.11, "acceptance/12500/k3": 1.11, "uniform-head/12500/k3": 1.06}
