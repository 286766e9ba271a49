"""The EAGLE-3 reduced draft vocabulary: token counts, the `d2t`/`t2d` tensors, their checks and file.

Owns counting target tokens over loss-masked positions, choosing the `draft_vocab_size` most
frequent ones, and the safetensors file holding `d2t`, `t2d` and `counts`. Promises: the choice is
deterministic (count descending, then target id ascending; unseen ids fill up in ascending order);
draft ids follow ascending target id, so `d2t[i] = target_id(i) - i` is a non-decreasing int64
offset and `d2t + arange(n)` is exactly what SGLang builds as `hot_token_id`; `validate_vocab`
names every way these tensors can be silently wrong (docs/contracts.md, silent failure 5); the file is
written atomically and read without pickle. A vocab is fixed once built, so it also estimates what it
will cover of tokens it was not chosen from (split-half), and says when the tokens extracted later fall
short of that, or when it was built from too little data to fill it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save

from storage.datasets import write_bytes_atomic

FORMAT = "eagle3-draft-vocab/1"
_FLUSH_TOKENS = 1 << 22  # masked ids buffered before one bincount: ~32 MiB of int64 at most


class TokenCounter:
    """Accumulates loss-masked token counts over any number of batches.

    Sample indices in errors are global (counted since the counter was made), so a bad sample can
    be found in the stream. Masked ids are buffered and counted with one `np.bincount` per
    ~4M tokens: a bincount per sample would cost O(target vocab) each time.
    """

    def __init__(self, target_vocab_size: int) -> None:
        if target_vocab_size <= 0:
            raise ValueError(f"target_vocab_size must be positive, got {target_vocab_size}")
        self.target_vocab_size = int(target_vocab_size)
        self.samples_seen = 0
        self.tokens_seen = 0  # loss-masked tokens only
        self._counts = np.zeros(self.target_vocab_size, dtype=np.int64)
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def add(self, input_ids: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray) -> None:
        index = self.samples_seen
        ids = np.asarray(input_ids)
        mask = np.asarray(loss_mask)
        if ids.ndim != 1 or mask.ndim != 1:
            raise ValueError(f"sample {index}: input_ids and loss_mask must be 1-D, got shapes {ids.shape} and {mask.shape}")
        if ids.shape != mask.shape:
            raise ValueError(f"sample {index}: {len(ids)} input_ids but {len(mask)} loss_mask entries")
        if ids.size:
            if ids.dtype.kind not in "iu":
                raise ValueError(f"sample {index}: input_ids must be integers, got dtype {ids.dtype}")
            # Every id is checked, not only masked ones: an id outside the vocabulary anywhere
            # means the data was tokenized for another model.
            lo, hi = ids.min(), ids.max()
            if lo < 0 or hi >= self.target_vocab_size:
                bad = int(lo) if lo < 0 else int(hi)
                pos = int(np.flatnonzero(ids == bad)[0])
                raise ValueError(
                    f"sample {index}: token id {bad} at position {pos} is outside the target "
                    f"vocabulary [0, {self.target_vocab_size})"
                )
            masked = ids[mask.astype(bool, copy=False)].astype(np.int64, copy=False)
            self._buffer.append(masked)
            self._buffered += masked.size
            self.tokens_seen += masked.size
        self.samples_seen += 1
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def update(self, samples: Iterable[tuple[Sequence[int], Sequence[int]]]) -> TokenCounter:
        for input_ids, loss_mask in samples:
            self.add(input_ids, loss_mask)
        return self

    def _flush(self) -> None:
        if self._buffer:
            ids = np.concatenate(self._buffer)
            self._counts += np.bincount(ids, minlength=self.target_vocab_size)
            self._buffer, self._buffered = [], 0

    @property
    def counts(self) -> np.ndarray:
        """A copy of the counts so far (int64, length target vocab)."""
        self._flush()
        return self._counts.copy()


def count_tokens(samples: Iterable[tuple[Sequence[int], Sequence[int]]], target_vocab_size: int) -> np.ndarray:
    """Counts of each target id over loss-masked positions; batches add up: `counts += count_tokens(...)`.

    Sample indices in errors are relative to this call; use `TokenCounter` for stream-wide ones.
    """
    return TokenCounter(target_vocab_size).update(samples).counts


@dataclass(frozen=True)
class DraftVocab:
    """A reduced vocabulary. Draft id i maps to target id `draft_to_target[i]` (ascending)."""

    draft_to_target: np.ndarray  # int64, strictly increasing target ids
    d2t: np.ndarray  # int64 offsets: draft_to_target - arange(draft_vocab_size)
    t2d: np.ndarray  # bool, length target vocab, True where the target id has a draft id
    counts: np.ndarray  # int64 counts the vocab was chosen from
    coverage: float  # share of counted (loss-masked) tokens the draft vocab can produce
    n_seen: int  # distinct target ids with a non-zero count
    n_filled: int  # unseen ids added (ascending) because fewer than draft_vocab_size were seen

    @property
    def draft_vocab_size(self) -> int:
        return len(self.draft_to_target)

    @property
    def target_vocab_size(self) -> int:
        return len(self.t2d)

    def to_draft(self, target_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Draft id of each target id, -1 where the target id is not in the draft vocab."""
        t = np.asarray(target_ids, dtype=np.int64)
        pos = np.searchsorted(self.draft_to_target, t)
        clipped = np.minimum(pos, self.draft_vocab_size - 1)
        hit = (pos < self.draft_vocab_size) & (self.draft_to_target[clipped] == t)
        return np.where(hit, pos, -1)

    def to_target(self, draft_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        return self.draft_to_target[np.asarray(draft_ids, dtype=np.int64)]


def _check_counts(counts: np.ndarray) -> np.ndarray:
    c = np.asarray(counts)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"counts must be a non-empty 1-D array, got shape {c.shape}")
    if c.dtype.kind not in "iu":
        raise ValueError(f"counts must be integers, got dtype {c.dtype}")
    if c.min() < 0:
        raise ValueError(f"counts must be non-negative; target id {int(np.argmin(c))} has {int(c.min())}")
    return c.astype(np.int64, copy=False)


