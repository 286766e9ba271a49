"""The training recipe's levers (issue 42) on a real Prefect API and DuckDB file with a tiny random target:
a frozen target head, validation samples held out with the best draft exported (and every validation of a run
reported after a resume), cosine decay over the run's own steps, bf16 autocast on the CPU, and the device a run asks for."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from flows.extract import extract
from flows.train import train
from storage.lineage import LineageStore
from tasks.config import TrainConfig
from tasks.train.steps import Item, MODEL_FILE, Schedule, TrainState, list_checkpoints
from tasks.train.validation import best_folders, expected_acceptance, split_validation

from helpers import conversations, extract_config, import_generations


# ---------------------------------------------------------------- pure parts (fast)

def test_a_frozen_head_needs_the_targets_head_to_start_from():
    with pytest.raises(ValueError, match="head: frozen .* needs init: target_head"):
        TrainConfig(head="frozen")
    assert TrainConfig(head="frozen", init="target_head").head == "frozen"


def test_replaying_kept_shards_never_deletes_them():
    with pytest.raises(ValueError, match="replay_kept_shards .* needs delete_consumed: false"):
        TrainConfig(replay_kept_shards=True)


def test_eagle31_norms_export_only_where_they_are_served():
    with pytest.raises(ValueError, match="served by vLLM only.*export_formats: \\[speculators\\]"):
        TrainConfig(norm_output=True)
    with pytest.raises(ValueError, match="served by vLLM only"):
        TrainConfig(norm_before_fc=True, export_formats=["speculators", "sglang"])
    assert TrainConfig(norm_before_fc=True, norm_output=True, export_formats=["speculators"]).norm_output


def test_cosine_needs_no_horizon_any_more():
    assert TrainConfig(schedule="cosine").total_steps is None


def test_a_cosine_cycle_restarted_at_a_later_step_warms_up_and_decays_as_the_first():
    first = Schedule(1e-3, "cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    later = Schedule(1e-3, "cosine", warmup_steps=2, total_steps=110, min_lr_ratio=0.1, start_step=100)
    assert [later.lr_at(100 + s) for s in range(12)] == [first.lr_at(s) for s in range(12)]
    assert first.lr_at(0) == pytest.approx(5e-4) and first.lr_at(10) == pytest.approx(1e-4)
    assert Schedule(1e-3, "constant", warmup_steps=4, start_step=8).lr_at(9) == pytest.approx(5e-4)


def test_a_linear_decay_falls_by_equal_steps_to_its_floor_at_the_horizon():
    # speculators' schedule: warmup, then a straight line to 0 at the end of the cycle
    linear = Schedule(1e-3, "linear", warmup_steps=2, total_steps=12, min_lr_ratio=0.0, start_step=2)
    assert [linear.lr_at(s) for s in range(2, 4)] == pytest.approx([5e-4, 1e-3])
    rates = [linear.lr_at(s) for s in range(4, 13)]
    assert rates == pytest.approx([1e-3 * (8 - i) / 8 for i in range(9)])
    assert linear.lr_at(20) == 0.0
    cosine = Schedule(1e-3, "cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.0, start_step=2)
    assert cosine.lr_at(6) > linear.lr_at(6) and cosine.lr_at(10) < linear.lr_at(10)  # the two shapes differ


def test_a_checkpoint_from_before_per_round_cycles_resumes_its_cycle_from_step_0():
    old = {"step": 7, "tokens": 70, "rounds_done": 0, "trained_shards": [], "position": None, "lr_horizon": 30}
    state = TrainState.from_json(old)
    assert (state.lr_start, state.lr_horizon) == (0, 30)
    assert TrainState.from_json(TrainState(step=40, lr_start=31, lr_horizon=60).to_json()).lr_start == 31


def test_expected_acceptance_is_the_bonus_token_plus_the_chain_of_accepted_steps():
    assert expected_acceptance([]) == 1.0
    assert expected_acceptance([0.0, 1.0]) == 1.0  # the chain breaks at step 0
    assert math.isclose(expected_acceptance([0.5, 0.5, 0.5]), 1 + 0.5 + 0.25 + 0.125)
    assert expected_acceptance([1.0, 1.0, 1.0]) == 4.0


def test_validation_samples_are_chosen_by_seed_whatever_the_order_and_never_trained_on():
    items = [Item(f"shard-{i // 10}", i % 10, 100 + i) for i in range(50)]
    train_items, held = split_validation(items, 7, seed=3, round_index=0)
    assert len(held) == 7 and len(train_items) == 43
    assert not set(held) & set(train_items) and set(held) | set(train_items) == set(items)
    assert [it for it in items if it in train_items] == train_items  # the training order is kept
    _, again = split_validation(list(reversed(items)), 7, seed=3, round_index=0)
    assert set(again) == set(held)
    assert set(split_validation(items, 7, seed=4, round_index=0)[1]) != set(held)
    assert set(split_validation(items, 7, seed=3, round_index=1)[1]) != set(held)
    assert split_validation(items, 0, seed=3, round_index=0) == (items, [])
    with pytest.raises(ValueError, match="leaves nothing to train on in round 0"):
        split_validation(items, 50, seed=3, round_index=0)


def test_a_device_the_machine_lacks_is_refused_by_name():
    from tasks.model.target import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda" and resolve_device("cuda").type == "cuda"
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="target.device 'cuda:1'.*no CUDA device"):
            resolve_device("cuda:1")


# ---------------------------------------------------------------- the train flow (slow)

def _last_cosine_rate(lr: float, floor: float, span: int) -> float:
    """The lr of a cosine's last step after warmup: one step of `span` short of the floor."""
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (span - 1) / span)))


