"""What a reader is told about a measured serving sweep (serving/bench/verdict.py), from summary rows alone.

The verdict lines (faster or slower than the baseline, against the fastest n-gram setting, the acceptance the draft
would need to match it, break-even, lossless, a drifted baseline), the mean over interleaved passes, and online
against offline acceptance. No server starts here: these run in the fast lane.
"""

from __future__ import annotations

import pytest

from serving.bench.verdict import agreement, agreement_line, mean_over_passes, verdict_lines


def test_llamacpp_verdict_break_even_lossless_drift_and_agreement_from_rows():
    rows = [{"config": "baseline", "drafter": "baseline", "k": None, "concurrency": 1, "speedup_vs_baseline": 1.0,
             "output_tok_s": 100.0, "baseline_recheck_tok_s": 95.0, "baseline_recheck_identical": True},
            {"config": "eagle3-k1", "drafter": "eagle3", "k": 1, "concurrency": 1, "speedup_vs_baseline": 0.6,
             "acceptance": 1.5, "accept_needed": 2.4, "lossless": "6/6", "lossless_identical": 6, "lossless_total": 6},
            {"config": "eagle3-k3", "drafter": "eagle3", "k": 3, "concurrency": 1, "speedup_vs_baseline": 0.4,
             "acceptance": 1.8, "accept_needed": 4.2, "lossless": "5/6 (first divergence: ...)",
             "lossless_identical": 5, "lossless_total": 6}]
    lines = verdict_lines(rows)
    assert lines[0].startswith("concurrency 1: on llama.cpp the EAGLE-3 draft is slower than the baseline: best 0.60x "
                               "(eagle3-k1)")
    assert "k=1 needs 2.40 (measured 1.50), k=3 needs 4.20 (measured 1.80)" in lines[0]
    with_ngram = [rows[0], {**rows[1], "output_tok_s": 60.0},
                  {"config": "ngram-simple-k3", "drafter": "ngram-simple", "k": 3, "concurrency": 1,
                   "speedup_vs_baseline": 1.2, "output_tok_s": 120.0, "acceptance": 1.3}]
    assert ("best 0.60x (eagle3-k1); 0.50x as fast as llama.cpp's ngram-simple-k3; to match it eagle3-k1 needs "
            "acceptance 3.00 (measured 1.50, 50% short).") in verdict_lines(with_ngram)[0]
    assert lines[-1].endswith("NOT LOSSLESS") and "eagle3-k3 5/6" in lines[-1]
    assert not any(line.startswith("WARNING") for line in lines)
    drifted = [{**rows[0], "output_tok_s": 100.0, "baseline_recheck_tok_s": 70.0, "baseline_recheck_identical": True},
               *rows[1:]]
    assert verdict_lines(drifted)[0].startswith("WARNING: the baseline ran at 100.0 tok/s first and 70.0 tok/s")
    item = agreement(rows, 3, 1.9)
    assert item["ratio"] == round(1.8 / 1.9, 3) and item["within_tolerance"] is True
    assert "ratio 0.947 (within 10%)" in agreement_line(item, 3)
    assert agreement(rows, 4, 1.9) is None and "no k=4" in agreement_line(None, 4)


def test_the_verdict_compares_the_draft_with_the_engines_ngram():
    rows = [{"engine": "vllm", "config": "baseline", "drafter": "baseline", "k": None, "concurrency": 1,
             "speedup_vs_baseline": 1.0, "output_tok_s": 40.0},
            {"engine": "vllm", "config": "eagle3-k1", "drafter": "eagle3", "k": 1, "concurrency": 1,
             "speedup_vs_baseline": 1.2, "output_tok_s": 48.0, "acceptance": 1.35, "accept_needed": 1.12},
            {"engine": "vllm", "config": "ngram-k3", "drafter": "ngram", "k": 3, "concurrency": 1,
             "speedup_vs_baseline": 1.0, "output_tok_s": 40.0, "acceptance": 1.1}]
    lines = verdict_lines(rows)
    assert lines[0].startswith("concurrency 1: on vLLM the EAGLE-3 draft is faster than the baseline: best 1.20x "
                               "(eagle3-k1); 1.20x as fast as vLLM's ngram-k3.")
    assert "k=1 needs 1.12 (measured 1.35)" in lines[0]
    assert lines[1] == "concurrency 1: vLLM's ngram-k3: 1.00x the baseline, acceptance 1.10."