def _from_target_ids(draft_to_target: np.ndarray, counts: np.ndarray, n_filled: int) -> DraftVocab:
    n = len(draft_to_target)
    t2d = np.zeros(len(counts), dtype=bool)
    t2d[draft_to_target] = True
    total = int(counts.sum())
    return DraftVocab(
        draft_to_target=draft_to_target,
        d2t=draft_to_target - np.arange(n, dtype=np.int64),
        t2d=t2d,
        counts=counts,
        coverage=int(counts[draft_to_target].sum()) / total if total else 0.0,
        n_seen=int(np.count_nonzero(counts)),
        n_filled=n_filled,
    )


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """The `draft_vocab_size` most frequent target ids, ties by ascending id, draft ids by ascending target id."""
    c = _check_counts(counts)
    if not 0 < draft_vocab_size <= len(c):
        raise ValueError(f"draft_vocab_size must be in [1, {len(c)}] (the target vocab), got {draft_vocab_size}")
    if c.sum() == 0:
        # A vocab from no tokens is arbitrary: an empty dataset or all-zero loss masks upstream.
        raise ValueError("counts are all zero: no loss-masked tokens were counted")
    # A stable sort on -count keeps equal counts in ascending id order, so ties, and the unseen
    # (count 0) ids that fill a short vocab, come out lowest id first whatever the input order.
    chosen = np.argsort(-c, kind="stable")[:draft_vocab_size]
    n_filled = max(0, draft_vocab_size - int(np.count_nonzero(c)))
    return _from_target_ids(np.sort(chosen).astype(np.int64), c, n_filled)