def _config(ws, target, **kw) -> TrainConfig:
    base = {"workspace": str(ws), "run_name": "t", "target": {"model_path": str(target), "dtype": "float32",
            "device": "cpu"}, "ttt_steps": 3, "batch_tokens": 1024, "lr": 3e-3, "epochs": 2, "checkpoint_every": 3,
            "log_every": 1, "export_formats": ["sglang"], "delete_consumed": False}
    return TrainConfig.model_validate({**base, **kw})


@pytest.fixture
def extracted(prefect_api, tmp_path, workspace, tiny_target):
    import_generations(workspace, tmp_path, conversations(24, seed=11))
    s = extract(extract_config(workspace, tiny_target, draft_vocab_size=256, shard_bytes=150_000))
    assert s.extracted == 24 and s.shards_written >= 3
    return workspace


@pytest.mark.slow
def test_a_frozen_head_keeps_the_targets_rows_while_the_rest_learns(extracted, tiny_target):
    from transformers import AutoModelForCausalLM

    ws = extracted
    s = train(_config(ws, tiny_target, init="target_head", head="frozen", epochs=6))
    assert s.stopped_by == "done" and s.step > 6
    weights = load_file(list_checkpoints(ws / "checkpoints" / "t")[-1] / MODEL_FILE)
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    rows = weights["d2t"] + torch.arange(weights["d2t"].numel())
    assert weights["lm_head.weight"].equal(target.lm_head.weight.detach()[rows])  # bit for bit, after every step
    metrics = LineageStore(ws / "lineage.duckdb").training.metrics("t")
    assert metrics[-1]["loss"] < 0.9 * metrics[0]["loss"]  # fc and the midlayer learn behind it


@pytest.mark.slow
def test_validation_exports_the_best_draft_of_the_round_not_the_last(extracted, tiny_target):
    ws = extracted
    s = train(_config(ws, tiny_target, epochs=4, validation_samples=4, validate_every=2, lr=1e-2))
    assert s.stopped_by == "done" and s.validations
    assert all(v["samples"] == 4 and v["positions"] > 0 for v in s.validations)
    steps = [v["step"] for v in s.validations]
    assert steps == sorted(steps) and steps[-1] == s.step  # the end of the last epoch is always validated
    best = max(s.validations, key=lambda v: (v["expected_acceptance"], -v["step"]))  # ties keep the earlier
    assert s.exported_step == best["step"] and s.exported_expected_acceptance == best["expected_acceptance"]
    kept = best_folders(ws / "checkpoints" / "t", 0)
    assert [p.name for p in kept] == [f"best-round-0000-step-{best['step']:08d}"]
    exported = load_file(f"{s.exports['sglang']}/model.safetensors")
    kept_weights = load_file(kept[0] / MODEL_FILE)
    assert exported["fc.weight"].equal(kept_weights["fc.weight"].to(exported["fc.weight"].dtype))
    assert s.exports["sglang"].endswith(f"sglang-step-{best['step']:08d}")
    row = LineageStore(ws / "lineage.duckdb").checkpoints.find(fmt="sglang")
    assert row["step"] == best["step"]


@pytest.mark.slow
def test_a_run_resumed_after_a_stop_reports_every_validation_of_the_run(extracted, tiny_target):
    ws = extracted
    recipe = {"epochs": 4, "validation_samples": 4, "validate_every": 2, "lr": 1e-2}
    cut = train(_config(ws, tiny_target, max_steps=5, **recipe))
    assert cut.stopped_by == "max_steps" and [v["step"] for v in cut.validations] == [2, 4]
    assert cut.tokens_this_run == cut.tokens > 0
    shutil.rmtree(list_checkpoints(ws / "checkpoints" / "t")[-1])  # as if killed before the stop's checkpoint
    resumed = train(_config(ws, tiny_target, **recipe))  # redoes steps 4-5 and validates step 4 again
    assert resumed.resumed_from_step == 3
    assert 0 < resumed.tokens_this_run < resumed.tokens  # its speed is over the steps it trained itself
    assert resumed.validations[:2] == cut.validations  # the validations from before the stop, kept flags included
    assert resumed.validations == LineageStore(ws / "lineage.duckdb").training.validations("t")
    # the same recipe trained without a stop (the kept shards replayed): the same validations, bit for bit
    whole = train(_config(ws, tiny_target, run_name="whole", replay_kept_shards=True, **recipe))
    assert whole.resumed_from_step is None and whole.step == resumed.step
    assert [(v["step"], v["expected_acceptance"], v["kept"]) for v in whole.validations] == \
        [(v["step"], v["expected_acceptance"], v["kept"]) for v in resumed.validations]
    best = max(resumed.validations, key=lambda v: (v["expected_acceptance"], -v["step"]))
    assert resumed.exported_step == best["step"]  # chosen over both invocations