def _row(config, drafter, k, tok_s, **extra):
    return {"engine": "vllm", "config": config, "drafter": drafter, "k": k, "concurrency": 1, "output_tok_s": tok_s,
            "speedup_vs_baseline": None, **extra}


def test_two_passes_average_the_speeds_and_the_verdict_takes_each_draft_against_the_fastest_ngram():
    one = [_row("baseline", "baseline", None, 40.0),
           _row("eagle3-ours-k2", "eagle3", 2, 50.0, acceptance=1.5, lossless_identical=64, lossless_total=64, lossless="64/64 identical"),
           _row("eagle3-theirs-k2", "eagle3", 2, 44.0, acceptance=1.3, lossless_identical=64, lossless_total=64, lossless="64/64 identical"),
           _row("ngram-k3", "ngram", 3, 52.0, acceptance=1.4, lossless_identical=64, lossless_total=64, lossless="64/64 identical"),
           _row("ngram-k3-2:4", "ngram", 3, 48.0, acceptance=1.3, lossless_identical=64, lossless_total=64, lossless="64/64 identical")]
    two = [{**r, "output_tok_s": r["output_tok_s"] * 1.1} for r in one]
    two[1] = {**two[1], "lossless_identical": 63, "lossless": "63/64 identical"}
    two = [two[0], *two[:0:-1]]  # the second pass ran in reverse order after the baseline (pass_order)
    rows = mean_over_passes([one, two])
    assert [r["config"] for r in rows] == [r["config"] for r in one]  # the first pass's order
    by = {r["config"]: r for r in rows}
    assert by["baseline"]["output_tok_s"] == 42.0 and by["baseline"]["output_tok_s_by_pass"] == [40.0, 44.0]
    assert by["eagle3-ours-k2"]["speedup_vs_baseline"] == 1.25  # the ratio of the means, a drift shared by all
    assert by["eagle3-ours-k2"]["lossless_identical"] == 63  # the worst pass, never the best
    assert by["eagle3-ours-k2"]["lossless"] == "63/64 identical"
    lines = verdict_lines(rows)
    ours = next(line for line in lines if "(eagle3-ours)" in line)
    assert "best 1.25x (eagle3-ours-k2); 0.96x as fast as vLLM's ngram-k3 (the fastest of its 2 n-gram" in ours
    # at its own round cost, 1.5 x 54.6 / 52.5 tokens a round would serve as fast as the n-gram
    assert "to match it eagle3-ours-k2 needs acceptance 1.56 (measured 1.50, 4% short)" in ours
    assert any("(eagle3-theirs)" in line and "best 1.10x" in line for line in lines)
    with pytest.raises(ValueError, match="same configs"):
        mean_over_passes([one, one[:-1]])
    with pytest.raises(ValueError, match="same configs"):  # a config twice in a pass is not a reordering
        mean_over_passes([one, [*one[:-1], one[1]]])


def test_the_mean_of_two_passes_recomputes_the_break_even_from_the_mean_round_cost():
    one = [_row("baseline", "baseline", None, 10.0),
           {**_row("eagle3-ours-k2", "eagle3", 2, 12.0, acceptance=1.5), "ms_per_verify_round": 125.0,
            "accept_needed": 1.25}]
    two = [_row("baseline", "baseline", None, 14.0),
           {**_row("eagle3-ours-k2", "eagle3", 2, 15.0, acceptance=1.5), "ms_per_verify_round": 100.0,
            "accept_needed": 1.4}]
    ours = {r["config"]: r for r in mean_over_passes([one, two])}["eagle3-ours-k2"]
    assert ours["ms_per_verify_round"] == 112.5 and ours["ms_per_verify_round_by_pass"] == [125.0, 100.0]
    # 112.5 ms a round against the mean baseline's 1/12 s a token, neither pass's 1.25 or 1.4
    assert ours["accept_needed"] == 1.35 and ours["predicted_speedup"] == round(1.5 / 1.35, 3)