def validate_vocab(
    d2t: np.ndarray | None, t2d: np.ndarray | None, target_vocab_size: int, draft_vocab_size: int
) -> list[str]:
    """Every problem with a `d2t`/`t2d` pair, one readable line each; an empty list means valid.

    Convention checked: `d2t` int64 offsets with `d2t[i] + i` strictly increasing target ids in
    range, `t2d` a bool mask of length `target_vocab_size` marking exactly those ids.
    """
    problems: list[str] = []
    n, v = int(draft_vocab_size), int(target_vocab_size)
    if n <= 0 or n > v:
        problems.append(f"draft_vocab_size {n} is not in [1, target_vocab_size={v}]")

    ids: np.ndarray | None = None  # target ids d2t maps to, when d2t is usable at all
    absolute = "d2t looks like absolute target ids, not offsets: write d2t[i] = target_id(i) - i"
    if d2t is None:
        problems.append("d2t is missing: the server would propose draft ids as if they were target ids")
    else:
        d = np.asarray(d2t)
        if d.dtype != np.int64:
            problems.append(f"d2t dtype is {d.dtype}, expected int64")
        if d.ndim != 1 or len(d) != n:
            problems.append(f"d2t has shape {d.shape}, expected ({n},)")
        elif d.dtype.kind in "iu" or (d.dtype.kind == "f" and np.all(d == np.round(d))):
            d = d.astype(np.int64)
            ids = d + np.arange(n, dtype=np.int64)
        else:
            problems.append("d2t holds non-integer values")

    if ids is not None:
        d = ids - np.arange(n, dtype=np.int64)
        out = (ids < 0) | (ids >= v)
        if out.any():
            first = int(np.argmax(out))
            problems.append(
                f"d2t maps {int(out.sum())} draft ids outside the target vocab [0, {v}) "
                f"(first: draft id {first} -> target id {int(ids[first])})"
            )
            # Absolute ids sorted ascending are in range themselves and strictly increasing, and
            # adding i to them runs past the vocab: the classic offsets/absolute mix-up.
            if d.min() >= 0 and d.max() < v and (n == 1 or np.all(np.diff(d) > 0)):
                problems.append(absolute)
        steps = np.diff(ids)
        if (steps <= 0).any():
            first = int(np.argmax(steps <= 0))
            problems.append(
                f"d2t target ids are not strictly increasing (draft id {first + 1} -> {int(ids[first + 1])} "
                f"after {first} -> {int(ids[first])}); the convention orders draft ids by ascending target id"
            )

    if t2d is None:
        problems.append("t2d is missing")
        return problems
    t = np.asarray(t2d)
    if t.dtype != np.bool_:
        problems.append(f"t2d dtype is {t.dtype}, expected bool")
    if t.ndim != 1 or len(t) != v:
        problems.append(f"t2d has shape {t.shape}, expected ({v},) (the target vocab size)")
        return problems
    if t.dtype != np.bool_ and not np.isin(t, (0, 1)).all():
        problems.append("t2d holds values other than 0/1")
    mask = t.astype(bool)
    if int(mask.sum()) != n:
        problems.append(f"t2d marks {int(mask.sum())} target ids, expected draft_vocab_size={n}")

    if ids is not None:
        marked = np.flatnonzero(mask)
        d = ids - np.arange(n, dtype=np.int64)
        if n > 1 and len(marked) == n and np.array_equal(d, marked):
            # Proof, not a guess: d2t holds exactly the ids t2d marks. The t2d mismatch that
            # follows from it would only repeat the same fault.
            if absolute not in problems:
                problems.append(absolute + " (d2t equals the ids t2d marks)")
            return problems
        inside = (ids >= 0) & (ids < v)
        unmarked = inside & ~mask[np.clip(ids, 0, v - 1)]
        if unmarked.any():
            first = int(np.argmax(unmarked))
            problems.append(
                f"t2d disagrees with d2t: {int(unmarked.sum())} draft ids map to target ids t2d does not mark "
                f"(first: draft id {first} -> target id {int(ids[first])})"
            )
            for shift in (-1, 1):  # name an off-by-one when that explains every mismatch
                s = ids - shift
                if ((s >= 0) & (s < v)).all() and mask[s].all():
                    problems.append(f"d2t is off by {shift:+d}: d2t[i] + i is {shift:+d} from every id t2d marks")
    return problems