@pytest.mark.slow
def test_cosine_without_a_horizon_decays_over_the_runs_steps_and_bf16_autocast_trains_float32_weights(
        extracted, tiny_target):
    ws = extracted
    lr = 3e-3
    s = train(_config(ws, tiny_target, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1, lr=lr, epochs=3,
                      precision="bf16"))
    rates = [m["lr"] for m in LineageStore(ws / "lineage.duckdb").training.metrics("t")]
    assert len(rates) == s.step > 4
    assert rates[0] == pytest.approx(lr / 2) and rates[1] == pytest.approx(lr)
    assert all(a >= b for a, b in zip(rates[1:], rates[2:]))  # decays after the warmup
    # the last step is the horizon's last: one step short of the floor
    span = s.step - 2
    assert rates[-1] == pytest.approx(_last_cosine_rate(lr, 0.1, span))
    weights = load_file(list_checkpoints(ws / "checkpoints" / "t")[-1] / MODEL_FILE)
    assert all(w.dtype in (torch.float32, torch.int64, torch.bool) for w in weights.values())
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


@pytest.mark.slow
def test_without_a_horizon_each_round_gets_its_own_cosine_cycle_and_a_resumed_round_keeps_it(extracted, tiny_target, tmp_path):
    ws = extracted
    lr, warmup = 3e-3, 2
    cosine = {"schedule": "cosine", "warmup_steps": warmup, "min_lr_ratio": 0.1, "lr": lr, "epochs": 2}
    first = train(_config(ws, tiny_target, **cosine))
    assert first.rounds_done == 1
    import_generations(ws, tmp_path, conversations(8, seed=12), name="more")
    assert extract(extract_config(ws, tiny_target, draft_vocab_size=256, shard_bytes=150_000)).extracted == 8
    stopped = train(_config(ws, tiny_target, max_steps=first.step + 3, **cosine))  # stopped inside round 1's cycle
    assert stopped.stopped_by == "max_steps" and stopped.resumed_from_step == first.step
    second = train(_config(ws, tiny_target, **cosine))  # resumes the cycle from its checkpoint
    assert second.rounds_done == 2 and second.resumed_from_step == first.step + 3
    rates = [m["lr"] for m in LineageStore(ws / "lineage.duckdb").training.metrics("t")]
    assert len(rates) == second.step
    for start, end in ((0, first.step), (first.step, second.step)):
        cycle = rates[start:end]
        assert cycle[0] == pytest.approx(lr / warmup) and cycle[1] == pytest.approx(lr)  # warms up again
        assert all(a >= b for a, b in zip(cycle[1:], cycle[2:]))
        span = len(cycle) - warmup
        assert cycle[-1] == pytest.approx(_last_cosine_rate(lr, 0.1, span))


@pytest.mark.slow
def test_a_second_recipe_trains_on_the_shards_a_first_run_kept_only_when_it_asks(extracted, tiny_target):
    ws = extracted
    first = train(_config(ws, tiny_target, epochs=1))
    assert first.stopped_by == "done" and first.step > 0 and first.shards_deleted == 0
    other = train(_config(ws, tiny_target, epochs=1, run_name="other"))
    assert other.stopped_by == "no_data" and other.step == 0  # consumed by the first run
    replay = train(_config(ws, tiny_target, epochs=1, run_name="replay", replay_kept_shards=True))
    assert replay.stopped_by == "done" and replay.step == first.step and replay.shards_trained == first.shards_trained
    _, states = LineageStore(ws / "lineage.duckdb").reports.query_readonly(
        "SELECT DISTINCT state, consumed_by FROM shards")
    assert states == [("consumed", "t")]  # still the first run's, and on disk
    assert len(list((ws / "shards").rglob("*"))) > 0


@pytest.mark.slow
def test_a_draft_trained_with_eagle31_norms_is_exported_for_vllm_with_them(extracted, tiny_target):
    from tasks.export.checkpoint import load_draft

    ws = extracted
    s = train(_config(ws, tiny_target, epochs=2, norm_before_fc=True, norm_output=True,
                      export_formats=["speculators"]))
    assert s.stopped_by == "done" and set(s.exports) == {"speculators"}
    draft = load_draft(s.exports["speculators"])
    assert draft.config.eagle31_norms == ["norm_before_fc", "norm_output"]
    weights = load_file(list_checkpoints(ws / "checkpoints" / "t")[-1] / MODEL_FILE)
    assert not torch.equal(weights["input_norm.weight"], torch.ones_like(weights["input_norm.weight"]))  # it trains
