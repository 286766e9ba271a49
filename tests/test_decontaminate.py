"""Decontamination against HumanEval and user eval sets by n-gram overlap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config import DecontaminateConfig, EvalSetConfig
from tasks.discover.decontaminate import EvalSetError, NgramIndex, build_index, humaneval_items, load_eval_set


def test_humaneval_ships_164_items():
    items = humaneval_items()
    assert len(items) == 164 and items[0].item_id == "humaneval/HumanEval/0"


def test_a_pasted_humaneval_prompt_is_found_despite_case_and_spacing():
    idx = build_index(DecontaminateConfig())
    he = humaneval_items()
    pasted = "Can you solve this?\n\n" + "   ".join(he[42].text.upper().split()) + "\nthanks"
    unrelated = "Write a python function that returns the sum of two numbers given as input by the user please now"
    assert idx.first_match([pasted, unrelated]) == ["humaneval/HumanEval/42", None]


def test_twelve_shared_words_are_not_enough_with_13_grams():
    items = load_eval_set_from([{"id": "q1", "question": " ".join(f"t{i}" for i in range(30))}])
    idx = NgramIndex(items, 13)
    assert idx.first_match([" ".join(f"t{i}" for i in range(12))]) == [None]
    assert idx.first_match(["intro " + " ".join(f"t{i}" for i in range(5, 18))]) == ["user/q1"]


def test_short_items_are_matched_whole_and_tiny_ones_left_out():
    items = load_eval_set_from([{"id": "s", "question": "what is the capital of peru"}, {"id": "t", "question": "hi there"}])
    idx = NgramIndex(items, 13)
    assert idx.skipped_items == 1
    assert idx.first_match(["Quick: what is the capital of Peru?", "hi there friend", "capital of peru"]) == [None, None, None]
    assert idx.first_match(["so what is the capital of peru today"]) == ["user/s"]


def load_eval_set_from(rows: list[dict], tmp: Path | None = None):
    import tempfile

    d = Path(tempfile.mkdtemp())
    p = d / "eval.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_eval_set(EvalSetConfig(name="user", path=str(p)))


def test_bad_eval_set_names_the_line(tmp_path: Path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"question": "fine"}\n{"nothing": 1}\n')
    with pytest.raises(EvalSetError, match="line 2: no text field"):
        load_eval_set(EvalSetConfig(name="e", path=str(p)))
    p.write_text('{"question": "fine"}\n{oops\n')
    with pytest.raises(EvalSetError, match="line 2: invalid JSON"):
        load_eval_set(EvalSetConfig(name="e", path=str(p)))
