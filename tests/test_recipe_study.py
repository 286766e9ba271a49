"""The recipe study's bookkeeping (benchmarks/studies/recipe.py): every arm is a valid training config on the
shared extraction, the report reads each arm against base and prompt lookup on the same prompts, and the vLLM
recipe that configs/demo.yaml names is the arm the study measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.studies.recipe import ARMS, PASS_CURVES, compare, load_points, plot_passes, report, run_name, train_config
from benchmarks.studies.scaling_results import append_result
from benchmarks.studies.selection import arm_config

ROOT = Path(__file__).resolve().parent.parent


def test_every_arm_changes_only_the_recipe_and_replays_the_kept_shards():
    from tasks.config import load_config

    cfg = load_config(ROOT / "benchmarks" / "studies" / "selection.yaml")
    data = arm_config(cfg, Path("/tmp/sel"), "recipe-data", "http://127.0.0.1:1", "rev", "tmpl")
    base = train_config(data, "base", 0)
    assert base.run_name == "recipe-data" == run_name("base", 0) and run_name("base", 1) == "recipe-base-s1"
    for arm, change in ARMS.items():
        c = train_config(data, arm, 1)
        assert c.replay_kept_shards and not c.delete_consumed and c.seed == 1 and c.workspace == "/tmp/sel/recipe-data"
        differs = {k for k, v in c.model_dump().items() if v != base.model_dump()[k]}
        changed = {k for k, v in change.items() if k != "export_formats" and v != base.model_dump()[k]}
        assert differs - {"run_name", "seed", "export_formats"} == changed, arm
    assert train_config(data, "norms", 0).export_formats == ["speculators"]  # only vLLM serves the norms
    assert train_config(data, "speculators-in-ours-no-norms", 0).export_formats == ["sglang"]


def _point(path: Path, key: str, chat: dict, code: dict, **extra) -> None:
    drafter = "lookup" if key.startswith("lookup") else "eagle3"
    row = {"key": key, "arm": key.split("/")[0], "seed": 0, "k": 3, "max_new_tokens": 64, "chat_prompts": 3,
           "humaneval_prompts": 3, **extra}
    for dom, per in (("heldout_chat", chat), ("humaneval", code)):
        row[f"{drafter}_{dom}"] = sum(t for t, _ in per.values()) / sum(r for _, r in per.values())
        row[f"{drafter}_{dom}_per_request"] = {k: list(v) for k, v in per.items()}
    append_result(path, row)


def test_the_report_reads_each_arm_against_base_and_lookup_on_the_same_prompts(tmp_path):
    results = tmp_path / "recipe.jsonl"
    same = {"a": (40, 30), "b": (40, 32), "c": (40, 28)}
    _point(results, "lookup/s0", same, same)
    _point(results, "base/s0", same, same, steps=100)
    better = {k: (t, r - 4) for k, (t, r) in same.items()}  # fewer verify rounds on every prompt
    _point(results, "head-frozen/s0", better, same, steps=400, exported_step=300, exported_expected_acceptance=1.5)
    with results.open("a") as f:
        f.write('{"key": "cut sh')  # a line a crash cut short is ignored
    assert set(load_points(results)) == {"lookup/s0", "base/s0", "head-frozen/s0"}
    text = report(results)
    frozen = next(line for line in text.splitlines() if line.startswith("| head-frozen |"))
    cells = [c.strip() for c in frozen.split("|")[1:-1]]
    lo, hi = (float(x) for x in cells[3].split("(")[1].rstrip(")").split("-"))
    assert float(cells[3].split()[0]) > 1.1 and 1.1 < lo <= hi  # better on every prompt: the interval is above 1
    assert cells[6].startswith("1.000")  # HumanEval unchanged
    assert cells[8] == "400 (300)" and cells[9] == "1.50"
    # any two points, paired: the chat ratio is the report's, HumanEval's is 1, and against lookup it reads lookup's
    pair = compare(results, "head-frozen/s0", "base/s0")
    assert f"heldout_chat {float(cells[2]):.3f} / 1.333 = {cells[3]}" in pair and "humaneval 1.333 / 1.333 = 1.000" in pair
    assert compare(results, "base/s0", "lookup/s0").count("= 1.000") == 2
    with pytest.raises(SystemExit, match="no point nope/s0"):
        compare(results, "nope/s0", "base/s0")
    with pytest.raises(SystemExit, match="the first point must be an arm"):
        compare(results, "lookup/s0", "base/s0")


def test_the_passes_plot_waits_for_two_passes_of_one_recipe_and_names_only_measured_arms(tmp_path):
    for arms in PASS_CURVES.values():  # each curve's arms are study arms, in increasing passes
        passes = [ARMS[a].get("epochs", 1) for a in arms]
        assert passes == sorted(set(passes)), arms
    results = tmp_path / "recipe.jsonl"
    same = {"a": (40, 30), "b": (40, 32)}
    _point(results, "lookup/s0", same, same)
    _point(results, "base/s0", same, same)
    _point(results, "speculators-in-ours/s0", same, same)
    assert plot_passes(results, tmp_path / "passes.png") is None  # one point a recipe: no curve yet
    _point(results, "cosine-10ep/s0", {k: (t, r - 3) for k, (t, r) in same.items()}, same)
    png = plot_passes(results, tmp_path / "passes.png")
    assert png == tmp_path / "passes.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vocab_coverage_counts_the_outputs_a_vocab_can_produce():
    """The vocab chosen as the pipeline chooses it (most frequent first, unseen ids filled by ascending id)."""
    import numpy as np

    from benchmarks.studies.vocab_coverage import answer_text, coverage

    counts = np.array([0, 5, 0, 9, 1, 0, 0, 0])
    outputs = {"chat": [3, 3, 1, 4], "code": [0, 2, 7, 3]}
    assert coverage(counts, 2, outputs) == {"chat": 0.75, "code": 0.25}  # ids 3 and 1
    assert coverage(counts, 4, outputs) == {"chat": 1.0, "code": 0.5}  # 3, 1, 4, then unseen id 0
    assert answer_text('{"index": 0, "content": "hi"}') == "hi"
    assert answer_text('{"choices": [{"message": {"content": "yo"}}]}') == "yo"


def test_the_demo_configs_vllm_recipe_is_the_measured_arm_and_valid():
    """configs/demo.yaml names speculators' recipe for a vLLM-only draft in a comment: it must stay a valid train
    section, and the recipe the study measured (`speculators-in-ours-10ep`), short of its warmup and validation."""
    import yaml

    from tasks.config import TrainConfig, load_config

    lines = (ROOT / "configs" / "demo.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "For vLLM alone, set these" in line) + 1
    block = []
    for line in lines[start:]:
        if not line.startswith("  #   "):
            break
        block.append(line[len("  #   "):])
    recipe = yaml.safe_load("{" + " ".join(block) + "}")
    demo = load_config(ROOT / "configs" / "demo.yaml").train.model_dump(mode="json")
    cfg = TrainConfig.model_validate({**demo, **recipe})
    assert cfg.export_formats == ["speculators"] and cfg.head == "frozen" and cfg.epochs == 10
    measured = {k: v for k, v in ARMS["speculators-in-ours-10ep"].items()
                if k not in ("warmup_steps", "epochs", "validation_samples", "validate_every")}
    assert recipe.pop("warmup_steps") >= 0 and recipe == measured
