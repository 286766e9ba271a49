"""The extract -> train rounds: extract until the disk budget is full, train (which deletes the shards
it consumed), again until nothing is left.

Owns the round loop that the `pipeline` flow and the scaling study both run, the two rules that
end it, and the errors it stops with. The loops inside a stage are the stage's own: filling the
budget shard by shard is extract's (flows/extract.py, tasks/extract/plan.py), a round's epochs
are train's (tasks/train/loop.py), shard files and their states are storage/shards.py's.

Promises: the stages are called in order, extract then train, once per round (a round with
nothing left to extract trains only); a round that can make no progress raises (`RoundsStuck`,
with the pipeline's `PipelineStuck`) instead of looping for ever; `max_rounds` stops after that
many rounds, leaving the rest to the next run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class RoundsError(RuntimeError):
    """The rounds cannot go on."""


class RoundsStuck(RoundsError):
    """A round made no progress: the next would do the same."""


class PipelineStuck(RoundsStuck):
    """The rounds cannot go on: the disk budget is full and nothing in it can be trained on."""


@dataclass(frozen=True)
class Round:
    number: int                   # 1, 2, ...
    limit: int | None             # the samples extraction was asked for (None: every pending one)
    extracted: Any | None         # the extract stage's summary; None when the round had nothing to extract
    trained: Any                  # the train stage's summary


class StopRule(Protocol):
    """When the rounds end: what each round extracts, and whether the round just run was the last."""

    def to_extract(self) -> int | None:
        """Samples the next round extracts: None every pending one, 0 or less none (train only)."""

    def finished(self, r: Round) -> bool:
        """True: stop after `r`; False: run another round. Raises RoundsError when another cannot help."""


@dataclass(frozen=True)
class RoundsDone:
    rounds: int
    stopped_by: str  # done | max_rounds


def run_rounds(extract: Callable[[int, int | None], Any], train: Callable[[int], Any], rule: StopRule, *,
               max_rounds: int | None = None, after_round: Callable[[Round], None] | None = None) -> RoundsDone:
    """Rounds of `extract(number, limit)` then `train(number)` until `rule` says the last one ran.

    `after_round` sees each round before the rule does (the pipeline benchmarks a round's export there).
    """
    number = 0
    while True:
        number += 1
        limit = rule.to_extract()
        extracted = None if limit is not None and limit <= 0 else extract(number, limit)
        r = Round(number, limit, extracted, train(number))
        if after_round is not None:
            after_round(r)
        if rule.finished(r):
            return RoundsDone(number, "done")
        if max_rounds is not None and number >= max_rounds:
            return RoundsDone(number, "max_rounds")


@dataclass
class UntilExtractionDone:
    """The pipeline's rule: go on while extraction stopped at the full disk budget and the round moved.

    Done when extraction stopped for another reason (nothing pending, its sample limit) or training
    reached max_steps (the next run continues). Stuck when the budget is full, nothing was written
    and training freed nothing: the shards belong to another run, or one shard exceeds the budget.
    """

    disk_budget_bytes: int
    run_name: str

    def to_extract(self) -> int | None:
        return None

    def finished(self, r: Round) -> bool:
        ex, tr = r.extracted, r.trained
        if ex.stopped_by != "budget" or tr.stopped_by == "max_steps":
            return True  # every pending sample is extracted and trained on (or a step/sample limit was reached)
        if ex.shards_written == 0 and tr.shards_deleted == 0:
            raise PipelineStuck(
                f"the disk budget ({self.disk_budget_bytes} B) is full of shards this training run "
                f"({self.run_name}) cannot consume, and the next shard does not fit: raise "
                "extract.disk_budget_bytes or train the other run that owns them")
        return False


@dataclass
class UntilAllSampled:
    """The studies' rule: extract exactly the generations not yet sampled (`remaining()`), train on them,
    until none is left; one round when everything fits the budget.

    Every round's training must run out of data: a study's point holds all of it. Stuck when an
    extraction leaves as many generations as it was asked for.
    """

    remaining: Callable[[], int]

    def to_extract(self) -> int | None:
        return self.remaining()

    def finished(self, r: Round) -> bool:
        if r.trained.stopped_by not in ("done", "no_data"):
            raise RoundsError(f"training stopped by {r.trained.stopped_by} (train.max_steps?)")
        left = self.remaining()
        if left <= 0:
            return True
        if r.extracted is not None and left == r.limit:
            raise RoundsStuck(f"extraction makes no progress ({left} generations left)")
        return False
