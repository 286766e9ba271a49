"""The scaling study's bookkeeping (benchmarks/studies/scaling.py, benchmarks/studies/scaling_results.py): which points
exist, which generations a size takes, what a rerun skips, and the tables and plot. Pure functions, no
server, no model."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.studies import scaling, scaling_results


def test_sizes_double_up_to_max_size():
    assert scaling.study_sizes([25_000, 50_000, 100_000, 200_000, 400_000], 1_600_000)[-3:] == [400_000, 800_000,
                                                                                               1_600_000]
    assert scaling.study_sizes([400, 100, 100]) == [100, 400]
    assert scaling.study_sizes([100], 399) == [100, 200]  # 400 would pass the limit
    with pytest.raises(ValueError):
        scaling.study_sizes([])


def test_a_size_takes_the_first_generations_that_reach_it():
    tokens = [100, 50, None, 200, 10]
    assert scaling.generations_for(tokens, 100) == 1
    assert scaling.generations_for(tokens, 101) == 2
    assert scaling.generations_for(tokens, 151) == 4   # a generation without a count adds nothing
    assert scaling.generations_for(tokens, 360) == 5
    assert scaling.generations_for(tokens, 361) is None  # not enough data: regenerate more


def test_rerun_skips_measured_points_and_ignores_a_torn_line(tmp_path):
    path = tmp_path / "scaling.jsonl"
    scaling_results.append_result(path, {"arm": "main", "size": 2000, "k": 3, "eagle3_humaneval": 1.1})
    scaling_results.append_result(path, {"arm": "main", "size": 2000, "k": 3, "eagle3_humaneval": 1.2})
    scaling_results.append_result(path, {"arm": "scratch", "size": 2000, "k": 4})
    with path.open("a") as f:
        f.write('{"arm": "main", "size": 4000, "k"')  # a crash while writing
    done = scaling_results.load_results(path)
    assert sorted(done) == ["main/2000/k3", "scratch/2000/k4"]
    assert done["main/2000/k3"]["eagle3_humaneval"] == 1.2  # the last line of a key wins
    assert scaling_results.missing_ks(done, "main", 2000, [3, 4]) == [4]
    assert scaling_results.missing_ks(done, "scratch", 2000, [3, 4]) == [3]
    assert scaling_results.missing_ks(done, "main", 4000, [3, 4]) == [3, 4]


def test_regenerate_chunks_cover_the_missing_tokens_within_bounds():
    assert scaling.regenerate_chunk(10_000, 100.0) == 110
    assert scaling.regenerate_chunk(10, 100.0) == 16
    assert scaling.regenerate_chunk(10_000_000, 100.0, hi=400) == 400
    assert scaling.regenerate_chunk(1_500, None, lo=1) == 4  # 500 tokens a generation assumed until measured


def test_table_lists_every_point_in_size_order(tmp_path):
    rows = [{"arm": a, "size": s, "k": k, "train_tokens": s, "eagle3_heldout_chat": 1.0 + s / 1e4,
             "eagle3_heldout_chat_pos": [0.5, None], "wall_s": 1.0}
            for s in (4000, 2000) for a in ("scratch", "main") for k in (3, 4)]
    lines = scaling_results.markdown_table(rows).splitlines()[2:]
    assert [tuple(c.strip() for c in line.split("|")[1:4]) for line in lines] == [
        ("2,000", "main", "3"), ("2,000", "main", "4"), ("2,000", "scratch", "3"), ("2,000", "scratch", "4"),
        ("4,000", "main", "3"), ("4,000", "main", "4"), ("4,000", "scratch", "3"), ("4,000", "scratch", "4")]
    assert "0.50/-" in lines[0] and "1.20" in lines[0]
    path = tmp_path / "reports" / "scaling.jsonl"
    for r in rows:
        scaling_results.append_result(path, r)
    scaling_results.write_report(path)
    assert (tmp_path / "reports" / "scaling.png").stat().st_size > 1000
    assert "| 4,000 | scratch | 4 |" in (tmp_path / "reports" / "scaling.md").read_text()


def test_an_ablation_arm_changes_only_its_fields_and_refuses_a_bad_one():
    from tasks.config import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "benchmarks" / "studies" / "scaling.yaml")
    change = scaling.parse_change("train.schedule=cosine, train.total_steps=60")
    assert change == {"train.schedule": "cosine", "train.total_steps": 60}
    extract, train = scaling.changed_configs(cfg, change)
    assert (train.schedule, train.total_steps) == ("cosine", 60)
    assert train.lr == cfg.train.lr and extract == cfg.extract  # nothing else moved
    extract, _ = scaling.changed_configs(cfg, scaling.parse_change("extract.draft_vocab_size=16384"))
    assert extract.draft_vocab_size == 16384
    # the plain control keeps its name and workspace; an arm gets its own, safe as a path and a run name
    assert scaling.ablation_arm(None) == ("scratch", "")
    arm, slug = scaling.ablation_arm(change)
    assert arm == "scratch train.schedule=cosine,train.total_steps=60"
    assert slug == "-train.schedule-cosine_train.total_steps-60"
    loss_all = scaling.parse_change("data.loss_on=all")
    assert scaling.changed_configs(cfg, loss_all) == (cfg.extract, cfg.train)  # the import's masks, no field
    for bad in ("lr=0.1", "benchmark.draft_tokens=4", "train.lr", "data.loss_on=users", "data.shuffle=1"):
        with pytest.raises(ValueError, match="ablation"):
            scaling.parse_change(bad)
    with pytest.raises(ValueError, match="no field"):
        scaling.changed_configs(cfg, {"train.no_such_field": 1})
    with pytest.raises(ValueError):  # pydantic: a value the field refuses
        scaling.changed_configs(cfg, {"train.epochs": 0})


def test_ablation_table_compares_each_arm_with_the_control_of_its_size():
    rows = [{"arm": "scratch", "size": 50, "k": 3, "eagle3_heldout_chat": 1.20, "eagle3_humaneval": 1.10},
            {"arm": "scratch train.epochs=4", "size": 50, "k": 3, "eagle3_heldout_chat": 1.27,
             "eagle3_humaneval": 1.05, "train_tok_s": 400.0},
            {"arm": "scratch train.lr=0.1", "size": 99, "k": 3, "eagle3_heldout_chat": 1.5},  # no control: left out
            {"arm": "main", "size": 50, "k": 3, "eagle3_heldout_chat": 1.9}]
    lines = scaling_results.ablation_table(rows).splitlines()[2:]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
    assert [c[2] for c in cells] == ["(control)", "train.epochs=4"]
    assert cells[1][3:7] == ["1.27", "+0.07", "1.05", "-0.05"] and cells[1][8] == "400"
    assert scaling_results.ablation_table(rows[3:]) == ""


def test_an_arm_measured_at_two_sizes_is_plotted_as_its_own_curve(tmp_path):
    def row(arm, size, al):
        return {"arm": arm, "size": size, "k": 3, "train_tokens": size + 7, "eagle3_heldout_chat": al,
                "lookup_heldout_chat": 1.3}

    recipe = "scratch train.epochs=4,train.batch_tokens=2048"
    rows = [row("main", 50, 1.2), row("main", 200, 1.4), row("scratch", 50, 1.1), row(recipe, 50, 1.3),
            row(recipe, 200, 1.5), row("scratch data.loss_on=all", 83, 1.25)]
    assert scaling_results.recipe_arms(rows) == [recipe]  # the one-size arm stays in the ablation table only
    png = scaling_results.plot(rows, tmp_path / "curve.png")
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")


def test_rounds_extract_and_train_until_every_generation_is_sampled(tmp_path):
    # A control larger than the disk budget once trained on the first round's samples only: one extract
    # (stopped by the budget), one train. Both points now loop until nothing is left.
    from types import SimpleNamespace as NS

    state = {"left": 10, "positions": 0}
    calls: list[str] = []

    def extract(limit):
        calls.append(f"extract {limit}")
        n = min(limit, 4)  # the budget holds 4 samples a round
        state["left"] -= n
        return NS(extracted=n, tokens=100 * n, masked_tokens=60 * n, target_dtype="float32", stopped_by="budget")

    def train():
        calls.append("train")
        state["positions"] += 7
        return NS(stopped_by="done")

    costs = scaling.Costs()
    scaling.extract_train_rounds(lambda: state["left"], extract, train, lambda: state["positions"], costs, tmp_path)
    assert calls == ["extract 10", "train", "extract 6", "train", "extract 2", "train"]
    assert (costs.rounds, costs.extract_tokens, costs.extract_masked, costs.train_positions) == (3, 1000, 600, 21)

    # resumed after the last extraction: train only
    calls.clear()
    scaling.extract_train_rounds(lambda: 0, extract, train, lambda: 0, scaling.Costs(), tmp_path)
    assert calls == ["train"]

    # an extraction that frees no room (training kept nothing back) is an error, not a loop
    stuck = NS(extracted=0, tokens=0, masked_tokens=0, target_dtype="float32", stopped_by="budget")
    with pytest.raises(SystemExit, match="no progress"):
        scaling.extract_train_rounds(lambda: 5, lambda limit: stuck, train, lambda: 0, scaling.Costs(), tmp_path)

    with pytest.raises(SystemExit, match="max_steps"):
        scaling.extract_train_rounds(lambda: 0, extract, lambda: NS(stopped_by="max_steps"), lambda: 0,
                                     scaling.Costs(), tmp_path)


def test_remeasure_adds_per_prompt_figures_to_a_recorded_point_once(tmp_path):
    results = tmp_path / "results.jsonl"
    export = tmp_path / "export"
    export.mkdir()
    old = {"arm": "a", "size": 100, "k": 3, "export": str(export), "train_tokens": 99, "eagle3_heldout_chat": 1.4,
           "recorded_at": "2026-12-01T00:00:00Z"}
    scaling.append_result(results, old)
    st = object.__new__(scaling.Study)  # no target or workspace: only the bookkeeping runs
    st.results, st.ks, st.arm, st.max_new, st.prompts = results, [3], "a", 64, 32
    st.done = scaling.load_results(results)
    measured: list[str] = []
    st.measure = lambda path, ks: measured.append(path) or {3: {"eagle3_heldout_chat": 1.4,
                                                                "eagle3_heldout_chat_per_request": {"p": [7, 5]}}}
    st.remeasure(100)
    row = scaling.load_results(results)["a/100/k3"]
    assert measured == [str(export)]
    assert row["eagle3_heldout_chat_per_request"] == {"p": [7, 5]} and row["train_tokens"] == 99
    assert row["first_recorded_at"] == "2026-12-01T00:00:00Z" and row["recorded_at"] != old["recorded_at"]
    st.remeasure(100)  # it has its prompts now: not again
    assert measured == [str(export)]
    st.remeasure(200)  # nothing recorded at this size
    scaling.append_result(results, {**old, "size": 300, "export": str(tmp_path / "gone")})
    st.done = scaling.load_results(results)
    st.remeasure(300)  # its draft is not on this machine
    assert measured == [str(export)]


def test_acceptance_row_gives_each_drafter_and_domain_its_figures_and_prompts():
    """One row builder for the scaling and recipe studies: acceptance, by position, prompts, per prompt."""
    from benchmarks.studies.scaling_results import acceptance_row
    from tasks.evaluate.decoding import RequestResult
    from tasks.evaluate.report import AcceptanceReport

    def req(drafter, domain, item, tokens, rounds, first):
        return RequestResult(drafter, domain, item, 10, tokens, rounds, tokens - 1 - rounds, [first, 0], [rounds, 1],
                             "length", [])

    report = AcceptanceReport.build(2, 8, [
        req("eagle3", "heldout_chat", "c1", 9, 6, 2), req("eagle3", "humaneval", "h1", 9, 4, 4),
        req("prompt-lookup", "heldout_chat", "c1", 9, 8, 0)])
    row = acceptance_row(report, {"eagle3": "eagle3", "lookup": "prompt-lookup", "final": "absent"})
    assert row["eagle3_heldout_chat"] == 9 / 6 and row["eagle3_all"] == 18 / 10 and row["eagle3_all_requests"] == 2
    assert row["eagle3_humaneval_pos"] == [1.0, 0.0]
    assert row["eagle3_heldout_chat_per_request"] == {"c1": [9, 6]} and "eagle3_all_per_request" not in row
    assert row["lookup_heldout_chat"] == 9 / 8 and "lookup_humaneval" not in row  # a domain it never decoded
    assert not any(key.startswith("final_") for key in row)  # a drafter the report lacks adds nothing