def save_vocab(vocab: DraftVocab, path: str | Path) -> Path:
    """Write `d2t` (int64), `t2d` (bool: safetensors has a BOOL dtype) and `counts` atomically."""
    problems = validate_vocab(vocab.d2t, vocab.t2d, vocab.target_vocab_size, vocab.draft_vocab_size)
    if problems:
        raise ValueError("refusing to save an invalid draft vocab:\n" + "\n".join(problems))
    target = Path(path)
    data = save(
        {
            "d2t": np.ascontiguousarray(vocab.d2t, dtype=np.int64),
            "t2d": np.ascontiguousarray(vocab.t2d, dtype=np.bool_),
            "counts": np.ascontiguousarray(vocab.counts, dtype=np.int64),
        },
        metadata={
            "format": FORMAT,
            "target_vocab_size": str(vocab.target_vocab_size),
            "draft_vocab_size": str(vocab.draft_vocab_size),
            "n_filled": str(vocab.n_filled),
        },
    )
    write_bytes_atomic(data, target)
    return target


def load_vocab(path: str | Path) -> DraftVocab:
    """Read a file written by `save_vocab` (safetensors, no pickle); raises if it fails `validate_vocab`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta: dict[str, str] = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a draft vocab file (format {meta.get('format')!r}, expected {FORMAT!r})")
    tensors = load_file(str(path))
    missing = {"d2t", "t2d", "counts"} - tensors.keys()
    if missing:
        raise ValueError(f"{path}: missing tensors {sorted(missing)}")
    d2t, t2d, counts = tensors["d2t"], tensors["t2d"], _check_counts(tensors["counts"])
    v, n = int(meta["target_vocab_size"]), int(meta["draft_vocab_size"])
    problems = validate_vocab(d2t, t2d, v, n)
    if len(counts) != v:
        problems.append(f"counts has length {len(counts)}, expected target_vocab_size={v}")
    if problems:
        raise ValueError(f"{path}: invalid draft vocab:\n" + "\n".join(problems))
    return _from_target_ids(d2t + np.arange(n, dtype=np.int64), counts, int(meta.get("n_filled", 0)))


def coverage_report(vocab: DraftVocab, counts: np.ndarray | None = None) -> dict[str, Any]:
    """How well the vocab covers `counts` (default: the counts it was built from); JSON-ready.

    Pass counts from held-out data to see coverage the training counts did not pick for.
    """
    c = vocab.counts if counts is None else _check_counts(counts)
    if len(c) != vocab.target_vocab_size:
        raise ValueError(f"counts has length {len(c)}, the vocab's target vocab has {vocab.target_vocab_size}")
    total = int(c.sum())
    in_vocab = c[vocab.draft_to_target]
    covered = int(in_vocab.sum())
    desc = np.sort(c)[::-1]
    cum = np.cumsum(desc)
    top_share = {str(k): (int(cum[k - 1]) / total if total else 0.0) for k in (1, 10, 100, 1000, 10000) if k <= len(c)}
    # The most frequent tokens the vocab cannot produce: where coverage is lost.
    outside = np.flatnonzero(~vocab.t2d & (c > 0))
    worst = outside[np.argsort(-c[outside], kind="stable")[:10]]
    return {
        "target_vocab_size": vocab.target_vocab_size,
        "draft_vocab_size": vocab.draft_vocab_size,
        "total_tokens": total,
        "covered_tokens": covered,
        "coverage": covered / total if total else 0.0,
        "distinct_seen": int(np.count_nonzero(c)),
        "distinct_seen_in_vocab": int(np.count_nonzero(in_vocab)),
        "draft_ids_never_seen": int(np.count_nonzero(in_vocab == 0)),
        "n_filled_at_build": vocab.n_filled,
        "min_count_in_vocab": int(in_vocab.min()),
        "top_k_share": top_share,
        "top_missed": [[int(i), int(c[i])] for i in worst],
    }


# Coverage points the tokens extracted later may fall below the expected coverage before a warning:
# a few points is sampling noise between rounds.
VOCAB_DRIFT_TOLERANCE = 0.02


def split_half_coverage(first: np.ndarray, second: np.ndarray, draft_vocab_size: int) -> float | None:
    """What a vocab of this size chosen from this data is expected to cover of tokens it was not chosen from:
    the mean of each half's vocab's coverage of the other half (`first` and `second`: the counts of two
    halves of the samples). None when a half has no tokens.

    A vocab's coverage of the tokens it was chosen from is in-sample: one larger than the ids its data used
    covers all of that data, while later rounds bring ids it never saw. On the selection study's regenerated
    tokens (benchmarks/README, selection), 8,192 ids chosen from the first 12.5K covered 100% of them, 89.6%
    of the last 118K of 418K, and the estimate said 85.5%; chosen from the first 200K: 100%, 91.3%, 90.9%."""
    a, b = _check_counts(first), _check_counts(second)
    if not a.sum() or not b.sum():
        return None
    size = min(draft_vocab_size, len(a))
    return (coverage_report(build_draft_vocab(a, size), b)["coverage"]
            + coverage_report(build_draft_vocab(b, size), a)["coverage"]) / 2


def thin_vocab_warning(vocab: DraftVocab, expected: float | None = None) -> str | None:
    """A warning when the vocab was built from data too small to fill it; None when it was not."""
    if not vocab.n_filled:
        return None
    return (f"the draft vocab was built from {int(vocab.counts.sum()):,} loss-masked tokens, which used only "
            f"{vocab.n_seen:,} distinct target ids: {vocab.n_filled:,} of its {vocab.draft_vocab_size:,} ids were "
            "never seen (filled in ascending target id). Its 100% coverage of that data says little about later "
            "rounds" + ("" if expected is None else f": expected coverage of new tokens {expected:.1%} (split-half)")
            + "; each extract reports its own")


def vocab_drift_warning(vocab: DraftVocab, later: dict[str, Any], expected: float | None = None,
                        tolerance: float = VOCAB_DRIFT_TOLERANCE) -> str | None:
    """A warning when `later` (`coverage_report(vocab, counts)` of tokens extracted after the vocab was built)
    is covered more than `tolerance` below `expected` (a built vocab's `split_half_coverage`; None: the
    in-sample `vocab.coverage`, for a vocab built before the estimate was recorded); None when it is not.

    The draft can never propose a target id outside its vocab, and training masks those positions: later
    rounds covered worse than the vocab's own data predicts (new domains, another language) cap acceptance
    with no error.
    """
    goal = vocab.coverage if expected is None else expected
    if not later["total_tokens"] or later["coverage"] >= goal - tolerance:
        return None
    missed = ", ".join(f"{i} ({n:,})" for i, n in later["top_missed"][:5])
    basis = (f"{vocab.coverage:.1%} of the {int(vocab.counts.sum()):,} it was built from" if expected is None else
             f"the {expected:.1%} expected of new tokens ({vocab.coverage:.1%} of the {int(vocab.counts.sum()):,} "
             "it was built from)")
    return (f"the draft vocab covers {later['coverage']:.1%} of the {later['total_tokens']:,} loss-masked tokens "
            f"extracted now, against {basis}: the draft can never propose the other {1 - later['coverage']:.1%}, "
            f"and training masks them (target ids missed most, with counts: {missed}). The vocab is fixed for "
            "this tokenisation; a larger draft_vocab_size (coverage of new tokens grows more with the size than "
            "with the data a vocab is chosen from) builds one from every generation so far: a new extract key, "
            "so everything is extracted again, and a new run_name to train")
